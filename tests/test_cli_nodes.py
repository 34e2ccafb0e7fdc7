"""The CLI over several nodes (issue 28, items 4 and 5): every command that
names a buffer finds it on whichever node of ``$RPCBUF_ENDPOINTS`` holds it
and reports per node; ``get MODEL --tensor NAME`` reads one tensor of a
loaded model from the slot (and node) that holds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import ROOT, DaemonProc


@pytest.fixture(scope="module")
def two(daemon_factory) -> tuple[DaemonProc, DaemonProc]:  # type: ignore[no-untyped-def]
    a: DaemonProc = daemon_factory("--device", "cpu:32MiB")
    b: DaemonProc = daemon_factory("--device", "cpu:32MiB", "--secret-file", str(a.secret_file))
    return a, b


def cli(two: tuple[DaemonProc, DaemonProc], *args: str, cwd: Path = ROOT,
        endpoints: str | None = None) -> subprocess.CompletedProcess[str]:
    a, b = two
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "80",
           "RPCBUF_ENDPOINTS": endpoints or f"{a.addr};{b.addr}", "RPCBUF_TOKEN": a.token("nodes")}
    res = subprocess.run([sys.executable, "-m", "rpcbuf.cli", *args], capture_output=True,
                         text=True, timeout=120, cwd=cwd, env=env)
    assert "Traceback" not in res.stdout + res.stderr, res.stderr
    return res


def as_json(res: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(res.stdout)


def test_get_release_and_bench_find_the_node_that_holds_the_buffer(
        two: tuple[DaemonProc, DaemonProc], tmp_path: Path) -> None:
    a, b = two
    arr = np.arange(60, dtype=np.int32).reshape(3, 20)
    np.save(tmp_path / "w.npy", arr)
    put = cli(two, "put", str(tmp_path / "w.npy"), "--name", "w", endpoints=b.addr)
    assert put.returncode == 0, put.stderr
    # Before: get said NOT_FOUND at the first endpoint (a) and stopped there.
    got = cli(two, "get", "w", "--out", str(tmp_path / "back.npy"))
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith(f"{b.addr}: wrote "), got.stdout
    assert np.array_equal(np.load(tmp_path / "back.npy"), arr)
    res = cli(two, "get", put.stdout.strip(), "--out", str(tmp_path / "by_id.npy"), "--json")
    assert res.returncode == 0 and list(as_json(res)) == [b.addr], res.stdout

    # Before: release tried every node, and exited 1 for the one without it.
    rel = cli(two, "release", "w")
    assert rel.returncode == 0 and rel.stderr == "", rel.stderr
    assert rel.stdout == f"{b.addr}: released {put.stdout.strip()} (w)\n", rel.stdout
    gone = cli(two, "get", "w", "--out", str(tmp_path / "again.npy"))
    assert gone.returncode == 1 and f"no buffer 'w' on any of 2 nodes ({a.addr}, {b.addr})" \
        in gone.stderr and "[NOT_FOUND]" in gone.stderr, gone.stderr
    again = cli(two, "release", "w", "--json")
    assert again.returncode == 1 and as_json(again)["error"]["code"] == "NOT_FOUND", again.stdout

    # One name on two nodes: get does not choose for the user.
    for node in (a, b):
        assert cli(two, "put", str(tmp_path / "w.npy"), "--name", "dup",
                   endpoints=node.addr).returncode == 0
    res = cli(two, "get", "dup", "--out", str(tmp_path / "dup.npy"))
    assert res.returncode == 1 and "is on 2 nodes" in res.stderr and "--endpoint" in res.stderr
    assert not (tmp_path / "dup.npy").exists()
    rel = cli(two, "release", "dup")
    assert rel.returncode == 0 and len(rel.stdout.splitlines()) == 2, rel.stdout
    assert {line.split(": ")[0] for line in rel.stdout.splitlines()} == {a.addr, b.addr}

    # bench: every node, one row per node and size.
    res = cli(two, "bench", "--sizes", "4KiB", "--duration", "0.2s", "--json")
    assert res.returncode == 0 and sorted(as_json(res)) == sorted([a.addr, b.addr]), res.stdout
    table = cli(two, "bench", "--sizes", "4KiB", "--duration", "0.2s")
    assert a.addr in table.stdout and b.addr in table.stdout and "MiB/s" in table.stdout
    # A node that does not answer is reported; the other still runs.
    res = cli(two, "bench", "--sizes", "4KiB", "--duration", "0.2s",
              endpoints=f"{a.addr};127.0.0.1:1")
    assert res.returncode == 1 and a.addr in res.stdout and "127.0.0.1:1" in res.stderr


def test_get_one_tensor_of_a_model_from_whichever_node_holds_it(
        two: tuple[DaemonProc, DaemonProc], tmp_path: Path) -> None:
    a, b = two
    rng = np.random.default_rng(0)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((64, 16)).astype(np.float16),
               "model.norm.weight": rng.standard_normal(16).astype(np.float16),
               "lm_head.weight": rng.standard_normal((64, 16)).astype(np.float16)}
    tensors |= {f"model.layers.{i}.mlp.up_proj.weight":
                rng.standard_normal((24, 16)).astype(np.float16) for i in range(2)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    res = cli(two, "load", str(tmp_path / "m.safetensors"), "--name", "m",
              "--placement", "0:prolog,1;1:all,epilog")
    assert res.returncode == 0, res.stderr
    try:
        for name in ("model.embed_tokens.weight", "model.norm.weight"):  # one on each node
            got = cli(two, "get", "m", "--tensor", name, cwd=tmp_path)
            assert got.returncode == 0, got.stderr
            assert np.array_equal(np.load(tmp_path / f"{name}.npy"), tensors[name])
        where = {line.split(":")[0] + ":" + line.split(":")[1]
                 for line in (cli(two, "get", "m", "--tensor", n, "--force", cwd=tmp_path).stdout
                              for n in ("model.embed_tokens.weight", "lm_head.weight"))}
        assert where == {a.addr, b.addr}, where
        # A slot's buffer names the tensor too.
        got = cli(two, "get", "m/slot1", "--tensor", "lm_head.weight", "-o",
                  str(tmp_path / "head.npy"))
        assert got.returncode == 0, got.stderr
        assert np.array_equal(np.load(tmp_path / "head.npy"), tensors["lm_head.weight"])

        # Before: "no tensor(s) ['data'] in this buffer's manifest (this tenant has
        # no such buffer there ...)": two halves that contradict each other.
        res = cli(two, "get", "m/slot0", "-o", str(tmp_path / "slot.npy"))
        assert res.returncode == 1 and "none called 'data'" in res.stderr, res.stderr
        assert "--tensor NAME" in res.stderr and "no such buffer" not in res.stderr
        res = cli(two, "get", "m", "--tensor", "nope", "-o", str(tmp_path / "nope.npy"))
        assert res.returncode == 1 and "model 'm' has no tensor 'nope' on any of 2" in res.stderr
        assert "no such buffer" not in res.stderr, res.stderr
        res = cli(two, "get", "no-model", "--tensor", "x", "-o", str(tmp_path / "x.npy"))
        assert res.returncode == 1 and "no buffer or model 'no-model'" in res.stderr, res.stderr
    finally:
        assert cli(two, "unload", "m").returncode == 0
    # Issue 37 item 5: a load with a node down printed each failure twice,
    # once with its raw errno ("[Errno 111] Connect call failed").
    res = cli(two, "load", str(tmp_path / "m.safetensors"), "--name", "m2",
              "--placement", "0:prolog,1;1:all,epilog", endpoints=f"{a.addr};127.0.0.1:1")
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr.count("127.0.0.1:1") == 1, res.stderr
    assert "Errno" not in res.stderr and "cannot reach rpcbufd at 127.0.0.1:1" in res.stderr, \
        res.stderr


def test_a_lapsed_lease_is_named_in_not_found(two: tuple[DaemonProc, DaemonProc],
                                              tmp_path: Path) -> None:
    """Issue 28, item 14: a buffer whose lease ran out is NOT_FOUND with a
    word about its lease, to its own tenant only (another tenant's lookup
    learns nothing)."""
    import time

    import rpcbuf as api

    a, b = two
    np.save(tmp_path / "short.npy", np.zeros(8))
    put = cli(two, "put", str(tmp_path / "short.npy"), "--name", "short", "--ttl", "1s",
              endpoints=b.addr)
    assert put.returncode == 0, put.stderr
    buffer_id = put.stdout.strip()
    deadline = time.monotonic() + 30
    while True:  # the lease runs out a second after the put
        res = cli(two, "get", "short", "-o", str(tmp_path / "s.npy"))
        if res.returncode != 0 or time.monotonic() > deadline:
            break
        (tmp_path / "s.npy").unlink()
        time.sleep(0.5)
    assert res.returncode == 1 and "[NOT_FOUND]" in res.stderr, res.stderr
    assert f"{b.addr}: no buffer named 'short': its lease ran out" in res.stderr, res.stderr
    assert "renew" in res.stderr
    res = cli(two, "release", buffer_id, "--json", endpoints=b.addr)
    (err,) = as_json(res).values()
    assert err["details"]["reason"] == "lease_expired" and err["code"] == "NOT_FOUND", err

    async def other_tenant() -> None:
        async with api.connect(b.addr, token=a.token("someone-else"), timeout=30) as ctx:
            for look in (ctx.open_buffer("short"), ctx.get_buffer_meta(buffer_id)):
                try:
                    await look
                except api.NotFound as exc:
                    assert "lease" not in exc.message and not exc.details, exc
                else:
                    raise AssertionError("another tenant's lapsed buffer was found")

    import asyncio
    asyncio.run(other_tenant())
