"""Released memory kept for reuse (``--keep-freed``): the next buffer of the
same block gets the kept memfd, zeroed, never another tenant's bytes; a
block that was attached (its fd handed out) is never kept.  Real daemons,
real bytes over both data paths."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import rpcbuf
from conftest import metrics_url, pool_gauge

pytestmark = pytest.mark.both_paths  # the same-host and the UCX data path

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _through_the_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    """These writers copy through the daemon: a block its owner wrote in
    place is never kept at all (``test_map.py`` shows that)."""
    monkeypatch.setenv("RPCBUF_IN_PLACE", "0")


@pytest.fixture(scope="module")
def keeping(daemon_factory):  # type: ignore[no-untyped-def]
    return daemon_factory("--device", "cpu:256MiB", "--metrics", "127.0.0.1:0")


async def _secret_then_fresh(d: Any, size: int) -> tuple[np.ndarray, int]:
    """alice fills a buffer with her bytes and releases it; bob asks for the
    same size at once: bob's whole buffer as read back, and the reuse count."""
    url = metrics_url(d)
    before = pool_gauge(url, "reused_blocks")
    async with d.connect("alice") as a, d.connect("bob") as b:
        bid = await a.request_buffer(size, name="secret")
        await a.store_tensor(bid, np.full(size, 0xA5, np.uint8))
        await a.release_buffer(bid)
        mine = await b.request_buffer(size, name="mine")
        got = await b.read_buffer(mine, 0, size)
        await b.release_buffer(mine)
    return np.frombuffer(got, np.uint8), pool_gauge(url, "reused_blocks") - before


@pytest.mark.parametrize("size", [4096, 3 * MIB, 48 * MIB], ids=["4KiB", "3MiB", "48MiB"])
async def test_another_tenant_gets_the_kept_block_all_zero(keeping, size: int) -> None:  # type: ignore[no-untyped-def]
    got, reused = await _secret_then_fresh(keeping, size)
    assert reused == 1  # the same block, kept: the test is about that case
    assert got.size == size and not got.any()


async def test_many_requests_while_large_blocks_are_zeroed(keeping) -> None:  # type: ignore[no-untyped-def]
    """Pipelined request / open / read of a large kept block: whatever is
    read, by the requester or by another connection of its tenant that
    opens it by name meanwhile, is zero."""
    async with keeping.connect("alice") as a:
        bid = await a.request_buffer(32 * MIB, name="big")
        await a.store_tensor(bid, np.full(32 * MIB, 0x3C, np.uint8))
        await a.release_buffer(bid)
    async with keeping.connect("bob") as b1, keeping.connect("bob") as b2:
        async def peek() -> bytes | None:
            deadline = asyncio.get_running_loop().time() + 10  # bounded, however slow CI is
            while asyncio.get_running_loop().time() < deadline:
                try:
                    other = await b2.open_buffer("x")
                except rpcbuf.NotFound:
                    await asyncio.sleep(0)
                    continue
                return bytes(await b2.read_buffer(other, 0, 32 * MIB))
            return None

        mine, seen = await asyncio.gather(b1.request_buffer(32 * MIB, name="x"), peek())
        assert seen is not None and not any(seen)
        assert not np.frombuffer(await b1.read_buffer(mine, 0, 32 * MIB), np.uint8).any()
        await b1.release_buffer(mine)


async def test_keep_freed_0_keeps_nothing(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:64MiB", "--metrics", "127.0.0.1:0",
                       "--keep-freed", "0")
    got, reused = await _secret_then_fresh(d, MIB)
    assert reused == 0 and not got.any()


async def test_an_attached_block_is_never_kept(keeping) -> None:  # type: ignore[no-untyped-def]
    url = metrics_url(keeping)
    async with keeping.connect("alice") as a:
        if not a.same_host:
            pytest.skip("attach needs the same-host path")
        bid = await a.request_buffer(MIB)
        await a.store_tensor(bid, np.full(MIB, 7, np.uint8))
        async with a.attach(bid) as view:
            assert (view.array(0, 16) == 7).all()
        before = pool_gauge(url, "reused_blocks")
        await a.release_buffer(bid)
        again = await a.request_buffer(MIB)
        # its memfd left the daemon once: a fresh one
        assert pool_gauge(url, "reused_blocks") == before
        assert not np.frombuffer(await a.read_buffer(again, 0, MIB), np.uint8).any()
        await a.release_buffer(again)
