"""The daemon's logs: the normal log (text or JSON lines) and the audit trail.

The audit trail is one structured record per memory operation: time, tenant,
session, op, buffer, device, offset, bytes, result code and duration.  A
session's ``_log`` calls ``record`` with what the op touched; the record
waits on the request (a ``ContextVar``: each request task has its own) until
the request is answered, and ``finish`` writes it once with the result code
and the duration.  An op that failed before touching a buffer is written from
its request's fields.  Outside a request (a session closing, a lease
expiring) a record is written at once.

Records go to ``--audit-log PATH`` as JSON lines (reopened if logrotate moves
the file), or else into the normal log: ``op=... tenant=... code=...`` in
text, one object per line in JSON.  The audit trail is written whatever
``--log-level`` says.  Tokens and secrets are never part of a record.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

AUDIT = logging.getLogger("rpcbuf.audit")
# Ops that only look: everything else allocates, frees or touches bytes and is audited.
NOT_MEMORY_OPS = frozenset({"hello", "get_buffer_meta", "open_buffer", "list_devices",
                            "list_buffers", "stats", "ping", "invalid"})


@dataclass
class OpRecord:
    """One request in progress: what it touched, until it is answered."""

    op: str
    tenant: str | None
    session: str
    started: float  # time.perf_counter()
    request: Any = None
    entries: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False


CURRENT: ContextVar[OpRecord | None] = ContextVar("rpcbuf_current_op", default=None)


def record(entry: dict[str, Any]) -> None:
    """Attach ``entry`` (op, tenant, session, buffer, device, offset, bytes,
    note) to the request being served, or write it now outside one."""
    rec = CURRENT.get()
    if rec is None or rec.done:
        write({**entry, "code": "OK", "duration_s": 0.0})
    else:
        rec.entries.append(entry)


def finish(rec: OpRecord, code: str, error: str | None = None) -> None:
    """The request was answered: write its records with the result."""
    rec.done = True
    if rec.op in NOT_MEMORY_OPS and not rec.entries:
        return
    result: dict[str, Any] = {"code": code,
                              "duration_s": round(time.perf_counter() - rec.started, 6)}
    if error:
        result["error"] = error
    for entry in rec.entries or [_from_request(rec)]:
        write({**entry, **result})


def _from_request(rec: OpRecord) -> dict[str, Any]:
    """What a request that failed before touching a buffer asked for."""
    req = rec.request
    device = None
    if hasattr(req, "device_type"):
        device = f"{req.device_type.lower()}:{getattr(req, 'device', 0)}"
    nbytes = getattr(req, "nbytes", None)
    return {"op": rec.op, "tenant": rec.tenant, "session": rec.session,
            "buffer": getattr(req, "buffer_id", None) or getattr(req, "dst_id", None),
            "device": device,
            "offset": getattr(req, "offset", None) or getattr(req, "dst_offset", 0) or 0,
            "bytes": getattr(req, "size", None) if nbytes is None else nbytes}


def write(entry: dict[str, Any]) -> None:
    AUDIT.info("%s", _Text(entry), extra={"audit": entry})


class _Text:
    """Formats an audit entry as ``key=value`` only if a text handler asks."""

    __slots__ = ("entry",)

    def __init__(self, entry: dict[str, Any]) -> None:
        self.entry = entry

    def __str__(self) -> str:
        e = self.entry
        text = (f"op={e['op']} tenant={e['tenant']} session={e['session']} "
                f"buffer={e['buffer']} device={e['device']} offset={e['offset']} "
                f"bytes={e['bytes']} code={e['code']} "
                f"duration_ms={e['duration_s'] * 1000:.3f}")
        if e.get("note"):
            text += f" ({e['note']})"
        if e.get("error"):
            text += f": {e['error']}"
        return text


def _iso(created: float) -> str:
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")


class JsonFormatter(logging.Formatter):
    """One JSON object per line.  ``meta`` adds level and logger (the normal
    log); the audit file holds only the audit fields."""

    def __init__(self, meta: bool = True) -> None:
        super().__init__()
        self.meta = meta

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": _iso(record.created)}
        if self.meta:
            out["level"] = record.levelname
            out["logger"] = record.name
        audit = getattr(record, "audit", None)
        if isinstance(audit, dict):
            out.update(audit)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str, fmt: str = "text", audit_log: str | None = None) -> None:
    """Configure the root logger (stderr) and the audit trail.
    Raises OSError when the audit file cannot be opened."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("ucx").setLevel(logging.WARNING)
    AUDIT.setLevel(logging.INFO)  # an audit trail, not diagnostics: whatever --log-level says
    for h in list(AUDIT.handlers):
        AUDIT.removeHandler(h)
        h.close()
    if audit_log:
        file = logging.handlers.WatchedFileHandler(audit_log, encoding="utf-8")
        file.setFormatter(JsonFormatter(meta=False))
        AUDIT.addHandler(file)
        AUDIT.propagate = False
    else:
        AUDIT.propagate = True


def set_level(level: str) -> None:
    logging.getLogger().setLevel(level)
