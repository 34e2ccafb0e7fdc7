"""The ``rpcbuf`` CLI as an operator runs it: real subprocesses against a real
daemon, including the errors (exit 1 with the daemon's code, exit 2 for a
local problem or a bad flag, never a traceback)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import ROOT, DaemonProc


@pytest.fixture(scope="module")
def cli_daemon(daemon_factory) -> DaemonProc:  # type: ignore[no-untyped-def]
    return daemon_factory("--device", "cpu:64MiB")  # type: ignore[no-any-return]


def rpcbuf(d: DaemonProc | None, *args: str, tenant: str = "cli",
           timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "160"}
    env.pop("RPCBUF_TOKEN", None)
    if d is not None:
        env["RPCBUF_ENDPOINTS"] = d.addr
        env["RPCBUF_TOKEN"] = d.token(tenant)
    res = subprocess.run([sys.executable, "-m", "rpcbuf.cli", *args], capture_output=True,
                         text=True, timeout=timeout, cwd=ROOT, env=env)
    assert "Traceback" not in res.stderr, res.stderr
    return res


def as_json(res: subprocess.CompletedProcess[str]) -> Any:
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def free_bytes(d: DaemonProc) -> int:
    (st,) = as_json(rpcbuf(d, "status", "--json")).values()
    return sum(int(dev["free"]) for dev in st["devices"])


def test_put_ls_get_release_round_trip(cli_daemon: DaemonProc, tmp_path: Path) -> None:
    start = free_bytes(cli_daemon)
    arr = np.arange(3 * 5 * 7, dtype=np.float32).reshape(3, 5, 7)
    np.save(tmp_path / "w.npy", arr)
    put = rpcbuf(cli_daemon, "put", str(tmp_path / "w.npy"), "--name", "w", "--ttl", "1h")
    assert put.returncode == 0, put.stderr
    buffer_id = put.stdout.strip()
    assert buffer_id.startswith("b-")

    (bufs,) = as_json(rpcbuf(cli_daemon, "ls", "--json")).values()
    (row,) = [b for b in bufs if b["buffer_id"] == buffer_id]
    assert row["name"] == "w" and row["tensors"] == 1 and 3500 < row["ttl_left"] <= 3600
    table = rpcbuf(cli_daemon, "ls")
    assert table.returncode == 0 and buffer_id in table.stdout and "tensors" in table.stdout

    for ref, out, flag in ((buffer_id, "by_id.npy", "--out"), ("w", "by_name.npy", "-o")):
        got = rpcbuf(cli_daemon, "get", ref, flag, str(tmp_path / out))
        assert got.returncode == 0, got.stderr
        back = np.load(tmp_path / out)
        assert back.dtype == arr.dtype and back.shape == arr.shape
        assert np.array_equal(back, arr)

    rel = as_json(rpcbuf(cli_daemon, "release", "w", "--json"))
    assert list(rel.values()) == [{"released": buffer_id, "name": "w"}]
    assert free_bytes(cli_daemon) == start


def test_put_without_a_name_names_the_buffer_after_the_file(cli_daemon: DaemonProc,
                                                            tmp_path: Path) -> None:
    np.save(tmp_path / "plain.npy", np.ones(10, dtype=np.int16))
    info = as_json(rpcbuf(cli_daemon, "put", str(tmp_path / "plain.npy"), "--json"))
    assert info["name"] == "plain" and info["shape"] == [10]
    # The CLI's session is gone; the buffer outlived it and is released by name.
    assert rpcbuf(cli_daemon, "release", "plain").returncode == 0


def test_buddy_rounding_is_said_where_it_bites(cli_daemon: DaemonProc, tmp_path: Path) -> None:
    """Issue 37 item 4: a 389 MiB model took 2 x 256 MiB without a word.
    ``put`` says what its buffer takes when that is much more than it
    asked; ``ls`` shows it (``takes``)."""
    np.save(tmp_path / "odd.npy", np.zeros(300_000, np.uint8))  # a 512 KiB block
    res = rpcbuf(cli_daemon, "put", str(tmp_path / "odd.npy"))
    assert res.returncode == 0, res.stderr
    assert "takes a block of 512.0 KiB on cpu:0" in res.stderr, res.stderr
    (bufs,) = as_json(rpcbuf(cli_daemon, "ls", "--json")).values()
    (row,) = [b for b in bufs if b["name"] == "odd"]
    assert row["alloc_size"] == 512 << 10
    assert re.search(r"512\.0 KiB", rpcbuf(cli_daemon, "ls", "--wide").stdout)
    np.save(tmp_path / "even.npy", np.zeros(1 << 16, np.uint8))
    res = rpcbuf(cli_daemon, "put", str(tmp_path / "even.npy"))
    assert res.returncode == 0 and "takes a block" not in res.stderr, res.stderr
    for name in ("odd", "even"):
        assert rpcbuf(cli_daemon, "release", name).returncode == 0


def test_status_shows_node_devices_and_sessions(cli_daemon: DaemonProc) -> None:
    (st,) = as_json(rpcbuf(cli_daemon, "status", "--json")).values()
    assert st["sessions"] >= 1 and st["uptime"] > 0 and st["devices"]
    assert st["path"] == "same-host" and st["same_host_sessions"] >= 1  # the CLI runs here
    table = rpcbuf(cli_daemon, "status")
    assert table.returncode == 0
    assert "cpu:0" in table.stdout and "uptime" in table.stdout and "░" in table.stdout
    assert "same-host" in table.stdout


def test_bench_is_quick_and_reports_throughput(cli_daemon: DaemonProc) -> None:
    start = free_bytes(cli_daemon)
    (rows,) = as_json(rpcbuf(cli_daemon, "bench", "--sizes", "4KiB,256KiB", "--duration",
                             "1s", "--json")).values()
    assert [r["size"] for r in rows] == [4096, 256 << 10]
    for r in rows:
        assert r["store_mib_s"] > 0 and r["read_mib_s"] > 0 and r["store_p50_ms"] > 0
    assert free_bytes(cli_daemon) == start


def test_daemon_errors_exit_1_with_their_code(cli_daemon: DaemonProc, tmp_path: Path) -> None:
    res = rpcbuf(cli_daemon, "release", "no-such-buffer")
    assert res.returncode == 1 and "NOT_FOUND" in res.stderr
    res = rpcbuf(cli_daemon, "get", "b-nothing", "--out", str(tmp_path / "o.npy"), "--json")
    assert res.returncode == 1 and json.loads(res.stdout)["error"]["code"] == "NOT_FOUND"
    # Another tenant's buffer is NOT_FOUND too.
    np.save(tmp_path / "mine.npy", np.zeros(4))
    assert rpcbuf(cli_daemon, "put", str(tmp_path / "mine.npy"), "--name", "mine").returncode == 0
    res = rpcbuf(cli_daemon, "release", "mine", tenant="mallory")
    assert res.returncode == 1 and "NOT_FOUND" in res.stderr
    assert rpcbuf(cli_daemon, "release", "mine").returncode == 0
    # A daemon that is not there: CONNECTION_LOST, exit 1.
    res = rpcbuf(None, "ls", "--endpoint", "127.0.0.1:1", "--token", "x")
    assert res.returncode == 1 and "CONNECTION_LOST" in res.stderr


def test_local_problems_and_bad_flags_exit_2(cli_daemon: DaemonProc, tmp_path: Path) -> None:
    res = rpcbuf(cli_daemon, "put", str(tmp_path / "missing.npy"))
    assert res.returncode == 2 and "missing.npy" in res.stderr
    (tmp_path / "junk.npy").write_bytes(b"not numpy at all")
    assert rpcbuf(cli_daemon, "put", str(tmp_path / "junk.npy")).returncode == 2
    for bad in (["put"], ["ls", "--bogus"], ["bench", "--sizes", "lots"],
                ["put", "x.npy", "--ttl", "soon"], ["frobnicate"]):
        res = rpcbuf(cli_daemon, *bad)
        assert res.returncode == 2 and "usage:" in res.stderr, (bad, res.stderr)
    res = rpcbuf(None, "status", "--endpoint", cli_daemon.addr)  # no token anywhere
    assert res.returncode == 2 and "no token" in res.stderr


def test_bad_numbers_and_files_get_a_sentence_not_a_traceback(tmp_path: Path) -> None:
    """Issue 37 items 1, 7 and 10: a port past 65535 was a traceback (or,
    for rpcbufd --listen, silently another port); --timeout -1 was taken;
    files got Python's and NumPy's own words; a mistyped flag no hint."""
    (tmp_path / "README.md").write_text("# not an array\n")
    cases = [
        (["ls", "--endpoint", "127.0.0.1:99999", "--token", "x"],
         "port 99999 is not a port (0 to 65535)"),
        (["ls", "--timeout", "-1", "--token", "x"], "must be a number of seconds above 0"),
        (["blocks", "--limit", "0", "--token", "x"], "0 is not from 1 to 4096"),
        (["ls", "--endpont", "x"], "did you mean --endpoint?"),
        (["put", str(tmp_path / "nope.npy")], "nope.npy: no such file"),
        (["put", str(tmp_path / "README.md")], "README.md: not a .npy file"),
        (["get", "x", "-o", str(tmp_path / "no" / "dir" / "x.npy"), "--token", "x"],
         f"no such directory {tmp_path / 'no' / 'dir'}"),
    ]
    for argv, says in cases:
        res = rpcbuf(None, *argv)
        out = res.stdout + res.stderr
        assert res.returncode in (1, 2) and says in out, (argv, out)
        assert "Traceback" not in out and "Errno" not in out and "pickle" not in out, out
        assert ".part" not in out, out
    for argv, says in ((["--listen", "127.0.0.1:99999"], "port 99999 is not a port"),
                       (["--ucx-port", "70000"], "port 70000 is not a port"),
                       (["--hello-timeout", "0s"], "'0s' must be longer than 0"),
                       (["--device", "cpu:lots"], "bad size 'lots'")):
        res = subprocess.run([sys.executable, "-m", "rpcbuf.control.daemon", *argv],
                             capture_output=True, text=True, timeout=60, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        assert res.returncode == 2 and says in res.stderr, (argv, res.stderr)
        assert len(res.stderr.splitlines()) == 2, res.stderr  # not the 27-line usage


def test_every_command_has_help_with_an_example() -> None:
    for cmd in ("status", "ls", "blocks", "release", "put", "get", "bench", "devices", "load",
                "unload"):
        res = rpcbuf(None, cmd, "--help")
        assert res.returncode == 0 and "example:" in res.stdout and "--json" in res.stdout, cmd


def test_version_bare_commands_and_mistyped_flags() -> None:
    """Issue 28, item 3: --version on both tools; a bare command prints its
    help (not "required: cmd"/"tcmd"); a mistyped flag gets the usage of
    the command it was given to."""
    import tomllib

    import rpcbuf as api

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert api.__version__ == version
    for tool, prog in (("rpcbuf.cli", "rpcbuf"), ("rpcbuf.control.daemon", "rpcbufd")):
        res = subprocess.run([sys.executable, "-m", tool, "--version"], capture_output=True,
                             text=True, timeout=60, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        assert res.returncode == 0 and res.stdout.startswith(f"{prog} {version} (protocol "), res
    for argv, shows in (([], "usage: rpcbuf [-h] [--version] COMMAND"),
                        (["token"], "usage: rpcbuf token [-h] COMMAND")):
        res = rpcbuf(None, *argv)
        assert res.returncode == 2 and shows in res.stderr, res.stderr
        assert "required" not in res.stderr and "cmd" not in res.stderr, res.stderr
        assert "create" in res.stderr if argv else "doctor" in res.stderr
    for argv, usage in ((["ls", "--bogus"], "usage: rpcbuf ls "),
                        (["token", "create", "--tenant", "a", "--secret-fil", "s", "-x"],
                         "usage: rpcbuf token create "),
                        (["get", "x", "--outt", "y"], "usage: rpcbuf get ")):
        res = rpcbuf(None, *argv)
        assert res.returncode == 2 and res.stderr.startswith(usage), res.stderr
        assert "unrecognized arguments" in res.stderr, res.stderr


def test_units_and_device_names_match_across_commands(cli_daemon: DaemonProc,
                                                      tmp_path: Path) -> None:
    """Issue 28, item 12: ``ls`` said CPU:0 where ``status`` says cpu:0;
    errors and --help defaults printed raw byte counts."""
    np.save(tmp_path / "u.npy", np.zeros(16))
    assert rpcbuf(cli_daemon, "put", str(tmp_path / "u.npy"), "--name", "u").returncode == 0
    try:
        (bufs,) = as_json(rpcbuf(cli_daemon, "ls", "--json")).values()
        (st,) = as_json(rpcbuf(cli_daemon, "status", "--json")).values()
        assert {b["device"] for b in bufs} == {d["key"] for d in st["devices"]} == {"cpu:0"}
    finally:
        assert rpcbuf(cli_daemon, "release", "u").returncode == 0
    big = np.lib.format.open_memmap(tmp_path / "big.npy", mode="w+", dtype=np.uint8,
                                    shape=(128 << 20,))  # sparse: nothing written
    del big
    res = rpcbuf(cli_daemon, "put", str(tmp_path / "big.npy"), "--name", "big")
    assert res.returncode == 1 and "[OUT_OF_MEMORY]" in res.stderr, res.stderr
    assert "128.0 MiB can never fit on cpu:0" in res.stderr and " bytes" not in res.stderr, \
        res.stderr
    helped = subprocess.run([sys.executable, "-m", "rpcbuf.control.daemon", "--help"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src"),
                                 "COLUMNS": "200"})
    assert "largest control frame accepted [16.0 MiB]" in helped.stdout, helped.stdout


def test_ls_with_nothing_says_so_and_names_the_nodes_that_answered(cli_daemon: DaemonProc) -> None:
    """Issue 37 item 9: ``ls`` with no buffers printed nothing at all, and
    with one node of two down only that node's error."""
    res = rpcbuf(cli_daemon, "ls", tenant="nobody-here")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"no buffers for this tenant on {cli_daemon.addr}", res.stdout
    res = rpcbuf(cli_daemon, "ls", "--endpoints", f"{cli_daemon.addr};127.0.0.1:1",
                 tenant="nobody-here")
    assert res.returncode == 1, res.stderr
    assert f"no buffers for this tenant on {cli_daemon.addr}" in res.stdout, res.stdout
    assert "127.0.0.1:1" in res.stderr, res.stderr


