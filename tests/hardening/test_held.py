"""What a tenant (or a peer that never authenticates) can make the daemon
hold, charged and bounded (issue 34, findings 6-8): the fds and mappings of
its buffers and blocks, its TLS handshakes, its half-sent frames.  Real
daemons, raw sockets where the attack needs them."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import ssl
import struct
import time
import urllib.request
from pathlib import Path

import numpy as np
from tests.certs import self_signed
from tests.conftest import metrics_url, start_daemon
from tests.hardening.rawwire import hello

import rpcbuf

MiB = 1 << 20


# The daemon under a small open-files limit (its own main raises the soft
# limit to the hard one, so both are set), and small session caps: the
# node's fd budget is then an eighth of 4096 (512), half of it a tenant's.
LOW_NOFILE = ("-c", "import resource, sys; "
                    "resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096)); "
                    "from rpcbuf.control.daemon.service.main import main; "
                    "sys.exit(main(sys.argv[1:]))")


def test_a_tenant_at_its_fd_limit_gets_quota_exceeded_and_nobody_else_notices(
        tmp_path: Path) -> None:
    """Finding 6: every host buffer (and block) holds a memfd; 19,967 blocks
    of 4 KiB inside a 512 MiB quota took all 20,000 of the daemon's fds, no
    tenant could connect after, and the log grew by 5,000 lines.  Here
    (4,096 fds) alice used to get 4,065 buffers, then OUT_OF_MEMORY "Too
    many open files", and bob's connect was reset.  Now alice's fds are
    charged to her: QUOTA_EXCEEDED naming the limit, and bob is served."""
    d = start_daemon(tmp_path, "--device", "cpu:512MiB", "--max-sessions", "64",
                     "--max-unauthenticated", "64", "--metrics", "127.0.0.1:0",
                     launch=LOW_NOFILE)
    try:
        alice = hello(d.addr, d.token("alice"))
        held, error = 0, None
        while held < 5000:  # bounded: the old daemon ran out of fds at 4,065
            answer = alice.call("request_buffer", size=4096)
            if not answer["ok"]:
                error = answer["error"]
                break
            held += 1
        assert error is not None and error["code"] == "QUOTA_EXCEEDED", (held, error)
        assert error["details"]["limit"] == "fds", error
        assert "--max-fds-per-tenant" in error["message"]
        assert held == error["details"]["max"] < 4096 // 2
        assert d.fds() < 4096 - 1000  # the node's reserve is untouched
        lines = d.log().count("\n")
        for _ in range(20):  # a tenant that keeps asking: one line per request, no more
            assert alice.call("request_buffer", size=4096)["error"]["code"] == "QUOTA_EXCEEDED"
        assert d.log().count("\n") - lines <= 20
        limits = alice.call("stats")["result"]["limits"]
        assert limits["fds"] == {"held": held, "limit": held}
        assert limits["mappings"]["held"] == held
        assert limits["buffers"]["held"] == held

        bob = hello(d.addr, d.token("bob"))  # nobody else notices
        for _ in range(10):
            assert bob.call("request_buffer", size=4096)["ok"]
        bob_limits = bob.call("stats")["result"]["limits"]
        assert bob_limits["fds"]["held"] == 10  # its own rows only
        assert bob_limits["sessions"]["held"] == 1

        with urllib.request.urlopen(metrics_url(d), timeout=10) as res:
            text = res.read().decode()
        assert re.search(rf'^rpcbuf_held\{{kind="fds"\}} {held + 10}\.0$', text, re.M), text
        assert re.search(r'^rpcbuf_held_refusals_total\{kind="fds"\} 21\.0$', text, re.M)
        assert not re.search(r'^rpcbuf_held\w*\{[^}]*tenant', text, re.M)  # aggregates only
        alice.close()
        bob.close()
    finally:
        assert d.stop() == 0, d.log()[-3000:]


async def test_a_tenants_blocks_are_charged_their_segments_fds(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Blocks live in a few segments per tenant (issue 40): each segment is
    charged an fd and a mapping, the blocks in it nothing more.  Before,
    each block was a memfd: 32 fds held 32 blocks and the 33rd put evicted
    the oldest.  Now 4 fds hold all 300 blocks, none evicted."""
    d = daemon_factory("--device", "cpu:64MiB", "--max-fds-per-tenant", "4")
    async with d.connect("alice") as c:
        for i in range(300):
            await c.put_blocks({f"k{i}": np.full(4096, i % 251, np.uint8)})
        st = await c.stats()
        assert 1 <= st["limits"]["fds"]["held"] <= 4  # a 4 KiB staging area: no fd
        assert st["limits"]["fds"]["held"] == st["limits"]["mappings"]["held"]
        assert st["limits"]["fds"]["held"] == st["blocks"]["segments"]
        assert st["blocks"]["blocks"] == 300 and st["blocks"]["evictions"] == 0
    async with d.connect("bob") as c:  # bob's own
        await c.put_blocks({f"k{i}": np.zeros(4096, np.uint8) for i in range(32)})
        assert (await c.stats())["blocks"]["blocks"] == 32


