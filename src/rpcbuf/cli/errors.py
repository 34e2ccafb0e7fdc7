"""Errors as sentences: one line per failing node with the cause in words and the
next step; ``--json`` carries the same ``sentence`` beside the wire form.  The
token is only decoded (never verified) to say when it expired.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import time
from typing import Any

from rpcbuf.cli import tables
from rpcbuf.control.wire.errors import RpcBufError
from rpcbuf.control.wire.units import format_size

# Exit codes of every rpcbuf command (README, "CLI"):
EXIT_OK = 0
EXIT_NODE = 1  # an error at a node (some failed: the table shows those that answered)
EXIT_USAGE = 2  # bad usage or a local problem (flag, file, no token)

_CAUSES = {
    errno.ECONNREFUSED: "connection refused",
    errno.EHOSTUNREACH: "no route to host",
    errno.ENETUNREACH: "network unreachable",
    errno.ETIMEDOUT: "timed out",
    errno.ECONNRESET: "connection reset",
    errno.ENOENT: "no such socket",
    errno.EACCES: "permission denied",
}


def positive_seconds(text: str) -> float:
    """argparse ``type``: seconds above 0 and finite."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number of seconds above 0")
    return value


def count_between(lo: int, hi: int) -> Any:
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is not from {lo} to {hi}")
        return value
    check.__name__ = f"a number from {lo} to {hi}"
    return check


def ago(seconds: float) -> str:
    """3 h ago, 12 min ago, 40 s ago."""
    s = max(0.0, seconds)
    if s >= 86400:
        return f"{s / 86400:.0f} d"
    if s >= 3600:
        return f"{s / 3600:.0f} h"
    if s >= 60:
        return f"{s / 60:.0f} min"
    return f"{s:.0f} s"


def _os_cause(exc: BaseException) -> str | None:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError):
            if cause.errno in _CAUSES:
                return _CAUSES[cause.errno]
            if cause.strerror:
                return str(cause.strerror).lower()
            return str(cause) or type(cause).__name__
        cause = cause.__cause__ or cause.__context__
    return None


def sentence(addr: str, exc: RpcBufError, now: float | None = None) -> str:
    """The error at ``addr`` with the next step, ending with its code in
    brackets; ``clean``: the daemon wrote the message and the code."""
    from rpcbuf.cli.tables import clean  # rich: only once an error is printed

    code = exc.details.get("code") if exc.code == "ERROR" else exc.code
    return clean(f"{_words(addr, exc, now)} [{code}]")


def _words(addr: str, exc: RpcBufError, now: float | None) -> str:
    now = time.time() if now is None else now
    code, msg, details = exc.code, exc.message, exc.details
    if details.get("reason") == "insecure_transport":
        return (f"refusing to send the token in plaintext to {addr} (not a loopback "
                "address): run the daemon with --tls-cert/--tls-key and pass --ca PEM (or "
                "$RPCBUF_CA), or --insecure on a network you trust")
    if code == "CONNECTION_LOST" and details.get("reason") == "tls":
        return f"{addr}: {msg}: check --ca ($RPCBUF_CA) and the node's --tls-cert"
    if code == "CONNECTION_LOST" and details.get("reason") == "not_rpcbufd":
        return f"{addr}: {msg}: give the daemon's --listen address"
    if code == "CONNECTION_LOST" and msg.startswith("cannot reach"):
        cause = _os_cause(exc) or "no answer"
        return (f"cannot reach rpcbufd at {addr} ({cause}): is the daemon running? "
                "`systemctl status rpcbufd`")
    if code == "CONNECTION_LOST":
        return f"{addr} closed the connection ({msg}): see the daemon's log " \
               "(`journalctl -u rpcbufd`)"
    if code == "TIMEOUT" and details.get("reason") == "silent_peer":
        return (f"{addr} {msg}: it is not rpcbufd's control port (a daemon's --ucx-port "
                "does that), or that daemon is stuck: give the daemon's --listen address")
    if code == "TIMEOUT":
        return (f"{addr} did not answer in time ({msg}): is it reachable from here (firewall, "
                "address)? `--timeout` waits longer")
    if code == "TOKEN_EXPIRED":
        at = details.get("expired_at")
        when = f" {ago(now - float(at))} ago" if isinstance(at, (int, float)) else ""
        return (f"{addr}: the token expired{when}: make a new one with "
                "`rpcbuf token create --secret-file ... --tenant ...`")
    if code == "AUTH_FAILED":
        why = msg.removeprefix("AUTH_FAILED").strip(": ") or "refused"
        return (f"{addr} refused the token ({why}): make one with `rpcbuf token create` "
                "using this node's secret file, and pass it with --token or $RPCBUF_TOKEN")
    if code == "FORBIDDEN" and details.get("reason") == "no_model_dirs":
        return f"{addr}: {msg}: ask its operator, or load without --from-node (upload)"
    if code == "FORBIDDEN":
        return f"{addr}: {msg}"
    if details.get("reason") == "missing_file":  # a node-local load: the node's own disk
        return f"{addr}: {msg}: copy the model there, or load without --from-node (upload)"
    if details.get("reason") == "protocol_version":  # the message names both versions
        return f"{addr}: {msg}" + ("" if "upgrade" in msg else ": upgrade the older side")
    if code == "NOT_FOUND" and details.get("reason") == "lease_expired":
        return (f"{addr}: {msg}: renew a lease before it runs out (renew_buffer, a longer "
                "--ttl), or store the buffer again")
    if code == "NOT_FOUND" and details.get("reason") == "nowhere":  # names every node asked
        return f"{msg}: `rpcbuf ls` lists this tenant's buffers, `rpcbuf models` its models"
    if code == "NOT_FOUND" and details.get("reason") == "no_such_tensor":
        where = "" if details.get("asked") else f"{addr}: "
        return f"{where}{msg}: `rpcbuf models --json` lists a model's tensors"
    if code == "NOT_FOUND" and "missing" in details:  # the buffer is there, the tensor is not
        return f"{addr}: {msg}: the buffer is there, without that tensor"
    if code == "NOT_FOUND":
        return f"{addr}: {msg} (this tenant has no such buffer there; `rpcbuf ls` lists them)"
    if code == "OUT_OF_MEMORY":
        free = details.get("free")
        extra = f"; {format_size(free)} free" if isinstance(free, int) and "free" not in msg \
            else ""
        return f"{addr}: out of memory ({msg}{extra}): free buffers or use another node"
    if code == "QUOTA_EXCEEDED":
        return f"{addr}: over quota ({msg}): release buffers or ask the operator for more"
    return f"{addr}: {msg}"


def to_json(addr: str, exc: RpcBufError) -> dict[str, Any]:
    return {**exc.to_wire(), "sentence": sentence(addr, exc)}


def report(where: str, exc: RpcBufError, as_json: bool) -> int:
    """Print one whole-command error (JSON or a sentence); EXIT_NODE."""
    if as_json:
        print(json.dumps({"error": to_json(where, exc)}, indent=2, default=str))
    else:
        tables.warn(f"rpcbuf: {sentence(where, exc)}")
    return EXIT_NODE
