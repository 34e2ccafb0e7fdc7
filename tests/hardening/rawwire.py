"""Helpers for the hardening suite: raw control-protocol sockets (no client
library), and the counts that ``make soak`` (RPCBUF_SOAK=1) raises."""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any

import msgpack

from rpcbuf.control.wire import auth, protocol as P

SOAK = os.environ.get("RPCBUF_SOAK") == "1"


def scaled(quick: float, soak: float) -> Any:
    return soak if SOAK else quick


def frame(msg: Any) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return struct.pack("!I", len(body)) + body


class Raw:
    """A blocking control connection speaking frames by hand."""

    def __init__(self, addr: str, timeout: float = 10.0) -> None:
        """``addr``: "HOST:PORT", or "unix:NAME" (a path, or "@name": abstract)."""
        if addr.startswith("unix:"):
            name = addr[len("unix:"):]
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect("\0" + name[1:] if name.startswith("@") else name)
        else:
            host, port = addr.rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.unpacker = msgpack.Unpacker(raw=False)
        self._buf = b""
        self._next_id = 1

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request and its answer.  A hello given ``token=`` is said as
        protocol 4 says it (``say_hello``): the token itself is never sent."""
        if op == "hello" and "token" in fields:
            return self.say_hello(**fields)
        return self.call_raw(op, **fields)

    def say_hello(self, token: str, **fields: Any) -> dict[str, Any]:
        """The challenge (its answer checked, as the client does), then the
        hello with our proof; the challenge's refusal if it was refused.
        ``versions``/``version`` go into the challenge; the rest into hello."""
        claims, secret = auth.split_token(token)
        nonce = os.urandom(auth.NONCE_BYTES)
        versions = fields.pop("versions", None)
        version = fields.pop("version", None)
        if versions is None:
            versions = [version, version] if version is not None else \
                [P.PROTOCOL_MIN, P.PROTOCOL_VERSION]
        said = self.call_raw("challenge", claims=claims, nonce=nonce, versions=versions)
        if not said.get("ok"):
            return said
        res = said["result"]
        transcript = auth.transcript(res["version"], claims, nonce, res["nonce"])
        assert res["proof"] == auth.prove(secret, auth.DAEMON, transcript)
        return self.call_raw("hello", proof=auth.prove(secret, auth.CLIENT, transcript),
                             **fields)

    def call_raw(self, op: str, **fields: Any) -> dict[str, Any]:
        req_id = self._next_id
        self._next_id += 1
        self.send(frame({"op": op, "id": req_id, **fields}))
        while True:
            msg = self.recv()
            if msg is None:
                raise ConnectionError("daemon closed the connection")
            if msg.get("id") in (req_id, None):
                return msg

    def recv(self) -> dict[str, Any] | None:
        """The next message, or None at EOF."""
        while len(self._buf) < 4 or len(self._buf) < 4 + struct.unpack_from("!I", self._buf)[0]:
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self._buf += data
        (n,) = struct.unpack_from("!I", self._buf)
        body, self._buf = self._buf[4:4 + n], self._buf[4 + n:]
        msg: dict[str, Any] = msgpack.unpackb(body, raw=False)
        return msg

    def drain_to_eof(self, timeout: float) -> bool:
        """Read until the daemon closes; False if it did not within ``timeout``."""
        deadline = time.monotonic() + timeout
        self.sock.settimeout(timeout)
        try:
            while time.monotonic() < deadline:
                if not self.sock.recv(1 << 16):
                    return True
        except TimeoutError:
            return False
        except OSError:
            return True  # reset: closed too
        return False

    def close(self) -> None:
        self.sock.close()


def hello(addr: str, token: str) -> Raw:
    raw = Raw(addr)
    answer = raw.call("hello", token=token)  # the default version: the newest
    assert answer["ok"], answer
    return raw


def free_and_sessions(probe: Raw) -> tuple[int, int]:
    """Pool free bytes and the daemon's session count, by ``stats``."""
    st = probe.call("stats")
    assert st["ok"], st
    res = st["result"]
    return sum(int(d["free"]) for d in res["devices"]), int(res["sessions"])


def wait_for(probe: Raw, expected: tuple[int, int], timeout: float = 15.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while True:
        got = free_and_sessions(probe)
        if got == expected or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def release_all(probe: Raw) -> None:
    """Release every buffer of ``probe``'s tenant (named ones outlive sessions)."""
    bufs = probe.call("list_buffers")["result"]["buffers"]
    for b in bufs:
        probe.call("release", buffer_id=b["buffer_id"])
