"""A model load is all-or-nothing (issue 24, item 8).

Two real daemons that share a secret (one token for both).  A load that is
cancelled after its first slot's tensors landed, and ``rpcbuf load`` sent
SIGINT or SIGTERM mid-way, leave nothing behind: no buffer, the pools'
free bytes back.  A loader killed with SIGKILL cleans up nothing: what it
left shows as incomplete in ``rpcbuf models`` and ``model_info``, and
``attach_model`` refuses it, naming what is missing.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

import rpcbuf
from conftest import ROOT, DaemonProc, start_daemon
from models import llama_tensors, write_safetensors

TENANT = "interrupted"
PLACEMENT = "0:prolog,3;1:all,epilog"  # node A: embeddings and 3 layers; B: the rest


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProc]]:
    base = tmp_path_factory.mktemp("interrupted")
    a = start_daemon(base / "a", "--device", "cpu:112MiB")
    (base / "b").mkdir()
    shutil.copy(base / "a" / "secret", base / "b" / "secret")  # one cluster secret
    b = start_daemon(base / "b", "--device", "cpu:112MiB")
    yield [a, b]
    for d in (a, b):
        if d.proc.poll() is None:
            assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_safetensors(tmp_path_factory.mktemp("small") / "small.safetensors",
                             llama_tensors(6))


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 68 MiB: big enough that a signal lands mid-load."""
    return write_safetensors(tmp_path_factory.mktemp("big") / "big.safetensors",
                             llama_tensors(8, hidden=512, ffn=1536, vocab=8192))


def endpoints(nodes: list[DaemonProc]) -> list[str]:
    return [n.addr for n in nodes]


@pytest.fixture
async def cluster(nodes: list[DaemonProc]) -> AsyncIterator[rpcbuf.Cluster]:
    async with rpcbuf.Cluster.connect(endpoints(nodes), nodes[0].token(TENANT)) as c:
        free = [d["free"] for d in await c.devices()]
        yield c
        await assert_clean(c, free)


async def assert_clean(c: rpcbuf.Cluster, free: list[int], timeout: float = 10.0) -> None:
    """No buffer left on any node and every pool's free bytes back."""
    deadline = time.monotonic() + timeout
    while True:
        left = {a: [b["name"] for b in bs] for a, bs in (await c.list_buffers()).items()}
        now = [d["free"] for d in await c.devices()]
        if (not any(left.values()) and now == free) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert not any(left.values()), f"buffers left behind: {left}"
    assert now == free, "memory leaked"


async def load_cancelled(cluster: rpcbuf.Cluster, path: Path, name: str,
                         when: Callable[[str, int, int], bool]) -> bool:
    """Load ``path`` as ``name`` and cancel the load at the first progress
    report ``when(addr, done, total)`` holds for; whether it was (the load
    must end cancelled)."""
    task: asyncio.Task[rpcbuf.LoadResult] | None = None
    hit = False

    def report(addr: str, done: int, total: int) -> None:
        nonlocal hit
        if task is not None and not hit and when(addr, done, total):
            hit = True
            task.cancel()

    task = asyncio.ensure_future(rpcbuf.load_model(
        cluster, path, PLACEMENT, name=name, progress=False, batch_bytes=16 << 10,
        on_progress=report))
    with pytest.raises(asyncio.CancelledError):
        await task
    return hit


def cli_env() -> dict[str, str]:
    return {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT / "src")}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rpcbuf.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=60, env=cli_env())


async def test_a_load_cancelled_after_its_first_slot_landed_leaves_nothing(
        cluster: rpcbuf.Cluster, nodes: list[DaemonProc], small: Path) -> None:
    a = nodes[0].addr
    landed = await load_cancelled(cluster, small, "cancelled",
                                  lambda addr, done, total: addr == a and done == total)
    assert landed, "the load ended before node A's slot landed"
    # the fixture checks that nothing is left and the memory is back