def test_blocks_rm_removes_named_keys_and_a_prefix_only_when_told(cli_daemon: DaemonProc) -> None:
    """Issue 37 item 12: ``rpcbuf blocks`` could not delete or flush keys."""
    import asyncio

    import rpcbuf as api

    async def put(keys: list[str]) -> None:
        async with api.connect(cli_daemon.addr, token=cli_daemon.token("kv"), timeout=30) as c:
            for i in range(0, len(keys), 4096):  # (a put names 4,096 keys at most)
                await c.put_blocks({k: np.full(64, 7, np.uint8) for k in keys[i:i + 4096]})

    async def left() -> tuple[int, list[str]]:
        async with api.connect(cli_daemon.addr, token=cli_daemon.token("kv"), timeout=30) as c:
            return (await c.stats())["blocks"]["blocks"], (await c.list_blocks(limit=10))[0]

    asyncio.run(put(["a1", "a2", "a3", "keep"] + [f"bulk{i:04d}" for i in range(5000)]))
    res = rpcbuf(cli_daemon, "blocks", "rm", "a1", "a2", "nope", tenant="kv")
    assert res.returncode == 0 and f"{cli_daemon.addr}: removed 2 of 3 keys named" in res.stdout
    res = rpcbuf(cli_daemon, "blocks", "rm", "--prefix", "bulk", tenant="kv")  # no --yes
    assert res.returncode == 2 and "add --yes" in res.stderr, res.stderr
    assert asyncio.run(left())[0] == 5002  # nothing went
    res = rpcbuf(cli_daemon, "blocks", "rm", "--prefix", "bulk", "--yes", tenant="kv")
    assert res.returncode == 0, res.stderr
    assert "removed 5000 keys starting with 'bulk'" in res.stdout, res.stdout  # two pages
    assert asyncio.run(left()) == (2, ["a3", "keep"])
    # Item 9: status counted blocks as buffers ("buffers 1" while ls was empty).
    (st,) = as_json(rpcbuf(cli_daemon, "status", "--json", tenant="kv")).values()
    assert st["buffers"] == 0 and st["blocks"]["blocks"] == 2
    assert st["limits"]["buffers"]["held"] == 2  # the quota counts both
    table = rpcbuf(cli_daemon, "status", "--wide", tenant="kv").stdout
    assert re.search(r"buffers ┃\s+blocks ┃", table) and re.search(r"│\s+0 │\s+2 │", table), table
    res = rpcbuf(cli_daemon, "blocks", "a3", tenant="kv")  # rm forgotten: said, not ignored
    assert res.returncode == 2 and "invalid choice: 'a3' (choose from 'rm')" in res.stderr
    res = rpcbuf(cli_daemon, "blocks", "rm", tenant="kv")
    assert res.returncode == 2 and "name the KEYs" in res.stderr, res.stderr


