"""The daemon's logs: the normal log (text or JSON lines) and the audit trail.

- One audit record per memory op (time, tenant, session, op, buffer, device,
  offset, bytes, code, duration): ``record`` attaches it to the request being
  served (a ``ContextVar``), ``finish`` writes it once with code and duration;
  outside a request it is written at once. Written whatever ``--log-level`` says.
- To ``--audit-log`` as JSON lines (reopened when moved), else into the normal log.
- No secrets in a record. Whatever a client controls is escaped (every value that
  is not printable is written as its repr), so no client can forge a line.
- Hot path: records bypass ``logging``; ``_AuditSink`` formats each at once and
  writes one loop turn's lines in one write at the turn's end. Outside a loop a
  record is written at once, a normal log line flushes the audit lines before it
  (order kept), and the sink is flushed on replacement and at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time
from asyncio import AbstractEventLoop, get_running_loop
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any

AUDIT = logging.getLogger("rpcbuf.audit")
# Ops that only look: everything else allocates, frees or touches bytes and is audited.
NOT_MEMORY_OPS = frozenset({"challenge", "hello", "get_buffer_meta", "open_buffer",
                            "list_devices", "list_buffers", "stats", "ping", "invalid"})
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"  # the normal log, text


@dataclass(slots=True)
class OpRecord:
    """One request in progress: what it touched, until it is answered."""

    op: str
    tenant: str | None
    session: str
    started: float  # time.perf_counter()
    request: Any = None
    entries: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    quiet: bool = False  # see quiet()


CURRENT: ContextVar[OpRecord | None] = ContextVar("rpcbuf_current_op", default=None)


def record(entry: dict[str, Any]) -> None:
    """Attach ``entry`` to the request being served, or write it now outside one."""
    rec = CURRENT.get()
    if rec is None or rec.done:
        write({**entry, "code": "OK", "duration_s": 0.0})
    else:
        rec.entries.append(entry)


def quiet() -> None:
    """The request being served writes no audit record if it succeeds (a coalesced renew)."""
    rec = CURRENT.get()
    if rec is not None:
        rec.quiet = True


def finish(rec: OpRecord, code: str, error: str | None = None) -> None:
    """The request was answered: write its records with the result."""
    rec.done = True
    if rec.quiet and code == "OK":
        return
    entries = rec.entries
    if not entries:
        if rec.op in NOT_MEMORY_OPS:
            return
        entries = [_from_request(rec)]
    duration = round(time.perf_counter() - rec.started, 6)
    for entry in entries:
        out = {**entry, "code": code, "duration_s": duration}
        if error:
            out["error"] = error
        write(out)


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
    """Write one finished record (with ``code`` and ``duration_s``)."""
    sink = _SINK
    if sink is not None:
        sink.add(entry)
    else:  # setup() was never called (a library user): the logging module decides
        AUDIT.info("%s", _Text(entry), extra={"audit": entry})


def escape(value: Any) -> str:
    """``value`` on one line: printable text as is, anything else escaped."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return text.encode("unicode_escape").decode("ascii")


def _text(e: dict[str, Any]) -> str:
    # One printability test of the whole line (the common case: every field
    # printable, so none needs escaping); else field by field.
    text = (f"op={e['op']} tenant={e['tenant']} session={e['session']} "
            f"buffer={e['buffer']} device={e['device']} offset={e['offset']} "
            f"bytes={e['bytes']} code={e['code']} "
            f"duration_ms={e['duration_s'] * 1000:.3f}")
    note, error = e.get("note"), e.get("error")
    if note:
        text += f" ({note})"
    if error:
        text += f": {error}"
    if text.isprintable():
        return text
    text = (f"op={escape(e['op'])} tenant={escape(e['tenant'])} "
            f"session={escape(e['session'])} buffer={escape(e['buffer'])} "
            f"device={escape(e['device'])} offset={escape(e['offset'])} "
            f"bytes={escape(e['bytes'])} code={escape(e['code'])} "
            f"duration_ms={e['duration_s'] * 1000:.3f}")
    if note:
        text += f" ({escape(note)})"
    if error:
        text += f": {escape(error)}"
    return text


class TextFormatter(logging.Formatter):
    """The normal log in text: the message escaped; a traceback keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)


class _Text:
    """Formats an audit entry as ``key=value`` only if a text handler asks."""

    __slots__ = ("entry",)

    def __init__(self, entry: dict[str, Any]) -> None:
        self.entry = entry

    def __str__(self) -> str:
        return _text(self.entry)


def _iso(created: float) -> str:
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")


def _json_encoder() -> Callable[[Any], str]:
    """``json.dumps(obj, default=str)``, without building an encoder per call."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # no C accelerator (not CPython)
        return json.JSONEncoder(default=str).encode
    enc = make(None, str, json.encoder.encode_basestring_ascii, None, ": ", ", ",
               False, False, True)
    return lambda obj: "".join(enc(obj, 0))


_dumps = _json_encoder()


