"""What the daemon says in ``hello``, checked before the client trusts it.

The client sizes its slots, deadlines and frame limit from this answer and
dials what it names: a malicious or broken daemon must not turn any of that
into a hang, a crash or a huge allocation.  Sans-I/O.

- ``parse_hello`` returns a frozen ``HelloAnswer`` or raises BAD_REQUEST
  naming the field (``reason: bad_hello``).  A version outside the client's
  range is refused naming both ranges; there is no fallback.
- ``check_challenge``: a proof that the daemon holds the key that signed our
  token, else AUTH_FAILED (``daemon_unproven``) before anything derived from
  the token's secret is sent.
"""

from __future__ import annotations

import hmac
import math
from dataclasses import dataclass
from typing import Any

from rpcbuf.control.client.answers import CHECKSUM_KINDS, Device, bad_answer, parse_devices
from rpcbuf.control.wire import auth, protocol as P
from rpcbuf.control.wire.errors import AuthFailed, BadRequest

MAX_INFLIGHT = 1 << 16  # requests on the wire per session
MIN_FRAME, MAX_FRAME = 4 << 10, 1 << 30  # a daemon's frame limit we accept
MAX_TRANSFER_TIMEOUT = 7 * 86400.0  # s: the client's data-plane deadline follows it
MAX_ID = 256  # characters of session_id, tenant, node_id, boot_id
MAX_DEVICES = 4096
SUN_PATH = 107  # bytes of a Unix socket name (sun_path less its NUL)
PID_MAX = 1 << 22  # the kernel's largest pid_max
NONCE_BYTES = 16


def _bad(field: str, why: str) -> BadRequest:
    return bad_answer("hello", field, why)


@dataclass(frozen=True, slots=True)
class Local:
    """Where the daemon's same-host socket is (a TCP hello from this host)."""

    socket: str
    boot_id: str
    pid: int


@dataclass(frozen=True, slots=True)
class HelloAnswer:
    session_id: str
    tenant: str
    node_id: str
    version: int  # the protocol version this session speaks
    bind_nonce: bytes
    ucx_port: int
    max_inflight: int
    max_frame: int
    transfer_timeout: float
    devices: tuple[Device, ...]
    checksum_kinds: dict[str, str]  # device key -> its checksum ("xxh3", "devsum")
    same_host: bool
    same_host_why: str | None
    local: Local | None
    handles_nonce: bytes | None = None  # same_host: what binds the handle channel
    inline_max: int = 0  # stores/reads up to this many bytes may ride in their frames
    block_inline: bool = False  # ... and block puts and gets (a daemon that says so)

    def checksum_kind(self, device_type: str, device: int) -> str:
        """The checksum a plain store into that device is verified with."""
        gpu = device_type.upper() == "GPU"
        stated = self.checksum_kinds.get(f"{'cuda' if gpu else 'cpu'}:{device}")
        return stated if stated is not None else ("devsum" if gpu else "xxh3")


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
    """``msg`` if ``parse_hello`` accepts it.  Raises BAD_REQUEST naming the field."""
    parse_hello(msg, unix)
    return msg


def _version(msg: dict[str, Any]) -> int:
    mine = (P.PROTOCOL_MIN, P.PROTOCOL_VERSION)
    version = msg.get("version")
    if type(version) is not int or not mine[0] <= version <= mine[1]:
        node = (version, version) if type(version) is int else (0, 0)
        err = P.version_mismatch(node, mine)
        raise BadRequest(err.message, {**err.details, "field": "version",
                                       "reason": "protocol_version"})
    return version


def check_challenge(msg: dict[str, Any], addr: str, claims: str, nonce: bytes,
                    secret: bytes) -> tuple[int, bytes]:
    """The version the daemon chose and the transcript both proofs cover.
    Raises BAD_REQUEST, AUTH_FAILED (``daemon_unproven``)."""
    version = _version(msg)
    ours = msg.get("nonce")
    proof = msg.get("proof")
    if not isinstance(ours, bytes) or len(ours) != auth.NONCE_BYTES:
        raise bad_answer("challenge", "nonce", f"must be {auth.NONCE_BYTES} bytes")
    said = auth.transcript(version, claims, nonce, ours)
    if not isinstance(proof, bytes) or not hmac.compare_digest(
            proof, auth.prove(secret, auth.DAEMON, said)):
        raise AuthFailed(
            f"the daemon at {addr} could not prove it holds the node's key (the key that "
            "signed this token): a token for another node or key, or an impostor on that "
            "address; nothing that could open a session was sent",
            {"reason": "daemon_unproven"})
    return version, said


def _checksum_kinds(msg: dict[str, Any]) -> dict[str, str]:
    kinds = msg.get("checksum_kinds", {})
    if not isinstance(kinds, dict) or len(kinds) > MAX_DEVICES or not all(
            isinstance(k, str) and len(k) <= MAX_ID and v in CHECKSUM_KINDS
            for k, v in kinds.items()):
        raise _bad("checksum_kinds", f"must map at most {MAX_DEVICES} device keys to one "
                                     f"of {list(CHECKSUM_KINDS)}")
    return kinds


def parse_hello(msg: dict[str, Any], unix: bool) -> HelloAnswer:
    """The hello as a ``HelloAnswer``; ``unix``: it came over the Unix socket
    (only there may it offer the same-host path).  Raises BAD_REQUEST."""
    ids = [_str(msg, key, key, MAX_ID) for key in ("session_id", "tenant", "node_id")]
    version = _version(msg)
    nonce = msg.get("bind_nonce")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise _bad("bind_nonce", f"must be {NONCE_BYTES} bytes")
    port = _int(_map(msg, "ucx"), "port", "ucx.port", 1, 65535)
    limits = _map(msg, "limits")
    inflight = _int(limits, "max_inflight", "limits.max_inflight", 1, MAX_INFLIGHT)
    frame = _int(limits, "max_frame", "limits.max_frame", MIN_FRAME, MAX_FRAME)
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
    handles = msg.get("handles_nonce")
    if same_host and (not isinstance(handles, bytes) or len(handles) != NONCE_BYTES):
        raise _bad("handles_nonce", f"must be {NONCE_BYTES} bytes with same_host")
    why = None
    if "same_host_why" in msg:
        why = _str(msg, "same_host_why", "same_host_why", P.MAX_STR, lo=0)
    local = None
    if msg.get("local") is not None:
        where = _map(msg, "local")
        sock = _str(where, "socket", "local.socket", SUN_PATH)
        if "\0" in sock or len(sock.encode()) > SUN_PATH:
            raise _bad("local.socket", "is not a Unix socket name")
        local = Local(sock, _str(where, "boot_id", "local.boot_id", MAX_ID, lo=0),
                      _int(where, "pid", "local.pid", 1, PID_MAX))
    # A daemon older than the field carries no bytes in frames (0).
    inline = _int(msg, "inline_max", "inline_max", 0, P.INLINE_MAX) \
        if "inline_max" in msg else 0
    inline = min(inline, P.inline_max(frame))  # a frame must hold it, whatever was said
    return HelloAnswer(
        session_id=ids[0], tenant=ids[1], node_id=ids[2], version=version, bind_nonce=nonce,
        ucx_port=port, max_inflight=inflight, max_frame=frame,
        transfer_timeout=float(timeout), devices=parse_devices(devices, "hello"),
        checksum_kinds=_checksum_kinds(msg), same_host=same_host, same_host_why=why,
        local=local, handles_nonce=handles if same_host else None, inline_max=inline,
        block_inline=msg.get("block_inline") is True)
