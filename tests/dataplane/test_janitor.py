"""The UCX janitor's byte bar and its wait (no UCX needed: plain code).

Its memory budget counted every byte the daemon's anonymous memory grew by as
the unexpected queue's, so a daemon whose own heap grew for what tenants hold
(many blocks, many sessions) would drop every payload a tick old for good.
What tenants hold, each bounded by its quota, now moves the bar."""

from __future__ import annotations

import asyncio
import time

from rpcbuf.dataplane.janitor import Janitor
from rpcbuf.dataplane.progress import Activity

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


async def test_an_idle_janitor_waits_for_ucx_not_for_a_timer() -> None:
    """CI ran 60 idle daemons, each reading its memory every 10 ms (1.5 % of
    a core apiece: most of a core in all) and the suite took 50 minutes.
    While UCX has been quiet, the janitor's wait lasts until UCX does
    something or the oldest sentinel's round is due; a tick while it works."""
    j = Janitor(30.0, 30.0)
    activity = Activity()
    j._sent.append((1, time.monotonic()))  # the round is due in 30 s
    waiting = asyncio.ensure_future(j._idle(activity))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # quiet: no tick, no timer short of the round
    activity.note()  # UCX progressed (a message came in)
    await asyncio.wait_for(waiting, 1.0)
    started = time.monotonic()
    await j._idle(activity)  # at work: one tick
    assert time.monotonic() - started < 1.0
    j._sent.clear()
    j._sent.append((2, time.monotonic() - 30.0))  # a round is due: no wait for UCX
    activity.last = 0.0
    await asyncio.wait_for(j._idle(activity), 1.0)
