"""rpcbufd as a service: systemd's notify protocol and unit, SIGHUP reload,
Prometheus metrics, the audit trail, the session limit and TLS."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.certs import self_signed

import rpcbuf
from rpcbuf.control.daemon.service.sdnotify import Notifier, watchdog_interval
from rpcbuf.control.formats.keyfile import load_or_create_secret
from rpcbuf.dataplane import staging

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "scripts" / "systemd" / "rpcbufd.service"


# -- systemd -------------------------------------------------------------------------


def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian package 'systemd')")
    # As `make install-service PREFIX=...` writes it: ExecStart must exist to verify.
    unit = tmp_path / "rpcbufd.service"
    unit.write_text(UNIT.read_text().replace("/opt/rpcbuf/", f"{sys.prefix}/"))
    res = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    complaints = [line for line in (res.stdout + res.stderr).splitlines() if "rpcbufd" in line]
    assert res.returncode == 0 and not complaints, res.stdout + res.stderr
    text = UNIT.read_text()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "User=rpcbuf",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes",
                 "PrivateTmp=yes", "LimitMEMLOCK=infinity", "ExecReload=/bin/kill -HUP $MAINPID",
                 "--config /etc/rpcbuf/rpcbufd.toml"):
        assert line in text, line


@pytest.fixture
def notify_socket() -> Iterator[tuple[str, socket.socket]]:
    """A datagram socket in the abstract namespace, as systemd's would be."""
    name = f"rpcbuf-test-{os.getpid()}-{secrets.token_hex(4)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.setblocking(False)
    yield "@" + name, sock
    sock.close()


async def notes_until(sock: socket.socket, done: Callable[[list[str]], bool],
                      timeout: float = 10.0) -> list[str]:
    got: list[str] = []
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout):
        while not done(got):
            got.append((await loop.sock_recv(sock, 65536)).decode())
    return got


def has(field: str) -> Callable[[list[str]], bool]:
    return lambda got: any(field in m.splitlines() for m in got)


