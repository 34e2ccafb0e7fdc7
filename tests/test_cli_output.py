"""What a new user sees: errors as sentences (one per failing node, the
cause and the next step, never a traceback, the same in --json), tables that
fit an 80-column terminal without cutting ids, names or endpoints, and
``rpcbuf get`` writing NAME.npy by default without overwriting."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import ROOT, DaemonProc
from rpcbuf.control.formats.keyfile import load_keys
from rpcbuf.control.wire.auth import create_token
from rpcbuf.control.wire.errors import ALL_CODES

sys.path.insert(0, str(ROOT / "tests" / "hardening"))
from fakedaemon import TOKEN, FakeDaemon


@pytest.fixture(scope="module")
def out_daemon(daemon_factory) -> DaemonProc:  # type: ignore[no-untyped-def]
    return daemon_factory("--device", "cpu:64MiB")  # type: ignore[no-any-return]


def cli_env(columns: int = 80, token: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": str(columns)}
    env.pop("RPCBUF_TOKEN", None)
    env.pop("RPCBUF_ENDPOINTS", None)
    if token is not None:
        env["RPCBUF_TOKEN"] = token
    return env


def run(*args: str, columns: int = 80, token: str | None = None,
        cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([sys.executable, "-m", "rpcbuf.cli", *args], capture_output=True,
                         text=True, timeout=60, cwd=cwd, env=cli_env(columns, token))
    assert "Traceback" not in res.stderr + res.stdout, res.stderr
    return res


def test_unreachable_node_is_one_sentence_and_no_table() -> None:
    res = run("devices", "--endpoint", "127.0.0.1:1", token="x")
    assert res.returncode == 1
    assert res.stdout == ""  # no table of errors
    (line,) = res.stderr.splitlines()
    assert "cannot reach rpcbufd at 127.0.0.1:1 (connection refused)" in line
    assert "is the daemon running?" in line


def test_bad_and_expired_tokens_say_what_to_do(out_daemon: DaemonProc) -> None:
    res = run("ls", "--endpoint", out_daemon.addr, token="garbage")
    assert res.returncode == 1 and res.stdout == ""
    assert f"{out_daemon.addr} refused the token (malformed token)" in res.stderr
    assert "rpcbuf token create" in res.stderr
    old = create_token(load_keys(out_daemon.secret_file), "alice", 1.0)
    time.sleep(1.5)
    res = run("status", "--endpoint", out_daemon.addr, token=old)
    assert res.returncode == 1
    assert "the token expired" in res.stderr and "s ago" in res.stderr


def test_partly_failing_nodes_print_the_table_of_those_that_answered(
        out_daemon: DaemonProc) -> None:
    token = out_daemon.token("cli-out")
    res = run("devices", "--endpoints", f"{out_daemon.addr};127.0.0.1:1", token=token)
    assert res.returncode == 1
    assert out_daemon.addr in res.stdout and "127.0.0.1:1" not in res.stdout
    assert res.stderr.count("cannot reach rpcbufd at 127.0.0.1:1") == 1
    res = run("devices", "--endpoints", f"{out_daemon.addr};127.0.0.1:1", "--json", token=token)
    got = json.loads(res.stdout)
    assert "cannot reach" in got["127.0.0.1:1"]["sentence"]
    assert got["127.0.0.1:1"]["code"] == "CONNECTION_LOST"
    assert isinstance(got[out_daemon.addr], list)


def test_tables_fit_80_columns_without_cutting(out_daemon: DaemonProc, tmp_path: Path) -> None:
    token = out_daemon.token("cli-out")
    np.save(tmp_path / "t.npy", np.arange(10, dtype=np.float32))
    name = "tinyllama-1.1b-chat/slot-000-layers.0-7"
    put = run("put", str(tmp_path / "t.npy"), "--name", name, "--endpoint", out_daemon.addr,
              token=token)
    assert put.returncode == 0, put.stderr
    bid = put.stdout.strip()
    eps = f"{out_daemon.addr};localhost:{out_daemon.addr.rsplit(':', 1)[1]}"
    for cmd in (["ls"], ["status"], ["devices"]):
        for where in (["--endpoint", out_daemon.addr], ["--endpoints", eps]):
            res = run(*cmd, *where, token=token)
            assert res.returncode == 0, res.stderr
            lines = res.stdout.splitlines()
            assert lines and max(len(line) for line in lines) <= 80, res.stdout
            assert "…" not in res.stdout, res.stdout  # nothing cut
            assert out_daemon.addr in res.stdout or (cmd == ["ls"] and len(where[1]) < 20)
    res = run("ls", "--endpoints", eps, token=token)
    assert bid in res.stdout  # ids whole, on one line
    assert name.replace("/", "") not in res.stdout  # (a long name may wrap onto a second line)
    assert "tinyllama-1.1b" in res.stdout
    wide = run("ls", "--endpoints", eps, "--wide", columns=80, token=token)
    assert "ttl left" in wide.stdout and "device" in wide.stdout
    # A column left out says so under the table (no lease here: ttl left goes).
    assert "not shown at this width:" in res.stdout and "ttl left" in res.stdout, res.stdout
    # Issue 28, item 13: at 80 columns a buffer with a lease kept no "ttl left",
    # so one that expires in an hour looked permanent.
    leased = run("put", str(tmp_path / "t.npy"), "--name", "leased", "--ttl", "1h",
                 "--endpoint", out_daemon.addr, token=token)
    assert leased.returncode == 0, leased.stderr
    res = run("ls", "--endpoints", eps, token=token)
    assert max(len(line) for line in res.stdout.splitlines()) <= 80, res.stdout
    header = next(line for line in res.stdout.splitlines() if "name" in line)
    assert "ttl left" in header and ("59m" in res.stdout or "1h 00m" in res.stdout), res.stdout
    assert run("release", leased.stdout.strip(), "--endpoint", out_daemon.addr,
               token=token).returncode == 0
    assert run("release", bid, "--endpoint", out_daemon.addr, token=token).returncode == 0


def test_get_writes_name_npy_and_refuses_to_overwrite(out_daemon: DaemonProc,
                                                      tmp_path: Path) -> None:
    token = out_daemon.token("cli-out")
    arr = np.arange(12, dtype=np.int16).reshape(3, 4)
    np.save(tmp_path / "src.npy", arr)
    assert run("put", str(tmp_path / "src.npy"), "--name", "models/w", "--endpoint",
               out_daemon.addr, token=token).returncode == 0
    work = tmp_path / "cwd"
    work.mkdir()
    res = run("get", "models/w", "--endpoint", out_daemon.addr, token=token, cwd=work)
    assert res.returncode == 0, res.stderr
    np.testing.assert_array_equal(np.load(work / "w.npy"), arr)
    again = run("get", "models/w", "--endpoint", out_daemon.addr, token=token, cwd=work)
    assert again.returncode == 2 and "exists: pass --force" in again.stderr
    (work / "w.npy").write_bytes(b"keep me")
    assert run("get", "models/w", "--endpoint", out_daemon.addr, token=token,
               cwd=work).returncode == 2
    assert (work / "w.npy").read_bytes() == b"keep me"  # refused before connecting
    forced = run("get", "models/w", "--force", "--endpoint", out_daemon.addr, token=token,
                 cwd=work)
    assert forced.returncode == 0
    np.testing.assert_array_equal(np.load(work / "w.npy"), arr)
    assert not list(work.glob(".*.part"))
    assert run("release", "models/w", "--endpoint", out_daemon.addr,
               token=token).returncode == 0


async def test_every_error_code_is_a_sentence_without_a_traceback(tmp_path: Path) -> None:
    """A daemon (here a fake one) refusing hello with each code: every
    command prints one sentence naming the node, exit 1, no traceback."""
    code = ["?"]

    async def refuse(conn: Any, req: dict[str, Any]) -> None:
        conn.send({"id": req["id"], "ok": False,
                   "error": {"code": code[0], "message": f"the node says {code[0]}",
                             "details": {}}})

    fake = FakeDaemon(refuse)
    addr = await fake.start()
    try:
        for c in [*ALL_CODES, "SOMETHING_NEW"]:
            code[0] = c
            for args in (["devices"], ["ls", "--json"],
                         ["get", "x", "--out", str(tmp_path / "x.npy")]):
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "rpcbuf.cli", *args, "--endpoint", addr,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    cwd=ROOT, env=cli_env(80, TOKEN))
                out, err = await asyncio.wait_for(proc.communicate(), 60)
                text = (out + err).decode()
                assert "Traceback" not in text, (c, args, text)
                assert proc.returncode == 1, (c, args, text)
                if "--json" in args:
                    got = json.loads(out)[addr]  # an unknown code: the root class keeps it
                    assert c in (got["code"], got["details"].get("code")), got
                    assert addr in got["sentence"]
                else:
                    lines = err.decode().splitlines()
                    assert len(lines) == 1 and addr in lines[0], (c, lines)
    finally:
        await fake.close()


def test_doctor_on_a_healthy_node_a_stopped_one_and_a_wrong_token(out_daemon: DaemonProc) -> None:
    token = out_daemon.token("cli-out")
    res = run("doctor", "--endpoint", out_daemon.addr, "--json", token=token)
    assert res.returncode == 0, res.stdout + res.stderr
    checks = json.loads(res.stdout)[out_daemon.addr]
    names = [c["check"] for c in checks]
    for want in ("reachable", "tls", "token", "protocol", "data path", "transports",
                 "round trip 4.0 KiB", "memory cpu:0", "clock"):
        assert want in names, names
    assert not [c for c in checks if c["status"] == "fail"], checks
    big = [c for c in checks if c["check"].startswith("round trip") and "MiB" in c["check"]]
    assert big and big[0]["figures"]["bytes"] >= 1 << 20
    text = run("doctor", "--endpoint", out_daemon.addr, token=token)
    assert text.returncode == 0 and "ok    token" in text.stdout
    stopped = run("doctor", "--endpoint", "127.0.0.1:1", token=token, columns=200)
    assert stopped.returncode == 1
    assert "FAIL  reachable" in stopped.stdout and "connection refused" in stopped.stdout
    wrong = run("doctor", "--endpoint", out_daemon.addr, token="garbage", columns=200)
    assert wrong.returncode == 1
    assert "FAIL  token" in wrong.stdout and "refused the token" in wrong.stdout
    narrow = run("doctor", "--endpoint", out_daemon.addr, token=token)
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 80, narrow.stdout
    # Issue 37 item 6: with no token it stopped at "no token" and checked nothing.
    bare = run("doctor", "--endpoint", out_daemon.addr, "--json")
    assert bare.returncode == 1, bare.stdout + bare.stderr
    checks = {c["check"]: c for c in json.loads(bare.stdout)[out_daemon.addr]}
    assert checks["reachable"]["status"] == "ok" and checks["tls"]["status"] == "ok", checks
    assert checks["ucx here"]["status"] in ("ok", "warn"), checks
    assert checks["token"]["status"] == "fail" and "no token" in checks["token"]["message"]
    assert [c for c in checks.values() if c["status"] == "fail"] == [checks["token"]]


async def test_a_protocol_mismatch_names_both_versions() -> None:
    async def newer(conn: Any, req: dict[str, Any]) -> None:
        conn.send({"id": req["id"], "ok": False, "error": {
            "code": "BAD_REQUEST", "details": {"reason": "protocol_version"},
            "message": "the node speaks protocol 7..9, this client speaks 1..2: "
                       "upgrade the older side"}})

    fake = FakeDaemon(newer, challenges=False)
    addr = await fake.start()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rpcbuf.cli", "status", "--endpoint", addr,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
            env=cli_env(80, TOKEN))
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await fake.close()
    (line,) = err.decode().splitlines()
    assert proc.returncode == 1
    assert "speaks protocol 7..9, this client speaks 1..2" in line
    assert line.count("upgrade the older side") == 1 and line.endswith("[BAD_REQUEST]")


def test_get_reads_a_big_array_in_pieces_and_checks_it(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:256MiB")
    token = d.token("cli-big")
    arr = np.arange(20 << 20, dtype=np.float32).reshape(5 << 10, 4 << 10)  # 80 MiB
    np.save(tmp_path / "big.npy", arr)
    assert run("put", str(tmp_path / "big.npy"), "--endpoint", d.addr,
               token=token).returncode == 0
    res = run("get", "big", "--out", str(tmp_path / "back.npy"), "--endpoint", d.addr,
              token=token)
    assert res.returncode == 0, res.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "back.npy", mmap_mode="r"), arr)

    async def corrupt() -> None:
        async with d.connect("cli-big") as c:
            bid = await c.open_buffer("big")
            await c.store_tensor(bid, np.full(16, 7, np.uint8), offset=40 << 20)

    asyncio.run(corrupt())
    bad = run("get", "big", "--out", str(tmp_path / "bad.npy"), "--endpoint", d.addr,
              token=token)
    assert bad.returncode == 1 and "[VERIFY_FAILED]" in bad.stderr, bad.stderr
    assert not (tmp_path / "bad.npy").exists()  # nothing written from a failed read
    assert run("release", "big", "--endpoint", d.addr, token=token).returncode == 0


def test_a_peer_that_is_not_rpcbufd_is_named_at_once(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 28, item 14: the UCX port (silent) and the metrics port (HTTP)
    are reported as not rpcbufd's control port at once (before: TIMEOUT
    after the whole --timeout), and an endpoint without a port names the
    port that was tried."""
    from conftest import metrics_url

    d: DaemonProc = daemon_factory("--device", "cpu:4MiB", "--metrics", "127.0.0.1:0")
    tok = d.token("peers")
    ucx = f"127.0.0.1:{d.ucx_port}"
    metrics = metrics_url(d).removeprefix("http://").removesuffix("/metrics")
    # --timeout 300: waiting it out would run past the subprocess's 60 s.
    res = run("ls", "--endpoint", ucx, "--timeout", "300", token=tok)
    assert res.returncode == 1 and "[TIMEOUT]" in res.stderr, res.stderr
    assert f"{ucx} took the connection but said nothing to the hello" in res.stderr
    assert "not rpcbufd's control port" in res.stderr and "--listen" in res.stderr
    res = run("status", "--endpoint", metrics, "--timeout", "300", "--json", token=tok)
    err = json.loads(res.stdout)[metrics]
    assert res.returncode == 1 and err["details"]["reason"] == "not_rpcbufd", err
    assert "answered in HTTP" in err["sentence"] and "--listen" in err["sentence"]
    res = run("ls", "--endpoint", "127.0.0.2", token=tok)  # nothing listens there
    assert res.returncode == 1 and "rpcbufd at 127.0.0.2:7700 (connection refused)" \
        in res.stderr, res.stderr
    # The metrics port still serves HTTP.
    with urllib.request.urlopen(metrics_url(d), timeout=30) as page:
        assert b"rpcbuf_ops_total" in page.read()


