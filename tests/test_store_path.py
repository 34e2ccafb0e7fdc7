"""How far a store travels in the daemon: one warm ``store_tensor`` is
recorded in a real rpcbufd (``sys.setprofile`` on its loop's thread and any
thread it starts, between two signals) and the daemon's modules it ran code
in are counted.  Issue 25's bound: at most 10 (docs/architecture.md, "One
store, end to end", names them); a same-host store large enough for the ring
adds the copy threads (``dataplane.copypool``), 11.  A same-host store
into a buffer of our own written in place (issue 35) runs no daemon code at
all once the grant is there: 0."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import numpy as np
import pytest

from conftest import start_daemon
from rpcbuf.control.wire import protocol as P

TRACER = r"""
import json, os, signal, sys, threading
seen = {}
root = os.path.dirname(os.path.dirname(__import__("rpcbuf").__file__))
def prof(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(root):
        seen.setdefault(frame.f_code.co_filename[len(root) + 1:-3].replace("/", "."), 1)
def on(*_):
    seen.clear(); sys.setprofile(prof); threading.setprofile(prof)
def off(*_):
    sys.setprofile(None); threading.setprofile(None)
    with open(os.environ["TRACE_OUT"] + ".tmp", "w") as fh:
        json.dump(sorted(seen), fh)
    os.rename(os.environ["TRACE_OUT"] + ".tmp", os.environ["TRACE_OUT"])
signal.signal(signal.SIGUSR1, on); signal.signal(signal.SIGUSR2, off)
from rpcbuf.control.daemon.service.main import main
sys.exit(main(sys.argv[1:]))
"""

CASES = [("tcp", 4096, 10), ("tcp", 1 << 20, 10), ("same-host", 4096, 10),
         ("same-host", 1 << 20, 10), ("same-host", 64 << 20, 11), ("in-place", 4096, 0),
         ("in-place", 64 << 20, 0)]


@pytest.mark.parametrize(("path", "size", "most"), CASES,
                         ids=[f"{p}-{s}" for p, s, _ in CASES])
async def test_a_store_crosses_at_most_ten_daemon_modules(
        tmp_path: Path, path: str, size: int, most: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RPCBUF_SAME_HOST", raising=False)
    monkeypatch.setenv("RPCBUF_IN_PLACE", "1" if path == "in-place" else "0")
    out = tmp_path / "trace.json"
    d = start_daemon(tmp_path, env={"TRACE_OUT": str(out)}, launch=("-c", TRACER))
    try:
        async with d.connect(**({"same_host": False} if path == "tcp" else {})) as ctx:
            assert ctx.same_host == (path != "tcp")
            buf = await ctx.request_buffer(size)
            data = np.ones(size, np.uint8)
            for _ in range(5):  # warm: what a first store sets up is not the path
                await ctx.store_tensor(buf, data)
            d.proc.send_signal(signal.SIGUSR1)
            await asyncio.sleep(0.3)
            await ctx.store_tensor(buf, data)
            if path == "in-place":  # something the tracer must see: it is on
                await ctx._caller.call(P.Ping())
            await asyncio.sleep(0.3)
            d.proc.send_signal(signal.SIGUSR2)
            for _ in range(100):
                if out.exists():
                    break
                await asyncio.sleep(0.05)
            await ctx.release_buffer(buf)
    finally:
        d.stop()
    mods = [m for m in json.loads(out.read_text()) if m.startswith("rpcbuf.control.daemon.")]
    if path == "in-place":  # the ping ran in the daemon; no store did
        assert "rpcbuf.control.daemon.sessions.session" in mods, mods
        data = {m for m in mods if m.endswith(("dataops", "mapops", "paths", "handles"))}
        assert not data, "\n".join(mods)
        return
    # the walk sees the store (a test that cannot fail is a defect)
    assert {"rpcbuf.control.daemon.data.pipeline", "rpcbuf.control.daemon.ops.dataops"} <= set(mods)
    assert len(mods) <= most, "\n".join(mods)
