"""A cancelled load releases exactly the buffers it made (``acquire.make``,
``commit.abort``): a request still on its way when the load is cancelled is
waited for, and the id it answers released.  Before, the cleanup looked the
slot's buffer up by name: a buffer another loader of the tenant had made
under that name meanwhile was released, and one the node made for us after
the look-up was left behind.  A unit test of that logic, on a stand-in for
the cluster (the integration tests are in tests/hardening/test_interrupted_loads.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from rpcbuf.models import acquire, commit as CM, slots


class Node:
    def __init__(self) -> None:
        self.granted = asyncio.Event()
        self.released: list[str] = []
        self.listed = 0

    async def request_buffer(self, *args: Any, **kw: Any) -> str:
        await self.granted.wait()  # the node is slow to answer
        return "ours"

    async def release_buffer(self, buffer_id: str, timeout: float | None = None) -> None:
        self.released.append(buffer_id)

    async def list_buffers(self, timeout: float | None = None) -> list[dict[str, Any]]:
        self.listed += 1
        return [{"buffer_id": "another-loaders", "name": "m/slot0"}]


def _job() -> Any:
    plan = SimpleNamespace(slot=SimpleNamespace(endpoint="n0", slot=0))
    return slots.SlotJob(plan, [], "m/slot0")  # type: ignore[arg-type]


async def test_a_request_on_its_way_at_the_cancel_is_waited_for_and_released_by_id() -> None:
    node, j = Node(), _job()
    making = asyncio.create_task(acquire.make(j, node.request_buffer(1 << 20)))
    await asyncio.sleep(0)
    making.cancel()  # the load is cancelled while the request is on its way
    aborting = asyncio.create_task(CM.abort({"n0": node}, [j]))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert not aborting.done()  # it waits for the request
    node.granted.set()  # the node makes the buffer after the cancel
    await asyncio.wait_for(aborting, 5)
    assert node.released == ["ours"] and node.listed == 0  # by id, never by name
    assert j.created and j.released and j.making is None
