"""The UCX port is a second door into the daemon: a peer that never says
hello must not reach its memory.  ucxx's default context turns on UCP RMA,
which over tcp is emulated with active messages that read and write any
address the peer names (the tcp remote key is empty).  A small C peer built
against the wheel's own libucp tries ``ucp_get_nbx`` and ``ucp_put_nbx`` at
the address of a tenant's stored bytes, found through ``/proc/PID/mem``.
Both must fail and the bytes must stay."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import DaemonProc
from rpcbuf import RpcBufError
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.runs import run_tag

NATIVE = Path(__file__).parent / "native"


def _libucx() -> Path | None:
    try:
        import libucx
    except ImportError:
        return None
    root = Path(libucx.__file__).parent
    return root if (root / "include" / "ucp" / "api" / "ucp.h").exists() else None


@pytest.fixture(scope="module")
def rma_peer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    lib = _libucx()
    if cc is None:
        pytest.skip("no C compiler here: the UCP attacker is a C program")
    if lib is None:
        pytest.skip("the libucx wheel ships no UCP headers here")
    out = tmp_path_factory.mktemp("native") / "ucp_rma_peer"
    subprocess.run([cc, "-O1", "-o", str(out), str(NATIVE / "ucp_rma_peer.c"),
                    f"-I{lib / 'include'}", f"-L{lib / 'lib'}", "-lucp", "-lucs",
                    f"-Wl,-rpath,{lib / 'lib'}"], check=True, capture_output=True, timeout=120)
    return out


def _find(pid: int, pattern: bytes) -> int | None:
    """The address of ``pattern`` in the pool: a writable memfd mapping of
    process ``pid`` (a buffer's pages; copies in transit buffers come and go)."""
    maps = [m for m in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/memfd:" in m]
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) rw", line)
            if m is None:
                continue
            lo, hi = int(m.group(1), 16), int(m.group(2), 16)
            step = 8 << 20
            for at in range(lo, hi, step):
                try:
                    mem.seek(at)
                    chunk = mem.read(min(step + len(pattern), hi - at))
                except OSError:
                    break
                i = chunk.find(pattern)
                if i >= 0:
                    return at + i
    return None


def _peek(pid: int, addr: int, n: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(addr)
        return mem.read(n)


def _attack(peer: Path, d: DaemonProc, addr: int, n: int, *op: str, eager: bool = False) -> str:
    """The C peer at the daemon's UCX port, never saying hello; ``eager``:
    every message carries its payload (no rendezvous)."""
    env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo",
           "UCX_WARN_UNUSED_ENV_VARS": "n", **({"UCX_RNDV_THRESH": "inf"} if eager else {})}
    run = subprocess.run([str(peer), "127.0.0.1", str(d.ucx_port), hex(addr), str(n), *op],
                         capture_output=True, text=True, timeout=60, env=env)
    return run.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/mem")
async def test_unauthenticated_peer_cannot_get_or_put_daemon_memory(
        daemon_factory, rma_peer: Path) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:64MiB", "--keep-freed", "0")
    secret = np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8)
    async with d.connect("alice", same_host=False) as ctx:
        buf = await ctx.request_buffer(size=1 << 20, name="victim")
        await ctx.store_tensor(buf, secret)
        addr = _find(d.proc.pid, secret.tobytes())
        assert addr is not None, "the test could not find the tenant's bytes in the daemon"

        got = _attack(rma_peer, d, addr, 64, "get")
        assert not got.startswith("get ok " + secret[:64].tobytes().hex()), got
        assert got.startswith("get failed"), got

        # The peer's own verdict on a put is not the test: over tcp a flush
        # completes once the bytes left, handled or not.  The bytes are.
        put = _attack(rma_peer, d, addr, 64, "put", "0x41")
        assert put.startswith(("put ok", "put failed")), put
        assert _peek(d.proc.pid, addr, 64) == secret[:64].tobytes()
        back = await ctx.read_buffer(buf, offset=0, nbytes=secret.nbytes)
        assert bytes(back) == secret.tobytes()
        await ctx.release_buffer(buf)
    assert d.proc.poll() is None, "the attack killed the daemon"