def test_release_by_prefix_and_all_only_when_told(cli_daemon: DaemonProc) -> None:
    """Issue 37 item 12: there was no ``release --all`` nor release by name
    prefix (one ``rpcbuf release`` per buffer)."""
    import asyncio

    import rpcbuf as api

    async def make() -> None:
        async with api.connect(cli_daemon.addr, token=cli_daemon.token("rel"), timeout=30) as c:
            for name in ("llama/a", "llama/b", "llamas", None, "keep"):
                await c.request_buffer(4096, name=name, ttl=None if name else 3600)

    async def names() -> list[str | None]:
        async with api.connect(cli_daemon.addr, token=cli_daemon.token("rel"), timeout=30) as c:
            return sorted((b["name"] or "") for b in await c.list_buffers())

    asyncio.run(make())
    res = rpcbuf(cli_daemon, "release", "--prefix", "llama/", tenant="rel")
    assert res.returncode == 2 and "add --yes" in res.stderr, res.stderr
    res = rpcbuf(cli_daemon, "release", "--prefix", "llama/", "x", "--yes", tenant="rel")
    assert res.returncode == 2 and "name one buffer" in res.stderr, res.stderr
    assert asyncio.run(names()) == ["", "keep", "llama/a", "llama/b", "llamas"]  # nothing went
    res = rpcbuf(cli_daemon, "release", "--prefix", "llama/", "--yes", tenant="rel")
    assert res.returncode == 0 and "released 2 buffer(s)" in res.stdout, res.stdout + res.stderr
    assert asyncio.run(names()) == ["", "keep", "llamas"]
    res = rpcbuf(cli_daemon, "release", "--all", "--yes", "--json", tenant="rel")
    assert res.returncode == 0, res.stderr
    (got,) = as_json(res).values()
    assert got["released"] == 3 and "keep" in got["buffers"], got
    assert asyncio.run(names()) == []
    res = rpcbuf(cli_daemon, "release", tenant="rel")
    assert res.returncode == 2 and "name one buffer" in res.stderr, res.stderr
