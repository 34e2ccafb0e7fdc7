"""The table of what each tenant holds (``accounting/charges.py``), and the
registry charging a host buffer's fd and mapping through it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from rpcbuf.control.daemon.accounting.charges import (
    Charges,
    Limit,
    fd_reserve,
    handle_limits,
)
from rpcbuf.control.daemon.accounting.registry import Pool, Registry
from rpcbuf.control.wire.errors import QuotaExceeded
from rpcbuf.dataplane.arena import HostArena


def test_charge_refund_and_the_table() -> None:
    c = Charges({"fds": Limit(3, 5, "--max-fds-per-tenant", "--fd-reserve")})
    c.charge("alice", "fds", 2)
    c.charge("bob", "fds", 1)
    assert c.table("alice") == {"fds": {"held": 2, "limit": 3}}
    assert c.totals()["fds"] == {"held": 3, "limit": 5, "per_owner_limit": 3,
                                 "largest_owner": 2, "refused": 0}
    with pytest.raises(QuotaExceeded, match="--max-fds-per-tenant") as info:
        c.charge("alice", "fds", 2)
    assert info.value.details == {"limit": "fds", "flag": "--max-fds-per-tenant", "held": 2,
                                  "requested": 2, "max": 3}
    c.charge("carol", "fds", 2)  # the node's 5 now
    with pytest.raises(QuotaExceeded, match="--fd-reserve") as info:
        c.charge("dave", "fds")
    assert info.value.details["limit"] == "node_fds"
    assert c.held("dave", "fds") == 0  # a refused charge changed nothing
    assert c.totals()["fds"]["refused"] == 2
    c.refund("alice", "fds", 2)
    assert c.table("alice") == {"fds": {"held": 0, "limit": 3}}
    with pytest.raises(RuntimeError):
        c.refund("alice", "fds")  # never charged: a bug, said
    c.charge("unlimited-kind-owner", "other", 10**9)  # a kind with no limit is counted only
    c.check_invariants()


def test_a_source_is_an_owner_too() -> None:
    c = Charges({"connections": Limit(1)})
    c.charge(("ip", "10.0.0.1"), "connections")
    with pytest.raises(QuotaExceeded, match="source"):
        c.charge(("ip", "10.0.0.1"), "connections")
    c.charge(("ip", "10.0.0.2"), "connections")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["fds", "x"]),
                          st.integers(0, 4), st.booleans()), max_size=60))
def test_never_past_a_limit_and_totals_add_up(steps: list[tuple[str, str, int, bool]]) -> None:
    c = Charges({"fds": Limit(5, 9), "x": Limit(None, 6)})
    for owner, kind, n, take in steps:
        if take:
            before = c.held(owner, kind), c.total(kind)
            try:
                c.charge(owner, kind, n)
            except QuotaExceeded:
                assert (c.held(owner, kind), c.total(kind)) == before
        elif c.held(owner, kind) >= n:
            c.refund(owner, kind, n)
        c.check_invariants()
        for o in "abc":
            assert c.held(o, "fds") <= 5
        assert c.total("fds") <= 9 and c.total("x") <= 6


def test_the_node_budget_keeps_a_reserve_and_halves_per_tenant() -> None:
    reserve = fd_reserve(max_sessions=1024, max_unauthenticated=512)
    limits = handle_limits(20000, reserve, 4096, None, 65530)
    fds = limits["fds"]
    assert fds.node == 20000 - reserve - 4096
    assert fds.per_owner == fds.node // 2  # one tenant cannot take the node's budget
    assert handle_limits(20000, reserve, 4096, 100, 65530)["fds"].per_owner == 100
    assert handle_limits(1024, reserve, 4096, None, 65530)["fds"].node == 128  # tiny limits
    assert limits["mappings"].node == (65530 - 16384) // 2


def test_the_registry_charges_a_host_buffers_fd_and_mapping() -> None:
    pool = Pool.create(HostArena(1 << 20), "buddy")
    charges = Charges({"fds": Limit(2, 10, "--max-fds-per-tenant"),
                       "mappings": Limit(2, 10)})
    reg = Registry([pool], charges=charges)
    a = reg.try_allocate("alice", pool, 4096)
    b = reg.try_allocate("alice", pool, 4096)
    assert a is not None and b is not None
    free = pool.allocator.stats().free
    with pytest.raises(QuotaExceeded, match="--max-fds-per-tenant"):
        reg.try_allocate("alice", pool, 4096)
    assert pool.allocator.stats().free == free  # refused before anything was allocated
    assert reg.try_allocate("bob", pool, 4096) is not None  # nobody else notices
    assert reg.stats("alice")["limits"]["fds"] == {"held": 2, "limit": 2}
    assert reg.stats("alice")["limits"]["buffers"]["held"] == 2
    reg.release(a)
    assert charges.held("alice", "fds") == 1 and charges.held("alice", "mappings") == 1
    assert reg.try_allocate("alice", pool, 4096) is not None
    charges.check_invariants()