async def test_a_crashed_loader_leaves_a_model_that_is_flagged_and_refused(
        cluster: rpcbuf.Cluster, nodes: list[DaemonProc], small: Path) -> None:
    """The loader process is killed with SIGKILL mid-upload: nothing cleans up."""
    token = nodes[0].token(TENANT)
    script = (
        "import asyncio, os, signal, sys, rpcbuf\n"
        "seen = {}\n"
        "def maybe_die(addr, done, total):\n"
        "    seen[addr] = done\n"
        "    if len(seen) == 2:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "async def main():\n"
        "    async with rpcbuf.Cluster.connect(sys.argv[1].split(';'), sys.argv[2]) as c:\n"
        "        await rpcbuf.load_model(c, sys.argv[3], sys.argv[4], name='crashed',\n"
        "                                progress=False, batch_bytes=16 << 10,\n"
        "                                on_progress=maybe_die, hash_cache=False)\n"
        "asyncio.run(main())\n")
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", script, ";".join(endpoints(nodes)), token,
                         str(small), PLACEMENT], capture_output=True, text=True, timeout=60,
        env=cli_env())
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    res = await asyncio.to_thread(cli, "models", "--endpoints", ";".join(endpoints(nodes)),
                                  "--token", token, "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)["models"]["crashed"]
    assert got["complete"] is False, got
    assert got["problems"], got
    res = await asyncio.to_thread(cli, "models", "--endpoints", ";".join(endpoints(nodes)),
                                  "--token", token)
    assert "crashed" in res.stdout, res.stdout
    assert "model 'crashed' is incomplete" in res.stderr, res.stderr
    for addr in endpoints(nodes):
        info = await rpcbuf.model_info(cluster[addr], "crashed")
        assert info.complete is False and info.problems
        ctx = cluster[addr]
        if ctx.same_host:
            with pytest.raises(rpcbuf.NotFound, match="incomplete") as err:
                await rpcbuf.attach_model(ctx, "crashed")
            assert err.value.details["reason"] == "incomplete"
    await rpcbuf.unload_model(cluster, "crashed")


async def test_a_finished_load_is_complete_and_a_reload_over_it_too(
        cluster: rpcbuf.Cluster, nodes: list[DaemonProc], small: Path) -> None:
    for _ in range(2):  # the second finds everything in place
        await rpcbuf.load_model(cluster, small, PLACEMENT, name="whole", progress=False)
        for addr in endpoints(nodes):
            info = await rpcbuf.model_info(cluster[addr], "whole")
            assert info.complete and not info.problems, info.problems
    ctx = cluster[nodes[0].addr]
    res = await asyncio.to_thread(cli, "models", "--endpoints", ";".join(endpoints(nodes)),
                                  "--token", nodes[0].token(TENANT), "--json")
    assert json.loads(res.stdout)["models"]["whole"]["complete"] is True, res.stdout
    if ctx.same_host:
        async with rpcbuf.attach_model(ctx, "whole") as m:
            assert "model.embed_tokens.weight" in m and "__rpcbuf_load__" not in m
    await rpcbuf.unload_model(cluster, "whole")


async def test_an_interrupted_reload_over_a_complete_model_leaves_it_incomplete(
        cluster: rpcbuf.Cluster, nodes: list[DaemonProc], small: Path,
        tmp_path: Path) -> None:
    """The re-load (other bytes, same names: a fine-tune) reuses the
    model's buffers in place: its planned records replace the old commit
    before any tensor changes, so the half-overwritten model is never
    complete; the reused buffers stay (they hold verified tensors)."""
    await rpcbuf.load_model(cluster, small, PLACEMENT, name="re", progress=False)
    tuned = write_safetensors(tmp_path / "tuned.safetensors", llama_tensors(6, seed=5))
    await load_cancelled(cluster, tuned, "re", lambda addr, done, total: True)
    for addr in endpoints(nodes):
        info = await rpcbuf.model_info(cluster[addr], "re")
        assert not info.complete and any("did not finish" in p for p in info.problems), \
            info.problems
    await rpcbuf.unload_model(cluster, "re")


async def loading(cluster: rpcbuf.Cluster, name: str, timeout: float = 30.0) -> None:
    """Wait until some slot buffer of ``name`` holds a tensor: the load is under way."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for bufs in (await cluster.list_buffers()).values():
            if any(b["name"].startswith(name + "/") and b.get("tensor_count", 0) > 0
                   for b in bufs):
                return
        await asyncio.sleep(0.02)
    raise AssertionError("the load never started")


@pytest.mark.parametrize("sig,code,again", [(signal.SIGINT, 130, None),
                                            (signal.SIGTERM, 143, None),
                                            (signal.SIGINT, 130, signal.SIGINT),
                                            (signal.SIGINT, 130, signal.SIGTERM)])
async def test_rpcbuf_load_interrupted_by_a_signal_cleans_up_and_says_one_line(
        cluster: rpcbuf.Cluster, nodes: list[DaemonProc], big: Path, sig: int,
        code: int, again: int | None) -> None:
    """``again``: a second signal while the cleanup runs (an impatient
    Ctrl-C) does not cut it short; seen: a second Ctrl-C raised
    KeyboardInterrupt out of the loop, its buffers stayed, yet the CLI said
    they were released."""
    name = f"sig{int(sig)}-{int(again or 0)}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rpcbuf.cli", "load", str(big), "--endpoints",
         ";".join(endpoints(nodes)), "--token", nodes[0].token(TENANT), "--name", name,
         "--batch-size", "1MiB", "--no-hash-cache"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=cli_env())
    try:
        await loading(cluster, name)
        proc.send_signal(sig)
        if again is not None:
            await asyncio.sleep(0.01)
            proc.send_signal(again)
        out, err = await asyncio.to_thread(proc.communicate, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, (proc.returncode, out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "interrupted" in err
