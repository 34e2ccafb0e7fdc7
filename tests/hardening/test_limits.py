"""Resource limits: a client that opens too many connections, requests
thousands of tiny buffers, or never reads its answers is cut off (or slowed)
without hurting the other clients."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest
from rawwire import Raw, frame, free_and_sessions, hello, wait_for

from conftest import DaemonProc

MAX_SESSIONS, MAX_INFLIGHT, MAX_BUFFERS = 6, 8, 50


@pytest.fixture(scope="module")
def limited(daemon_factory) -> DaemonProc:  # type: ignore[no-untyped-def]
    return daemon_factory(  # type: ignore[no-any-return]
        "--device", "cpu:64MiB", "--max-sessions", str(MAX_SESSIONS),
        "--max-inflight", str(MAX_INFLIGHT), "--default-quota", f"*:-:{MAX_BUFFERS}")


def test_connections_beyond_max_sessions_are_refused(limited: DaemonProc) -> None:
    probe = hello(limited.addr, limited.token("probe"))
    start = free_and_sessions(probe)
    held = [hello(limited.addr, limited.token("greedy")) for _ in range(MAX_SESSIONS - 1)]
    refused = 0
    for _ in range(10):
        raw = Raw(limited.addr)
        msg = None
        with contextlib.suppress(ConnectionError, OSError):
            msg = raw.call("hello", token=limited.token("greedy"))
        assert msg is not None and msg["id"] is None, msg
        assert msg["error"]["code"] == "QUOTA_EXCEEDED"
        assert raw.drain_to_eof(5.0)  # and it is closed
        raw.close()
        refused += 1
    assert refused == 10
    assert probe.call("ping")["ok"] and all(h.call("ping")["ok"] for h in held)
    for h in held:
        h.close()
    assert wait_for(probe, start) == start
    again = hello(limited.addr, limited.token("greedy"))  # room again once they left
    again.close()
    probe.close()


def test_thousands_of_tiny_buffers_hit_the_buffer_quota(limited: DaemonProc) -> None:
    probe = hello(limited.addr, limited.token("probe"))
    start = free_and_sessions(probe)
    hog = hello(limited.addr, limited.token("hog"))
    n = 2000
    hog.send(b"".join(frame({"op": "request_buffer", "id": i + 10, "size": 64})
                      for i in range(n)))
    codes: dict[str, int] = {}
    for _ in range(n):
        msg = hog.recv()
        assert msg is not None
        code = "OK" if msg["ok"] else msg["error"]["code"]
        codes[code] = codes.get(code, 0) + 1
    assert codes == {"OK": MAX_BUFFERS, "QUOTA_EXCEEDED": n - MAX_BUFFERS}, codes
    other = hello(limited.addr, limited.token("innocent"))  # another tenant is unaffected
    assert other.call("request_buffer", size=64)["ok"]
    other.close()
    hog.close()  # session-scoped: all of them go with it
    assert wait_for(probe, start) == start
    probe.close()


def test_a_client_that_never_reads_is_throttled_alone(limited: DaemonProc) -> None:
    probe = hello(limited.addr, limited.token("probe"))
    start = free_and_sessions(probe)
    mute = hello(limited.addr, limited.token("mute"))
    mute.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    mute.sock.setblocking(False)
    pings = b"".join(frame({"op": "ping", "id": i}) for i in range(1000))
    sent, stalled = 0, False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            sent += mute.sock.send(pings)
        except BlockingIOError:
            # The daemon stopped reading us; check that it still serves others.
            t0 = time.monotonic()
            assert probe.call("ping")["ok"]
            assert time.monotonic() - t0 < 2.0
            time.sleep(0.05)
            try:
                sent += mute.sock.send(pings)
            except BlockingIOError:
                stalled = True
                break
    assert stalled, f"the daemon kept reading a client that never reads ({sent} bytes)"
    mute.close()
    assert wait_for(probe, start) == start
    probe.close()