class _Clock:
    """The timestamps of audit lines, formatted once per second."""

    __slots__ = ("_asc", "_asc_sec", "_iso", "_iso_sec")

    def __init__(self) -> None:
        self._iso_sec = self._asc_sec = -1
        self._iso = self._asc = ""

    def iso(self, now: float) -> str:
        """As ``_iso``: UTC, milliseconds (microseconds rounded as datetime does)."""
        sec, us = divmod(round(now * 1e6), 1_000_000)
        if sec != self._iso_sec:
            self._iso_sec = sec
            self._iso = datetime.fromtimestamp(sec, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        return f"{self._iso}.{us // 1000:03d}+00:00"

    def asctime(self, now: float) -> str:
        """As ``logging.Formatter``'s ``%(asctime)s``: local time, ``,msecs``."""
        sec = int(now)
        if sec != self._asc_sec:
            self._asc_sec = sec
            self._asc = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(sec))
        return f"{self._asc},{int((now - sec) * 1000):03d}"


class _AuditSink:
    """Formats audit records into lines and writes them once per loop turn. ``kind``:
    ``"file"`` (audit fields only, reopened when moved), ``"json"`` or ``"text"``."""

    def __init__(self, kind: str, stream: IO[str] | None = None, path: str | None = None,
                 lock: Any = None) -> None:
        self.kind = kind
        self.path = path
        self.stream = stream
        self._dev_ino = (-1, -1)
        self._own = False
        if path is not None:
            self._open()
        self._lines: list[str] = []  # appended to in place; only flush() takes from it
        self._due: AbstractEventLoop | None = None  # the loop a flush is scheduled on
        # One flush at a time; on a shared stream, the lock of the handler that
        # writes the normal log there (an RLock: its emit flushes us first).
        self._lock = lock if lock is not None else threading.RLock()
        self._clock = _Clock()
        self._line = {"file": self._file_line, "json": self._json_line,
                      "text": self._text_line}[kind]

    # -- lines ---------------------------------------------------------------------

    def _file_line(self, entry: dict[str, Any], now: float) -> str:
        return _dumps({"time": self._clock.iso(now), **entry})

    def _json_line(self, entry: dict[str, Any], now: float) -> str:
        return _dumps({"time": self._clock.iso(now), "level": "INFO",
                       "logger": AUDIT.name, **entry})

    def _text_line(self, entry: dict[str, Any], now: float) -> str:
        return f"{self._clock.asctime(now)} INFO {AUDIT.name} {_text(entry)}"

    def add(self, entry: dict[str, Any]) -> None:
        try:
            line = self._line(entry, time.time())
        except Exception as exc:  # a bug in a record must not break the op
            sys.stderr.write(f"rpcbufd: cannot format an audit record: {exc!r}\n")
            return
        self._lines.append(line)
        try:
            loop = get_running_loop()
        except RuntimeError:  # no loop (a session closed after it stopped): write now
            self.flush()
            return
        if loop is self._due:
            return  # a flush is due at the end of this loop turn already
        try:
            loop.call_soon(self._flush_due)
        except RuntimeError:  # the loop is closing
            self.flush()
            return
        self._due = loop

    # -- writing -------------------------------------------------------------------

    def _flush_due(self) -> None:
        self._due = None
        self.flush()

    def flush(self) -> None:
        lines = self._lines
        if not lines:
            return
        with self._lock:
            n = len(lines)
            if not n:
                return
            text = "\n".join(lines[:n]) + "\n"
            del lines[:n]  # only what was joined: a line added meanwhile stays
            try:
                if self.path is not None:
                    self._reopen_if_moved()
                stream = self.stream
                if stream is not None:
                    stream.write(text)
                    stream.flush()
            except (OSError, ValueError) as exc:  # as logging's handleError: say so, go on
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.write(f"rpcbufd: cannot write the audit trail: {exc}\n")

    def _open(self) -> None:
        assert self.path is not None
        self.stream = open(self.path, "a", encoding="utf-8")
        self._own = True
        st = os.fstat(self.stream.fileno())
        self._dev_ino = (st.st_dev, st.st_ino)

    def _reopen_if_moved(self) -> None:
        assert self.path is not None
        try:
            st = os.stat(self.path)
            same = (st.st_dev, st.st_ino) == self._dev_ino
        except FileNotFoundError:
            same = False
        if not same:
            if self.stream is not None:
                with contextlib.suppress(OSError, ValueError):
                    self.stream.close()
                self.stream = None
            self._open()

    def close(self) -> None:
        self.flush()
        if self._own and self.stream is not None:
            with contextlib.suppress(OSError, ValueError):
                self.stream.close()
            self.stream = None


_SINK: _AuditSink | None = None


def flush() -> None:
    """Write the audit lines still waiting for the end of the loop turn."""
    if _SINK is not None:
        _SINK.flush()


atexit.register(flush)


class _StreamHandler(logging.StreamHandler):
    """The normal log's handler: waiting audit lines go first (order kept)."""

    def emit(self, record: logging.LogRecord) -> None:
        flush()
        super().emit(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; ``meta`` adds level and logger (the normal log)."""

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
    """Configure the root logger (stderr) and the audit trail. OSError: no audit file."""
    global _SINK
    handler = _StreamHandler(sys.stderr)
    sink = _AuditSink("file", path=audit_log) if audit_log else \
        _AuditSink("json" if fmt == "json" else "text", stream=sys.stderr, lock=handler.lock)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(TEXT_FORMAT))
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
    AUDIT.propagate = not audit_log
    old, _SINK = _SINK, sink
    if old is not None:
        old.close()


def set_level(level: str) -> None:
    logging.getLogger().setLevel(level)