def test_tls_handshakes_count_against_the_unauthenticated_caps(tmp_path: Path) -> None:
    """Finding 7: with TLS a connection counted toward the caps only once
    its handshake was done (the server did it), so one source held 18,561
    fds in handshakes against caps of 128 per source.  Here 300 raw
    connections that never handshake took the daemon from 30 to 330 fds.
    Now they count from accept: at most the per-source cap stays open, and
    a TLS client still gets in."""
    cert, key = self_signed(tmp_path)
    d = start_daemon(tmp_path / "d", "--device", "cpu:16MiB", "--tls-cert", str(cert),
                     "--tls-key", str(key), "--max-unauthenticated-per-source", "16")
    socks: list[socket.socket] = []
    try:
        host, port = d.addr.rsplit(":", 1)
        before = d.fds()
        for _ in range(300):
            socks.append(socket.create_connection((host, int(port)), timeout=10))
        peak, deadline = 0, time.monotonic() + 3
        while time.monotonic() < deadline:  # the daemon accepts them all meanwhile
            peak = max(peak, d.fds())
            time.sleep(0.05)
        assert peak <= before + 16 + 4, (before, peak)

        async def client() -> float:
            trust = ssl.create_default_context(cafile=str(cert))
            async with rpcbuf.connect(d.addr, token=d.token("alice"), timeout=10,
                                      tls=trust) as c:
                return await c.ping()
        assert asyncio.run(client())
    finally:
        for s in socks:
            s.close()
        assert d.stop() == 0, d.log()[-3000:]


def partial_frame(length: int, sent: int) -> bytes:
    """The length of a frame of ``length`` bytes and the first ``sent`` of them."""
    return struct.pack("!I", length) + b"\0" * sent


def test_half_sent_frames_are_charged_to_the_tenant(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Finding 8: a frame's bytes waited in the decoder charged to no one: a
    tenant with a 1 MiB quota sent 15 MiB of a frame on each of 64 sessions
    and the daemon grew from 76 to 1,038 MiB.  Now they are the tenant's,
    up to --max-buffered-per-tenant over all its sessions; past it that
    session ends with QUOTA_EXCEEDED, and other tenants notice nothing."""
    d = daemon_factory("--device", "cpu:16MiB", "--max-frame", "4MiB",
                       "--max-buffered-per-tenant", "6MiB", "--quota", "alice:1MiB:10")
    first = hello(d.addr, d.token("alice"))
    first.send(partial_frame(4 * MiB, 3 * MiB + MiB // 2))
    probe = hello(d.addr, d.token("alice"))
    deadline = time.monotonic() + 10
    while probe.call("stats")["result"]["limits"]["frame_bytes"]["held"] < 3 * MiB:
        assert time.monotonic() < deadline, "the first half frame never arrived"
        time.sleep(0.05)
    second = hello(d.addr, d.token("alice"))
    with contextlib.suppress(OSError):  # the daemon ends it: the rest may be reset
        second.send(partial_frame(4 * MiB, 3 * MiB + MiB // 2))
    error = second.recv()
    assert error is not None and error["error"]["code"] == "QUOTA_EXCEEDED", error
    assert error["error"]["details"]["limit"] == "frame_bytes"
    assert second.drain_to_eof(10)
    bob = hello(d.addr, d.token("bob"))  # another tenant: its own room
    bob.send(partial_frame(4 * MiB, 3 * MiB + MiB // 2))
    assert probe.call("ping")["ok"]
    first.close()
    deadline = time.monotonic() + 10
    while probe.call("stats")["result"]["limits"]["frame_bytes"]["held"]:
        assert time.monotonic() < deadline, ("a closed session's half frame stayed charged",
                                             probe.call("stats")["result"]["limits"])
        time.sleep(0.05)
    for raw in (probe, second, bob):
        raw.close()


def test_a_half_sent_frame_has_a_deadline(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A frame must arrive whole within --frame-timeout of its first byte
    (it had no deadline at all after hello); a session that sends whole
    frames slowly is not bothered."""
    d = daemon_factory("--device", "cpu:16MiB", "--frame-timeout", "1s")
    slow = hello(d.addr, d.token("alice"))
    slow.send(partial_frame(1000, 10))
    patient = hello(d.addr, d.token("alice"))
    started = time.monotonic()
    error = slow.recv()
    assert error is not None and error["error"]["code"] == "TIMEOUT", error
    assert error["error"]["details"]["limit"] == "frame_timeout"
    assert slow.drain_to_eof(10)
    assert time.monotonic() - started < 10
    for _ in range(3):  # whole frames, a second apart: never a half frame waiting
        assert patient.call("ping")["ok"]
        time.sleep(0.6)
    slow.close()
    patient.close()


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) >> 10
    raise AssertionError("no VmRSS")