def test_doctor_says_why_the_same_host_path_is_not_used(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 28, item 7: a daemon on this host without its same-host socket
    (--local-socket none) was `ok data path UCX`, no reason given."""
    d: DaemonProc = daemon_factory("--device", "cpu:4MiB", "--local-socket", "none")
    res = run("doctor", "--endpoint", d.addr, "--json", token=d.token("doc"))
    assert res.returncode == 0, res.stdout + res.stderr
    (path,) = [c for c in json.loads(res.stdout)[d.addr] if c["check"] == "data path"]
    assert path["status"] == "warn", path
    assert "--local-socket none" in path["message"] and "slower" in path["message"], path


def test_doctor_under_tls_on_loopback_says_why_ucx_and_what_same_host_is(
        daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Issue 37 item 11: with TLS on loopback doctor said `ok data path UCX`
    with no reason (the same-host path leaves TLS out, so a TLS client takes
    it only when asked); and its same-host sentence said the daemon "copies
    straight" from the client's arrays, where they go through a staging area."""
    from certs import self_signed

    cert, key = self_signed(tmp_path)
    d: DaemonProc = daemon_factory("--device", "cpu:4MiB", "--tls-cert", str(cert),
                                   "--tls-key", str(key))
    res = run("doctor", "--endpoint", d.addr, "--ca", str(cert), "--json", token=d.token("doc"))
    assert res.returncode == 0, res.stdout + res.stderr
    (path,) = [c for c in json.loads(res.stdout)[d.addr] if c["check"] == "data path"]
    assert path["status"] == "warn" and "RPCBUF_SAME_HOST=1" in path["message"], path
    env = {**cli_env(80, d.token("doc")), "RPCBUF_SAME_HOST": "1"}
    res = subprocess.run([sys.executable, "-m", "rpcbuf.cli", "doctor", "--endpoint",
                          d.addr, "--ca", str(cert), "--json"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env=env)
    (path,) = [c for c in json.loads(res.stdout)[d.addr] if c["check"] == "data path"]
    assert path["status"] == "ok" and "staging area" in path["message"], path


def test_doctor_lines_fold_between_words_and_after_slashes() -> None:
    """Issue 37 item 10: doctor broke a library path mid-word, and the label
    "round trip 64.0 MiB" ran into its sentence; error sentences broke
    mid-word at the terminal's edge ($RPC / BUF_TOKEN); a 60-character
    buffer name wrapped into 7 lines."""
    from rpcbuf.cli import doctor, tables

    lib = "/work/main/.venv/lib/python3.11/site-packages/libucx/lib/libucp.so.0"
    lines = doctor.render({"n": [doctor.Check("ucx here", "ok", f"UCX 1.21.0 at {lib}: fine"),
                                 doctor.Check("round trip 64.0 MiB", "ok", "store 4 GiB/s")]},
                          columns=80)
    assert all(len(x) <= 80 for x in lines), lines
    assert [x.strip() for x in lines[1:4]] == [  # broken after a slash, never inside a name
        "ok    ucx here            UCX 1.21.0 at",
        "/work/main/.venv/lib/python3.11/site-packages/", "libucx/lib/libucp.so.0: fine"]
    assert lines[4] == "  ok    round trip 64.0 MiB store 4 GiB/s", lines[4]
    said = tables.fold("rpcbuf: no token: pass --token, set $RPCBUF_TOKEN, or put one in a "
                       "file", 40)
    assert "$RPCBUF_TOKEN," in [w for x in said for w in x.split()] and \
        all(len(x) <= 40 for x in said), said
    name = "model-weights/llama-3.1-70b-instruct/layer-017/attn.q_proj.w"
    t = tables.fit("b", [tables.Col("name", key=True, wrap=True), tables.Col("id", key=True)],
                   [[name, "b-IYAsFN3Ff3Psnny7lclLylgI"]], columns=60)
    from rich.console import Console
    out = Console(width=60, record=True)
    out.print(t)
    cells = [x.split("│")[1].strip() for x in out.export_text().splitlines() if "│" in x]
    assert "".join(cells) == name and len(cells) <= 3, cells
    assert all(c.endswith(("/", "-", ".", "_")) for c in cells[:-1]), cells
    # Two nodes (an endpoint column), no lease: optional columns go before
    # the name gets less than 24 characters (it had 7: seven lines).  (A
    # lease's "ttl left" stays whatever the name's room: issue 28 item 13.)
    t = tables.fit("b", [tables.Col("endpoint", key=True), tables.Col("name", key=True, wrap=True),
                         tables.Col("id", key=True), tables.Col("size", right=True),
                         tables.Col("ttl left", drop=3), tables.Col("tensors", drop=5)],
                   [["127.0.0.1:7810", name, "b-IYAsFN3Ff3Psnny7lclLylgI", "4.0 KiB", "-",
                     "0"]], columns=80)
    out = Console(width=80, record=True)
    out.print(t)
    text = out.export_text()
    cells = [x.split("│")[2].strip() for x in text.splitlines() if "│" in x]
    assert "".join(cells) == name and len(cells) <= 4, text
    assert "not shown at this width: ttl left, tensors" in " ".join(text.split()), text


def test_table_cells_are_text_never_markup() -> None:
    """A buffer name, a block key or a node's record is someone else's
    string: a ``[`` in it shows as it is, and ``[/x]`` (rich raised
    MarkupError on it) does not break the table; the usage bar keeps its
    colours."""
    from rich.console import Console

    from rpcbuf.cli import commands, tables

    t = tables.fit("t", [tables.Col("name", key=True), tables.Col("used")],
                   [["a[bold]b", commands.bar(1, 2)], ["[/x]", "-"]], columns=80)
    out = Console(width=80, record=True, color_system="truecolor")
    out.print(t)
    text = out.export_text(clear=False)
    assert "a[bold]b" in text and "[/x]" in text
    assert "\x1b[31m" in out.export_text(styles=True)  # the bar's red part
