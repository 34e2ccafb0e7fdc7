"""The UCX janitor's byte bar (no UCX needed: the decision is plain code).

Its memory budget counted every byte the daemon's anonymous memory grew by as
the unexpected queue's, so a daemon whose own heap grew for what tenants hold
(many blocks, many sessions) would drop every payload a tick old for good.
What tenants hold, each bounded by its quota, now moves the bar."""

from __future__ import annotations

from rpcbuf.dataplane.janitor import Janitor

MiB = 1 << 20


def test_the_daemons_own_growth_moves_the_bar() -> None:
    held = [0]
    j = Janitor(10.0, 10.0, budget=32 * MiB, allowance=lambda: held[0])
    ref = 100 * MiB
    assert not j.over_budget(ref + 32 * MiB, ref)
    assert j.over_budget(ref + 33 * MiB, ref)  # nothing held: that is a flood
    held[0] = 200 * MiB  # e.g. 25,000 blocks' records
    assert not j.over_budget(ref + 220 * MiB, ref)
    assert j.over_budget(ref + 233 * MiB, ref)  # past what they explain, and the budget
    held[0] = 0  # they went: the bar comes back down, it never ratchets up on its own
    assert j.over_budget(ref + 40 * MiB, ref)