async def test_notify_watchdog_and_reload_without_dropping_clients(
        daemon_factory, notify_socket, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    address, sock = notify_socket
    cfg = tmp_path / "rpcbufd.toml"
    cfg.write_text('[quotas]\nalice = { bytes = "64KiB" }\n')
    d = daemon_factory("--config", str(cfg), "--device", "cpu:16MiB",
                       env={"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "200000"})
    # READY=1 comes once both listeners are up, then a WATCHDOG=1 every 0.1 s.
    got = await notes_until(sock, lambda g: sum("WATCHDOG=1" in m for m in g) >= 3)
    ready = next(i for i, m in enumerate(got) if "READY=1" in m.splitlines())
    assert "STATUS=starting" in got[0] and ready < len(got) - 1
    assert any(line.startswith("STATUS=serving 0 sessions") for line in got[ready].splitlines())
    keys = {line.partition("=")[0] for m in got for line in m.splitlines()}
    assert keys == {"STATUS", "READY", "WATCHDOG"}

    async with d.connect("alice") as c:
        with pytest.raises(rpcbuf.QuotaExceeded):
            await c.request_buffer(1 << 20)
        cfg.write_text('[quotas]\nalice = { bytes = "2MiB" }\n[log]\nlevel = "DEBUG"\n')
        d.proc.send_signal(signal.SIGHUP)
        got = await notes_until(sock, has("READY=1"))
        assert any("RELOADING=1" in m.splitlines() for m in got)
        buf = await c.request_buffer(1 << 20)  # same session, the new quota
        await c.release_buffer(buf)
        async with d.connect("bob") as c2:  # DEBUG now: a new session's binding is logged
            await c2.ping()

        cfg.write_text("[quotas]\nalice = 5\n")  # a broken file: nothing changes
        d.proc.send_signal(signal.SIGHUP)
        await notes_until(sock, has("READY=1"))
        buf = await c.request_buffer(1 << 20)
        await c.release_buffer(buf)
        assert await c.ping()

    d.proc.send_signal(signal.SIGTERM)
    await notes_until(sock, has("STOPPING=1"))
    assert await asyncio.to_thread(d.proc.wait, 30) == 0
    log = d.log()
    assert "reloaded" in log and "log level DEBUG" in log
    assert re.search(r"DEBUG rpcbuf.daemon session s-\S+ bound (its data endpoint|its handle "
                     r"channel)", log)
    assert "reload failed, keeping the running settings" in log and "quotas.alice" in log
    assert "code=QUOTA_EXCEEDED" in log  # the refused request_buffer, in the audit trail


async def test_no_watchdog_pings_for_another_pid(
        daemon_factory, notify_socket) -> None:  # type: ignore[no-untyped-def]
    address, sock = notify_socket
    d = daemon_factory("--device", "cpu:1MiB", env={
        "NOTIFY_SOCKET": address, "WATCHDOG_USEC": "100000", "WATCHDOG_PID": "1"})
    got = await notes_until(sock, has("READY=1"))
    await asyncio.sleep(0.3)
    while True:
        try:
            got.append(sock.recv(65536).decode())
        except BlockingIOError:
            break
    assert not any("WATCHDOG=1" in m for m in got)
    d.proc.send_signal(signal.SIGHUP)  # no --config: said so in the log, and nothing else
    async with d.connect("alice") as c:
        assert await c.ping()
    assert d.stop() == 0
    assert "SIGHUP: started without --config, nothing to reload" in d.log()


def test_notifier_outside_systemd_and_when_systemd_is_gone(tmp_path: Path) -> None:
    assert not Notifier({}).notify(READY=1)  # not under systemd: nothing to do
    assert not Notifier({"NOTIFY_SOCKET": "relative/path"}).enabled
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "no-such-socket"), "WATCHDOG_USEC": "x"})
    assert gone.enabled and gone.watchdog is None
    assert not gone.notify(READY=1)  # a failed send is not the daemon's problem
    gone.close()
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        n = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "5000000",
                      "WATCHDOG_PID": str(os.getpid())})
        assert n.watchdog == 5.0 and n.notify(READY=1, STATUS="ok")
        assert sock.recv(100) == b"READY=1\nSTATUS=ok"
        n.close()
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None


# -- metrics and the audit trail ---------------------------------------------------------


def metrics_url(d: Any) -> str:
    found = re.search(r"metrics at (http://[\d.]+:\d+/metrics)", d.log())
    assert found, d.log()
    return found.group(1)


