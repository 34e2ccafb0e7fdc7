"""Faults: clients SIGKILLed at random points (before/after request,
mid-store, mid-read), and a daemon SIGKILLed under load and restarted.
A store that was acknowledged reads back exactly; nothing leaks; clients of
a dead daemon get CONNECTION_LOST, never a hang."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from rawwire import free_and_sessions, hello, scaled, wait_for

import rpcbuf
from conftest import ROOT, DaemonProc
from rpcbuf.control.wire.errors import ConnectionLost

pytestmark = pytest.mark.both_paths  # the same-host and the UCX data path

HERE = Path(__file__).resolve().parent
KILLS = scaled(6, 40)
CHUNK, CHUNKS = 1 << 20, 12


@pytest.fixture(scope="module")
def fault_daemon(daemon_factory) -> DaemonProc:  # type: ignore[no-untyped-def]
    return daemon_factory("--device", "cpu:128MiB")  # type: ignore[no-any-return]


def kill_at(d: DaemonProc, name: str, stage: str, rng: random.Random) -> list[int]:
    """Run a fault client, SIGKILL it at ``stage``; return the chunks it saw acked."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, str(HERE / "fault_client.py"), d.addr,
                             d.token("faulty"), name, str(CHUNK), str(CHUNKS)],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    acked: list[int] = []
    try:
        assert proc.stdout is not None
        want = {"before_request": "connected", "after_request": "requested",
                "mid_store": f"acked {rng.randrange(CHUNKS - 2)}", "mid_read": "reading"}[stage]
        deadline = time.monotonic() + 60
        for line in proc.stdout:
            if line.startswith("acked "):
                acked.append(int(line.split()[1]))
            if line.startswith(want) or time.monotonic() > deadline:
                break
        time.sleep(rng.uniform(0, 0.02))
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:  # acks printed before the kill landed
            for line in proc.stdout.read().splitlines():
                if line.startswith("acked "):
                    acked.append(int(line.split()[1]))
            proc.stdout.close()
    return acked


def test_clients_killed_at_random_points(fault_daemon: DaemonProc) -> None:
    kill_clients(fault_daemon, ["before_request", "after_request", "mid_read"], KILLS)


def test_clients_killed_mid_store(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    # Short deadlines: a receive the killed client left behind must not pin
    # memory (or hold up SIGTERM) for the default 300 s / 30 s.
    d = daemon_factory("--device", "cpu:128MiB", "--transfer-timeout", "3s",
                       "--drain-timeout", "2s")
    kill_clients(d, ["mid_store"], max(2, KILLS // 2))


def kill_clients(d: DaemonProc, stages: list[str], kills: int) -> None:
    rng = random.Random(int(os.environ.get("RPCBUF_SEED", "5")))
    probe = hello(d.addr, d.token("probe"))
    start = free_and_sessions(probe)
    owner = hello(d.addr, d.token("faulty"))
    for i in range(kills):
        stage = stages[i % len(stages)]
        name = f"victim{i}"
        acked = kill_at(d, name, stage, rng)
        assert d.proc.poll() is None, d.log()[-3000:]
        found = owner.call("open_buffer", name=name)
        if not found["ok"]:
            assert not acked and found["error"]["code"] == "NOT_FOUND"
            continue
        bid = found["result"]["buffer_id"]
        with rpcbuf_ctx(d) as read:
            for k in acked:  # every acknowledged store reads back exactly
                back = read(bid, k * CHUNK, CHUNK)
                assert (back == k % 251).all(), f"{stage}: acked chunk {k} differs"
        assert owner.call("release", buffer_id=bid)["ok"]
    owner.close()
    end = wait_for(probe, start)
    probe.close()
    assert end == start, f"leak after killed clients: {start} -> {end}"


@contextlib.contextmanager
def rpcbuf_ctx(d: DaemonProc):  # type: ignore[no-untyped-def]
    """A synchronous reader (its own event loop) for the sync test above."""
    loop = asyncio.new_event_loop()
    ctx = loop.run_until_complete(rpcbuf.connect(d.addr, d.token("faulty"), timeout=30))
    try:
        yield lambda bid, off, n: loop.run_until_complete(ctx.read_buffer(bid, off, n))
    finally:
        loop.run_until_complete(ctx.close())
        loop.close()


async def test_daemon_killed_and_restarted(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProc = daemon_factory("--device", "cpu:64MiB")
    acked: dict[int, np.ndarray] = {}
    async with d.connect() as ctx:
        bid = await ctx.request_buffer(16 << 20)
        killer = asyncio.get_running_loop().call_later(0.5, d.proc.send_signal, signal.SIGKILL)
        lost: Exception | None = None
        try:
            async with asyncio.timeout(30):
                for k in range(10_000):
                    data = np.full(1 << 20, k % 251, dtype=np.uint8)
                    await ctx.store_tensor(bid, data, offset=(k % 16) << 20)
                    acked[k % 16] = data  # OK means stored: check it while the daemon lives
                    back = await ctx.read_buffer(bid, (k % 16) << 20, 1 << 20)
                    assert np.array_equal(back, data)
        except ConnectionLost as exc:
            lost = exc
        finally:
            killer.cancel()
        assert lost is not None, "the client did not notice the daemon died"
        assert acked, "no store completed before the kill"
        with pytest.raises(ConnectionLost):
            await ctx.ping()
    assert d.proc.wait(10) == -signal.SIGKILL

    fresh: DaemonProc = daemon_factory("--device", "cpu:64MiB")
    async with fresh.connect() as ctx:
        bid = await ctx.request_buffer(1 << 20)
        data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
        await ctx.store_tensor(bid, data, verify="checksum")
        assert np.array_equal(await ctx.read_buffer(bid), data)
        await ctx.release_buffer(bid)
