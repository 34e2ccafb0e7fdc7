"""The control connection lost mid-transfer: whatever state a UCX transfer is
in when the daemon's control connection ends (EOF or reset), the client's
call fails with CONNECTION_LOST at once, never waits on UCX.  The daemon is
SIGSTOPped mid-transfer (so no UCX reset comes from it) and a proxy in front
of its control port cuts the connection: only the client's reaction to the
lost control connection can end the transfer."""

from __future__ import annotations

import asyncio
import signal
import time

import numpy as np
import pytest

import rpcbuf
from conftest import DaemonProc
from rpcbuf.control.wire.errors import ConnectionLost


class Proxy:
    """A TCP proxy to the daemon's control port that can cut every connection."""

    def __init__(self, target: str) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(self.host, self.port)
        self.writers += [w, uw]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(r, uw), pipe(ur, w))

    def cut(self) -> None:
        for w in self.writers:
            w.close()

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.mark.parametrize("op", ["read", "store"])
async def test_control_lost_mid_transfer_fails_at_once(daemon_factory, op: str) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProc = daemon_factory("--device", "cpu:600MiB")
    proxy = Proxy(d.addr)
    addr = await proxy.start()
    size = 256 << 20
    data = np.ones(size, dtype=np.uint8)
    try:
        ctx = await rpcbuf.connect(addr, token=d.token(), timeout=30, same_host=False)
        bid = await ctx.request_buffer(size)
        await ctx.store_tensor(bid, data)
        loop = asyncio.get_running_loop()

        def stop_and_cut() -> None:
            d.proc.send_signal(signal.SIGSTOP)
            proxy.cut()

        call = ctx.read_buffer(bid, 0, size) if op == "read" else ctx.store_tensor(bid, data)
        loop.call_later(0.05, stop_and_cut)
        t0 = time.monotonic()
        with pytest.raises(ConnectionLost):
            async with asyncio.timeout(20):
                await call
        took = time.monotonic() - t0
        assert took < 5, f"{op} took {took:.1f}s to notice the lost connection"
        await ctx.close()
    finally:
        d.proc.send_signal(signal.SIGCONT)
        await proxy.close()