def get(url: str, method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as res:
            return res.status, res.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


async def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    status, text = await asyncio.to_thread(get, url)
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(m: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


async def test_metrics_and_audit_after_real_ops(
        daemon_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import rpcbuf.control.client.rangeops

    audit = tmp_path / "audit.log"
    d = daemon_factory("--device", "cpu:16MiB", "--metrics", "127.0.0.1:0",
                       "--metrics-tenants", "--audit-log", str(audit), "--log-format", "json")
    url = metrics_url(d)
    async with d.connect("alice") as c:
        buf = await c.request_buffer(100_000)
        await c.store_tensor(buf, np.ones(4096, np.uint8), offset=64, verify="checksum")
        await c.read_buffer(buf, 0, 1000)
        with monkeypatch.context() as mp:
            mp.setattr(rpcbuf.control.client.rangeops, "checksum", lambda data: 12345)
            with pytest.raises(rpcbuf.VerifyFailed):
                await c.store_tensor(buf, np.ones(512, np.uint8), verify="checksum")
        with pytest.raises(rpcbuf.NotFound):
            await c.release_buffer("b-nope")
        with pytest.raises(rpcbuf.OutOfRange):
            await c.read_buffer(buf, 99_999, 2)
        leased = await c.request_buffer(256, ttl=0.1)
        await asyncio.sleep(0.3)  # the lease runs out
        with pytest.raises(rpcbuf.NotFound):
            await c.get_buffer_meta(leased)

        m = await scrape(url)
        assert value(m, "rpcbuf_bytes_stored_total") == 4096
        assert value(m, "rpcbuf_bytes_read_total") == 1000
        assert value(m, "rpcbuf_verify_failures_total") == 1
        assert value(m, "rpcbuf_lease_expiries_total") == 1
        assert value(m, "rpcbuf_ops_total", op="store", code="OK") == 1
        assert value(m, "rpcbuf_ops_total", op="store", code="VERIFY_FAILED") == 1
        assert value(m, "rpcbuf_ops_total", op="read", code="OUT_OF_RANGE") == 1
        assert value(m, "rpcbuf_ops_total", op="release", code="NOT_FOUND") == 1
        assert value(m, "rpcbuf_ops_total", op="request_buffer", code="OK") == 2
        # a same-host client says hello twice: on TCP, then on the Unix socket
        assert value(m, "rpcbuf_ops_total", op="hello", code="OK") == (2 if c.same_host else 1)
        assert value(m, "rpcbuf_op_duration_seconds_count", op="store") == 2
        assert value(m, "rpcbuf_op_duration_seconds_bucket", op="read", le="+Inf") == 2
        assert value(m, "rpcbuf_sessions") == 1 and value(m, "rpcbuf_transfers_in_flight") == 0
        assert value(m, "rpcbuf_pool_size_bytes", device="cpu:0") == 16 << 20
        assert value(m, "rpcbuf_pool_used_bytes", device="cpu:0") == 128 << 10  # buddy block
        assert value(m, "rpcbuf_pool_largest_free_bytes", device="cpu:0") == 8 << 20
        assert value(m, "rpcbuf_tenant_buffers", tenant="alice") == 1
        staged = staging.SIZE if c.same_host else 0  # the staging area is alice's too
        assert value(m, "rpcbuf_tenant_bytes", tenant="alice", device="cpu:0") == \
            (128 << 10) + staged
        assert value(m, "process_resident_memory_bytes") > 0
        await c.release_buffer(buf)
        m = await scrape(url)
        assert value(m, "rpcbuf_tenant_buffers", tenant="alice") == 0
        assert value(m, "rpcbuf_pool_used_bytes", device="cpu:0") == 0
    assert (await asyncio.to_thread(get, url.replace("/metrics", "/other")))[0] == 404
    assert (await asyncio.to_thread(get, url, "POST"))[0] == 405
    assert d.stop() == 0


    records = [json.loads(line) for line in audit.read_text().splitlines()]
    fields = {"time", "tenant", "session", "op", "buffer", "device", "offset", "bytes", "code",
              "duration_s"}
    assert all(fields <= r.keys() for r in records), records
    by = {(r["op"], r["code"]): r for r in records}
    store = by[("store", "OK")]
    assert (store["buffer"], store["device"], store["offset"], store["bytes"]) == (
        buf, "cpu:0", 64, 4096)
    assert store["tenant"] == "alice" and store["session"].startswith("s-")
    assert store["duration_s"] >= 0
    assert by[("store", "VERIFY_FAILED")]["buffer"] == buf
    assert by[("release", "NOT_FOUND")]["buffer"] == "b-nope"
    assert by[("read", "OUT_OF_RANGE")]["offset"] == 99_999
    assert by[("expire", "OK")]["buffer"] == leased
    assert ("release", "OK") in by and ("request_buffer", "OK") in by
    assert not any(r["op"] in ("challenge", "hello", "get_buffer_meta", "ping") for r in records)
    log = d.log()
    for line in log.splitlines():  # --log-format json: every line Python logs
        if "UCX" in line and not line.startswith("{"):
            continue  # UCX's own C-level warnings bypass Python's logging
        assert {"time", "level", "logger", "message"} <= json.loads(line).keys(), line
    assert "op=store" not in log  # the audit trail went to its file, not to stderr
    token, secret = d.token("alice"), load_or_create_secret(d.secret_file).decode()
    for text in (log, audit.read_text()):
        assert token not in text and token.split(".")[2] not in text and secret not in text


async def test_an_unauthenticated_scrape_names_no_tenant(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """The metrics port has no authentication: by default it shows sums
    over tenants, never a tenant's name, and no tenant's ``stats`` says
    where it is (issue 34, M9: one tenant watched another's block hits)."""
    d = daemon_factory("--device", "cpu:16MiB", "--metrics", "127.0.0.1:0")
    url = metrics_url(d)
    port = url.rsplit(":", 1)[1].split("/")[0]
    async with d.connect("alice-secret") as alice, d.connect("bob-secret") as bob:
        a = await alice.request_buffer(4096)
        b = await bob.request_buffer(4096)
        await alice.put_block("k", np.ones(4096, np.uint8))
        for _ in range(5):
            assert await alice.get_block("k") is not None
        status, text = await asyncio.to_thread(get, url)
        assert status == 200
        assert "alice" not in text and "bob" not in text and "tenant=" not in text
        m = await scrape(url)
        assert value(m, "rpcbuf_tenant_buffers") == 3  # the sum (the block too), no label
        assert value(m, "rpcbuf_block_hits_total") == 5
        assert value(m, "rpcbuf_blocks") == 1
        st = (await alice.stats())["blocks"]  # the block's segment: fds and bytes it holds
        assert st["segments"] == 1 and value(m, "rpcbuf_block_segments") == 1
        assert value(m, "rpcbuf_block_segment_bytes") == st["segment_bytes"] >= 4096
        for ctx in (alice, bob):
            listening = (await ctx.stats())["listening"]
            assert listening and not any(x.endswith(f":{port}") for x in listening)
        await alice.release_buffer(a)
        await bob.release_buffer(b)
        await alice.remove_blocks(["k"])


async def test_metrics_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "rpcbuf.control.daemon", "--secret-file",
                             str(tmp_path / "s"), "--listen", "127.0.0.1:0", "--ucx-port", "0",
                             "--device", "cpu:1MiB", "--metrics", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 2, res.stderr
    assert f"--metrics 127.0.0.1:{port}" in res.stderr and "Traceback" not in res.stderr


# -- the session limit -------------------------------------------------------------------


async def test_max_sessions_refuses_with_quota_exceeded(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:1MiB", "--max-sessions", "2")
    async with d.connect("alice") as a:
        async with d.connect("bob"):
            with pytest.raises(rpcbuf.QuotaExceeded) as info:
                await rpcbuf.connect(d.addr, token=d.token("carol"), timeout=10)
            assert info.value.details == {"limit": "max_sessions", "max_sessions": 2}
            assert await a.ping()  # the others are untouched
        for _ in range(100):  # bob's slot frees once the daemon has seen him go
            try:
                async with d.connect("carol") as c:
                    assert await c.ping()
                break
            except rpcbuf.QuotaExceeded:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("a freed session slot was never reused")
    assert d.stop() == 0
    assert "refusing connection" in d.log() and "QUOTA_EXCEEDED" in d.log()


# -- TLS -----------------------------------------------------------------------------------


async def test_tls_control_channel(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cert, key = self_signed(tmp_path)
    d = daemon_factory("--device", "cpu:1MiB", "--tls-cert", str(cert), "--tls-key", str(key))
    trust = ssl.create_default_context(cafile=str(cert))
    async with rpcbuf.connect(d.addr, token=d.token("alice"), timeout=10, tls=trust) as c:
        buf = await c.request_buffer(4096)
        data = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096]
        await c.store_tensor(buf, data, verify="checksum")
        assert np.array_equal(await c.read_buffer(buf, 0, 4096), data)
        await c.release_buffer(buf)
        with pytest.raises(rpcbuf.RpcBufError, match="speaks TLS"):  # a plaintext client
            await rpcbuf.connect(d.addr, token=d.token("alice"), timeout=10)
        with pytest.raises(rpcbuf.ConnectionLost, match="CERTIFICATE_VERIFY_FAILED"):
            await rpcbuf.connect(d.addr, token=d.token("alice"), timeout=10, tls=True)
        assert await c.ping()  # and the daemon keeps serving
    assert d.stop() == 0


async def test_a_client_without_tls_is_told_the_node_speaks_tls(daemon_factory,  # type: ignore[no-untyped-def]
                                                                 tmp_path: Path) -> None:
    """Issue 37 item 3: TLS on the daemon, no --ca on the client: "closed the
    connection (connection closed by the daemon): see the daemon's log", and
    the log said nothing.  Now both say what to do."""
    cert, key = self_signed(tmp_path)
    d = daemon_factory("--device", "cpu:1MiB", "--tls-cert", str(cert), "--tls-key", str(key))
    for _ in range(2):  # the log says it once (a stranger could send many)
        with pytest.raises(rpcbuf.RpcBufError) as err:
            await rpcbuf.connect(d.addr, token=d.token("alice"), timeout=10)
        assert "this node speaks TLS" in str(err.value) and "--ca" in str(err.value), err.value
        assert err.value.details.get("reason") == "tls_required", err.value.details
    assert d.log().count("connected without TLS") == 1, d.log()[-2000:]
    trust = ssl.create_default_context(cafile=str(cert))
    async with rpcbuf.connect(d.addr, token=d.token("alice"), timeout=10, tls=trust) as c:
        assert await c.ping()  # and TLS clients are served as before


async def test_dedup_store_audit_records_name_device_and_bytes(daemon_factory,  # type: ignore[no-untyped-def]
                                                               tmp_path: Path) -> None:
    """Issue 28 item 15: a ``dedup_store`` that placed nothing (no tensor
    held yet: the first upload) was audited from its request, with
    ``"device": null, "bytes": null``.  Every dedup_store record names the
    buffer's device and the bytes it placed."""
    audit = tmp_path / "audit.log"
    d = daemon_factory("--device", "cpu:16MiB", "--audit-log", str(audit))
    rng = np.random.default_rng(5)
    tensors = {f"t{i}": rng.integers(0, 255, 3000, np.uint8) for i in range(3)}
    async with d.connect("alice") as c:
        first, second = await c.request_buffer(65536), await c.request_buffer(65536)
        sent = await c.store_tensors_dedup(first, tensors)  # nothing held: all sent
        again = await c.store_tensors_dedup(second, tensors)  # all placed from first
        assert (sent["placed"], again["placed"]) == (0, 3)
        await c.release_buffer(first)
        await c.release_buffer(second)
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        records = [json.loads(x) for x in audit.read_text().splitlines()]
        dedups = [r for r in records if r["op"] == "dedup_store"]
        if len(dedups) >= 2 or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    assert {r["buffer"] for r in dedups} == {first, second}, dedups
    for r in dedups:
        assert r["device"] == "cpu:0" and isinstance(r["bytes"], int), r
        assert r["code"] == "OK"
    assert sorted(r["bytes"] for r in dedups) == [0, 9000]


async def test_a_connection_that_never_says_hello_is_logged_as_such(
        daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 28 item 15: ``rpcbuf doctor`` first opens and closes a bare TCP
    connection (is anything listening?); the daemon logged its end as
    ``session ... tenant=None closed``.  It says what it was."""
    d = daemon_factory("--device", "cpu:16MiB")
    host, port = d.addr.rsplit(":", 1)
    _, writer = await asyncio.open_connection(host, int(port))  # what doctor's probe does
    writer.close()
    await writer.wait_closed()
    for _ in range(200):  # the daemon logs it as the connection ends
        if "before saying hello" in d.log():
            break
        await asyncio.sleep(0.05)
    log = d.log()
    assert "tenant=None" not in log, log
    line = next(x for x in log.splitlines() if "before saying hello" in x)
    assert re.search(r"connection s-\S+ from 127\.0\.0\.1:\d+ closed before saying hello",
                     line), line  # who it was
