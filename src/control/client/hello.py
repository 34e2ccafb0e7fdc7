"""What the daemon says in ``hello``, checked before the client trusts it.

The client sizes its semaphore, its deadlines and its frame limit from this
answer, dials the UCX port it names and may reconnect on the Unix socket it
names: a malicious or broken daemon must not turn any of that into a hang,
a crash or a huge allocation.  ``check_hello`` takes the decoded answer and
returns it unchanged or raises BAD_REQUEST naming the field
(``details["field"]``, ``details["reason"] == "bad_hello"``).  Sans-I/O: no
asyncio here, so the checks are testable on their own and the same for TCP
and Unix sockets.
"""

from __future__ import annotations

import math
from typing import Any

from control.wire import protocol as P
from control.wire.errors import BadRequest

MAX_INFLIGHT = 1 << 16  # requests on the wire per session
MIN_FRAME, MAX_FRAME = 4 << 10, 1 << 30  # a daemon's frame limit we accept
MAX_TRANSFER_TIMEOUT = 7 * 86400.0  # s: the client's data-plane deadline follows it
MAX_ID = 256  # characters of session_id, tenant, node_id, boot_id
MAX_DEVICES = 4096
SUN_PATH = 107  # bytes of a Unix socket name (sun_path less its NUL)
PID_MAX = 1 << 22  # the kernel's largest pid_max
NONCE_BYTES = 16


def _bad(field: str, why: str) -> BadRequest:
    return BadRequest(f"the daemon's hello is malformed: {field} {why}",
                      {"field": field, "reason": "bad_hello"})


def _int(msg: dict[str, Any], key: str, field: str, lo: int, hi: int) -> int:
    value = msg.get(key)
    if type(value) is not int or not lo <= value <= hi:  # bool is not an int here
        raise _bad(field, f"must be an integer in [{lo}, {hi}], got {value!r:.80}")
    return value


def _str(msg: dict[str, Any], key: str, field: str, hi: int, lo: int = 1) -> str:
    value = msg.get(key)
    if not isinstance(value, str) or not lo <= len(value) <= hi:
        raise _bad(field, f"must be a string of {lo} to {hi} characters, got {value!r:.80}")
    return value


def _map(msg: dict[str, Any], key: str) -> dict[str, Any]:
    value = msg.get(key)
    if not isinstance(value, dict):
        raise _bad(key, f"must be a map, got {type(value).__name__}")
    return value


def check_hello(msg: dict[str, Any], unix: bool) -> dict[str, Any]:
    """``msg`` if every field the client uses is sane; ``unix``: it came over
    the daemon's Unix socket (only there can it offer the same-host path).
    Raises BAD_REQUEST naming the field."""
    for key in ("session_id", "tenant", "node_id"):
        _str(msg, key, key, MAX_ID)
    if "version" in msg and msg["version"] != P.PROTOCOL_VERSION:
        raise _bad("version", f"is {msg['version']!r:.40}; this client speaks "
                              f"{P.PROTOCOL_VERSION}")
    nonce = msg.get("bind_nonce")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise _bad("bind_nonce", f"must be {NONCE_BYTES} bytes")
    _int(_map(msg, "ucx"), "port", "ucx.port", 1, 65535)
    limits = _map(msg, "limits")
    _int(limits, "max_inflight", "limits.max_inflight", 1, MAX_INFLIGHT)
    _int(limits, "max_frame", "limits.max_frame", MIN_FRAME, MAX_FRAME)
    timeout: Any = limits.get("transfer_timeout")
    if type(timeout) not in (int, float) or not math.isfinite(timeout) \
            or not 0 < timeout <= MAX_TRANSFER_TIMEOUT:
        raise _bad("limits.transfer_timeout",
                   f"must be seconds in (0, {MAX_TRANSFER_TIMEOUT:.0f}], got {timeout!r:.40}")
    devices = msg.get("devices", [])
    if not isinstance(devices, list) or len(devices) > MAX_DEVICES:
        raise _bad("devices", f"must be a list of at most {MAX_DEVICES} devices")
    same_host = msg.get("same_host", False)
    if type(same_host) is not bool:
        raise _bad("same_host", "must be true or false")
    if same_host and not unix:
        raise _bad("same_host", "is offered on a TCP connection (only the daemon's Unix "
                                "socket can offer it)")
    if "same_host_why" in msg:
        _str(msg, "same_host_why", "same_host_why", P.MAX_STR, lo=0)
    if msg.get("local") is not None:
        local = _map(msg, "local")
        sock = _str(local, "socket", "local.socket", SUN_PATH)
        if "\0" in sock or len(sock.encode()) > SUN_PATH:
            raise _bad("local.socket", "is not a Unix socket name")
        _str(local, "boot_id", "local.boot_id", MAX_ID, lo=0)
        _int(local, "pid", "local.pid", 1, PID_MAX)
    return msg
