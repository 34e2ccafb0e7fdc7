"""Who may bind a session's handle channel (``control/daemon/data/handles.py``):
only a second connection to the daemon's Unix socket, from the very process
of the session, naming the nonce its hello gave, once.  Anything else is
refused and leaves the session as it was."""

from __future__ import annotations

import subprocess
import sys

import pytest
from rawwire import Raw

from conftest import DaemonProc
from rpcbuf.control.wire import protocol as P


def _unix(d: DaemonProc) -> str:
    raw = Raw(d.addr)
    try:
        answer = raw.call("hello", token=d.token("probe"), versions=[1, P.PROTOCOL_VERSION])
        return "unix:" + answer["result"]["local"]["socket"]
    finally:
        raw.close()


def _session(unix: str, d: DaemonProc, tenant: str = "alice") -> tuple[Raw, bytes]:
    raw = Raw(unix)
    answer = raw.call("hello", token=d.token(tenant), versions=[1, P.PROTOCOL_VERSION],
                      handles=True)
    assert answer["ok"] and answer["result"]["same_host"], answer
    return raw, answer["result"]["handles_nonce"]


def _bind(unix: str, nonce: bytes) -> dict | None:
    """Bind from this process: the error frame, or None when the staging
    record came (a record is 16 bytes with an fd: no msgpack frame)."""
    import socket

    from rpcbuf.dataplane import shm
    ch = Raw(unix)
    try:
        ch.send(P.encode_frame(P.BindHandles(nonce=nonce).to_wire(1)))
        ch.sock.setblocking(True)
        data, fds, _, _ = socket.recv_fds(ch.sock, 16, 1)
        if fds:
            for fd in fds:
                shm.os.close(fd)
            return None
        ch._buf = data
        return ch.recv()
    finally:
        ch.close()


def test_a_wrong_nonce_or_a_tcp_connection_cannot_bind(daemon: DaemonProc) -> None:
    unix = _unix(daemon)
    raw, nonce = _session(unix, daemon)
    try:
        err = _bind(unix, bytes(16))
        assert err is not None and err["error"]["code"] == "AUTH_FAILED"
        tcp = Raw(daemon.addr)
        try:
            got = tcp.call("bind_handles", nonce=nonce)
            assert got["error"]["code"] == "BAD_REQUEST"
        finally:
            tcp.close()
        assert _bind(unix, nonce) is None  # the session's own process: bound
        err = _bind(unix, nonce)  # once only
        assert err is not None and err["error"]["code"] == "AUTH_FAILED"
        assert raw.call("ping")["ok"]
    finally:
        raw.close()


def test_another_process_cannot_bind_with_the_nonce(daemon: DaemonProc) -> None:
    """A nonce that leaked to another process (same user even) is useless
    there: the channel must come from the session's process."""
    unix = _unix(daemon)
    raw, nonce = _session(unix, daemon)
    try:
        child = subprocess.run(
            [sys.executable, "-c", (
                "import sys, socket\n"
                "sys.path[:0] = ['src', 'tests/hardening']\n"
                "from rawwire import Raw\n"
                "from rpcbuf.control.wire import protocol as P\n"
                "ch = Raw(sys.argv[1])\n"
                "ch.send(P.encode_frame(P.BindHandles(nonce=bytes.fromhex(sys.argv[2]))"
                ".to_wire(1)))\n"
                "print(ch.recv()['error']['code'])\n"), unix, nonce.hex()],
            capture_output=True, text=True, timeout=60)
        assert child.stdout.strip() == "AUTH_FAILED", child.stderr
        assert _bind(unix, nonce) is None  # still there for the right process
    finally:
        raw.close()


@pytest.mark.parametrize("fields", [{}, {"nonce": "x" * 16}, {"nonce": b"\x00" * 10 ** 5}])
def test_malformed_binds_are_refused(daemon: DaemonProc, fields: dict) -> None:
    unix = _unix(daemon)
    ch = Raw(unix)
    try:
        got = ch.call("bind_handles", **fields)
        assert not got["ok"] and got["error"]["code"] in ("BAD_REQUEST", "AUTH_FAILED")
    except ConnectionError:
        pass  # an oversized frame before hello: the connection is closed
    finally:
        ch.close()