def test_a_closed_sessions_half_frame_is_freed_at_once(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """The decoder's buffer goes when its session closes, not when a
    garbage collection finds the session (a session and its intake refer to
    each other): with the collector off, 4 sessions' 15 MiB half frames
    stayed in the daemon after they closed (RSS stayed up by 60 MiB)."""
    d = daemon_factory("--device", "cpu:16MiB", gc_disabled=True)
    pid = d.proc.pid
    probe = hello(d.addr, d.token("bob"))
    base = rss_mib(pid)
    raws = [hello(d.addr, d.token("alice")) for _ in range(4)]
    for raw in raws:
        raw.send(partial_frame(16 * MiB, 15 * MiB))
    deadline = time.monotonic() + 10
    while rss_mib(pid) < base + 50:
        assert time.monotonic() < deadline, (base, rss_mib(pid))
        time.sleep(0.05)
    for raw in raws:
        raw.close()
    deadline = time.monotonic() + 10
    while rss_mib(pid) > base + 20:
        assert time.monotonic() < deadline, ("the half frames stayed", base, rss_mib(pid))
        time.sleep(0.1)
    assert probe.call("ping")["ok"]
    probe.close()


def test_a_tls_client_gets_in_with_a_per_source_cap_of_one(tmp_path: Path) -> None:
    """A TLS connection counts as one from accept: its handshake and then
    its session are one connection, never two of its source's slots (with a
    cap of one, the session must not evict its own handshake)."""
    cert, key = self_signed(tmp_path)
    d = start_daemon(tmp_path / "d", "--device", "cpu:16MiB", "--tls-cert", str(cert),
                     "--tls-key", str(key), "--max-unauthenticated-per-source", "1")

    async def clients() -> None:
        trust = ssl.create_default_context(cafile=str(cert))
        for _ in range(5):
            async with rpcbuf.connect(d.addr, token=d.token("alice"), timeout=10,
                                      tls=trust) as c:
                assert await c.ping()
    try:
        asyncio.run(clients())
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def test_a_frame_of_tiny_objects_is_refused_before_it_is_built(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A frame's bytes did not bound what decoding it built: msgpack spends
    one byte on an empty map, Python about 70, so a tenant's 15 MiB frame of
    empty maps grew the daemon by about 1 GiB and held its loop for seconds,
    every other tenant waiting.  The decoder now counts items: that session
    ends (BAD_REQUEST), the daemon grows by at most the bound's worth, and
    another tenant is answered."""
    d = daemon_factory("--device", "cpu:16MiB")
    pid = d.proc.pid
    bob = hello(d.addr, d.token("bob"))
    base = rss_mib(pid)
    mallory = hello(d.addr, d.token("alice"))
    body = b"\x82\xa2op\xa4ping\xa1x\xdd" + struct.pack("!I", 15 * MiB) + b"\x80" * (15 * MiB)
    with contextlib.suppress(OSError):  # the daemon ends it: the rest may be reset
        mallory.send(struct.pack("!I", len(body)) + body)
    error = mallory.recv()
    assert error is not None and error["error"]["code"] == "BAD_REQUEST", error
    assert bob.call("ping")["ok"]
    assert rss_mib(pid) < base + 200, (base, rss_mib(pid))  # it was about base + 1,000
    mallory.close()
    bob.close()