async def test_data_plane_listens_on_the_listen_host_only(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """With ``--listen 127.0.0.1`` and no UCX_NET_DEVICES, UCX's tcp transport
    used every interface, each with a listening socket of its own.  Now only
    the interface of the listen host; ``stats`` (and doctor) list every socket.
    ucxx's listener itself takes no address (ucxx 0.52): its port is the one
    wildcard left, and stats says so."""
    d = daemon_factory("--device", "cpu:16MiB", env={"UCX_NET_DEVICES": ""})
    async with d.connect("alice", same_host=False) as ctx:
        st = await ctx.stats()
    listening = st["listening"]
    port = d.addr.rsplit(":", 1)[1]
    assert f"127.0.0.1:{port}" in listening
    others = [a for a in listening if not a.endswith(f":{d.ucx_port}")]
    assert len(others) >= 2, listening  # control + UCX's own tcp port
    assert all(a.startswith("127.0.0.1:") for a in others), listening
    assert "UCX_NET_DEVICES=lo" in d.log()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


async def test_messages_nobody_asked_for_are_dropped_not_kept(
        daemon_factory, rma_peer: Path) -> None:  # type: ignore[no-untyped-def]
    """A peer that never says hello sends tagged 8000-byte messages with tags
    no request expects.  UCP kept them all, worker-wide, for ever (three
    floods: three times the memory).  Now the janitor drops what is older
    than the hello deadline: the memory is reused, not added to, and a
    tenant's stores meanwhile are untouched."""
    d = daemon_factory("--device", "cpu:64MiB", "--hello-timeout", "1s")
    n, size = 6000, 8000
    start = _rss(d.proc.pid)
    grown = []
    async with d.connect("alice", same_host=False) as ctx:
        buf = await ctx.request_buffer(size=1 << 20)
        data = np.arange(1 << 18, dtype=np.float32)
        for _ in range(3):
            out = _attack(rma_peer, d, n, size, "flood")
            assert out == f"flood {n}", out
            await ctx.store_tensor(buf, data, verify="checksum")
            for _ in range(100):  # the janitor's rounds: a second or two each
                st = await ctx.stats()
                if st["ucx_unexpected_dropped"] >= n * (len(grown) + 1):
                    break
                await asyncio.sleep(0.1)
            grown.append(_rss(d.proc.pid) - start)
        assert st["ucx_unexpected_dropped"] == 3 * n, st
        back = await ctx.read_buffer(buf, offset=0, nbytes=data.nbytes)
        assert bytes(back) == data.tobytes()
        await ctx.release_buffer(buf)
    # One flood's worth is held at most (UCP's pools keep their size), never three.
    assert grown[2] < grown[0] + n * size // 2, grown
    assert "UCX messages" in d.log()  # (under pressure the counts come a period at a time)


async def test_a_tenant_waiting_for_memory_does_not_hold_off_the_sweep(
        daemon_factory, rma_peer: Path) -> None:  # type: ignore[no-untyped-def]
    """The sweep spares old messages only while a network store has not
    posted its receives.  A request that carries no payload (a request_buffer
    waiting for memory, up to its own timeout) held it off for the whole
    --transfer-timeout, keeping an unauthenticated flood that long."""
    d = daemon_factory("--device", "cpu:16MiB", "--hello-timeout", "1s",
                       "--transfer-timeout", "300s")
    async with d.connect("alice", same_host=False) as ctx:
        held = await ctx.request_buffer(size=16 << 20)
        waiting = asyncio.create_task(ctx.request_buffer(size=16 << 20, timeout=60))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        out = _attack(rma_peer, d, 2000, 8000, "flood")
        assert out == "flood 2000", out
        for _ in range(150):  # two or three 1 s rounds, not 300 s
            if (await ctx.stats())["ucx_unexpected_dropped"] >= 2000:
                break
            await asyncio.sleep(0.1)
        assert (await ctx.stats())["ucx_unexpected_dropped"] == 2000
        assert not waiting.done()
        await ctx.release_buffer(held)
        await ctx.release_buffer(await waiting)


async def _withheld_store(ctx, buf: str, nbytes: int) -> tuple[int, asyncio.Future]:  # type: ignore[no-untyped-def,type-arg]
    """A UCX store whose request goes out but whose payload does not (yet):
    the daemon posts its receive and holds the buffer's lock meanwhile."""
    conn = ctx._caller.conn
    req_id = conn.next_id()
    return req_id, conn.submit(req_id, P.Store(buffer_id=buf, offset=0, nbytes=nbytes))


async def _a_store_behind_another(ctx, n: int):  # type: ignore[no-untyped-def]
    """A buffer of ``n`` bytes, a UCX store into it whose payload is withheld
    (it holds the buffer's lock), and a second store waiting for that lock,
    its payload sent (unexpected meanwhile: half a second, 50 janitor ticks)."""
    buf = await ctx.request_buffer(size=n)
    ep = await ctx._paths.ucx.endpoint()
    first, first_answer = await _withheld_store(ctx, buf, n)
    second = asyncio.create_task(ctx.store_tensor(buf, np.full(n, 2, np.uint8)))
    await asyncio.sleep(0.5)
    assert not second.done()
    return buf, ep, first, first_answer, second


async def _dropped(ctx, at_least: int, rounds: int = 150) -> int:  # type: ignore[no-untyped-def]
    for _ in range(rounds):
        n = (await ctx.stats())["ucx_unexpected_dropped"]
        if n >= at_least:
            return int(n)
        await asyncio.sleep(0.1)
    return int((await ctx.stats())["ucx_unexpected_dropped"])


async def test_a_store_waiting_on_its_own_lock_does_not_hold_off_the_sweep(
        daemon_factory, rma_peer: Path) -> None:  # type: ignore[no-untyped-def]
    """Issue 34 (H4): a tenant kept one store waiting on its own buffer's
    lock (held by another of its stores, whose payload it withheld), and the
    sweep was put off for the whole --transfer-timeout (300 s) while a peer
    with no token flooded.  Now it waits one round at most, and the waiting
    store, whose payload went with the flood, fails cleanly with TIMEOUT
    ``payload_dropped`` once it gets the lock; the session goes on."""
    d = daemon_factory("--device", "cpu:16MiB", "--hello-timeout", "1s",
                       "--transfer-timeout", "300s")
    n = 1 << 20
    async with d.connect("alice", same_host=False) as ctx:
        buf, ep, first, first_answer, second = await _a_store_behind_another(ctx, n)
        out = _attack(rma_peer, d, 2000, 8000, "flood")
        assert out == "flood 2000", out
        assert await _dropped(ctx, 2001) >= 2001  # the flood and the waiting payload
        await ep.send(np.full(n, 1, np.uint8), run_tag(first, 0))
        assert (await asyncio.wait_for(first_answer, 30))["ok"]
        with pytest.raises(RpcBufError) as err:
            await asyncio.wait_for(second, 30)
        assert err.value.code == "TIMEOUT" and err.value.details["reason"] == "payload_dropped"
        back = await ctx.read_buffer(buf, offset=0, nbytes=n)
        assert bytes(back) == b"\1" * n  # the first store's bytes, untouched by the second
        await ctx.store_tensor(buf, np.full(n, 3, np.uint8))  # and the session goes on
        assert bytes(await ctx.read_buffer(buf, offset=0, nbytes=16)) == b"\3" * 16
        await ctx.release_buffer(buf)


def _rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


async def test_a_daemon_that_held_many_blocks_is_not_taken_for_a_flood(
        daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 40's benchmark: after a tenant put and removed 250,000 blocks,
    every UCX put on that daemon failed TIMEOUT ``payload_dropped``.  Its
    heap kept what it grew to for the blocks' records, the janitor's
    allowance followed only what was held now, so the daemon looked flooded
    and dropped every payload that waited a tick.  The allowance now follows
    the most records there have been."""
    d = daemon_factory("--device", "cpu:256MiB", "--hello-timeout", "1s",
                       "--transfer-timeout", "60s")
    start = _rss_anon(d.proc.pid)
    keys = [f"k{j}" for j in range(60_000)]
    async with d.connect("alice") as c:  # same host: no UCX, the janitor sleeps
        for i in range(0, len(keys), 4096):
            await c.put_blocks({k: np.full(256, 7, np.uint8) for k in keys[i:i + 4096]})
        assert (await c.stats())["blocks"]["blocks"] == len(keys)
        for i in range(0, len(keys), 4096):
            await c.remove_blocks(keys[i:i + 4096])
    grown = _rss_anon(d.proc.pid) - start
    assert grown > 32 << 20, f"the heap kept only {grown >> 20} MiB: nothing to show"
    n = 1 << 20
    async with d.connect("alice", same_host=False) as ctx:
        buf, ep, first, first_answer, second = await _a_store_behind_another(ctx, n)
        await ep.send(np.full(n, 1, np.uint8), run_tag(first, 0))
        assert (await asyncio.wait_for(first_answer, 30))["ok"]
        await asyncio.wait_for(second, 30)  # was TIMEOUT payload_dropped
        assert bytes(await ctx.read_buffer(buf, offset=0, nbytes=16)) == b"\2" * 16
        assert (await ctx.stats())["ucx_unexpected_dropped"] == 0
        await ctx.release_buffer(buf)


async def test_a_store_behind_max_inflight_fails_cleanly_when_its_payload_was_dropped(
        daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """After hello the reader pauses at --max-inflight without setting the
    ``intake.paused`` that the janitor's deferral read (suspected in issue
    34, confirmed: nothing set it), so a payload whose request waited
    undecoded was dropped and its store then waited for the transfer
    deadline, which aborts the session.  Now the back-pressure itself
    defers one round, and a store whose payload went fails at once with
    TIMEOUT ``payload_dropped`` when it is finally dispatched."""
    d = daemon_factory("--device", "cpu:16MiB", "--hello-timeout", "1s",
                       "--transfer-timeout", "60s", "--max-inflight", "1")
    n = 1 << 20
    async with d.connect("alice", same_host=False) as ctx, \
            d.connect("alice", same_host=False) as watcher:
        buf = await ctx.request_buffer(size=n)
        other = await ctx.request_buffer(size=n)
        ep = await ctx._paths.ucx.endpoint()
        first, first_answer = await _withheld_store(ctx, buf, n)
        second, second_answer = await _withheld_store(ctx, other, n)  # waits undecoded
        await ep.send(np.full(n, 2, np.uint8), run_tag(second, 0))
        assert await _dropped(watcher, 1) >= 1
        await ep.send(np.full(n, 1, np.uint8), run_tag(first, 0))
        assert (await asyncio.wait_for(first_answer, 30))["ok"]
        answer = await asyncio.wait_for(second_answer, 15)  # not the 60 s deadline
        assert not answer["ok"], answer
        assert answer["error"]["code"] == "TIMEOUT", answer
        assert answer["error"]["details"]["reason"] == "payload_dropped", answer
        assert await ctx.ping()
        await ctx.store_tensor(other, np.full(n, 3, np.uint8))
        assert bytes(await ctx.read_buffer(other, offset=0, nbytes=16)) == b"\3" * 16


async def test_a_tokenless_flood_is_bounded_in_bytes(daemon_factory, rma_peer: Path) -> None:  # type: ignore[no-untyped-def]
    """Issue 34 (M5): what a peer with no token makes the daemon hold was
    bounded in time only (what it could send in a hello deadline or two:
    1.5 GB in 6.7 s grew one by 2.3 GB, never given back).  Now by bytes too:
    once the daemon's anonymous memory grew by the janitor's budget (32 MiB)
    everything a tick old is dropped, so three floods of 384 MiB of eager
    64 KiB messages each grow it by 128 MiB at most (they are not added up),
    and a tenant's stores after them are intact."""
    d = daemon_factory("--device", "cpu:16MiB", "--hello-timeout", "10s")
    n, size = 6144, 64 << 10
    async with d.connect("alice", same_host=False) as ctx:
        buf = await ctx.request_buffer(size=1 << 20)
        data = np.arange(1 << 18, dtype=np.float32)
        await ctx.store_tensor(buf, data)
        start, peak = _rss(d.proc.pid), 0
        for _ in range(3):
            out = _attack(rma_peer, d, n, size, "flood", eager=True)
            assert out == f"flood {n}", out
            peak = max(peak, _rss(d.proc.pid) - start)
        assert await _dropped(ctx, 3 * n, rounds=300) == 3 * n
        peak = max(peak, _rss(d.proc.pid) - start)
        assert peak <= 128 << 20, f"grew by {peak >> 20} MiB"
        await ctx.store_tensor(buf, data, verify="checksum")
        back = await ctx.read_buffer(buf, offset=0, nbytes=data.nbytes)
        assert bytes(back) == data.tobytes()
    assert "dropped" in d.log()
