"""The daemon's answers as frozen dataclasses, parsed and checked once, at the edge.

The daemon is not trusted blindly (see ``hello.py``): an answer the client
acts on (a buffer's size, its device, the devices' free bytes) is read
field by field here by one function per answer, and the rest of the client
reads attributes, never keys.  A malformed answer is BAD_REQUEST naming the
field (``details["field"]``, ``details["reason"] == "bad_answer"`` or
``"bad_hello"``).  The public API still returns the wire dicts it always
returned (``get_buffer_meta`` a dict, ``list_devices`` a list of dicts):
they are checked by these parsers first, then handed out as they came.

Sans-I/O: plain functions over decoded msgpack, testable on their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rpcbuf.control.wire.errors import BadRequest

CHECKSUM_KINDS = ("xxh3", "devsum")
DEVICE_TYPES = ("CPU", "GPU")
_MAX_INT = (1 << 63) - 1


def bad_answer(answer: str, field: str, why: str) -> BadRequest:
    reason = "bad_hello" if answer == "hello" else "bad_answer"
    return BadRequest(f"the daemon's {answer} is malformed: {field} {why}",
                      {"field": field, "reason": reason})


def _int(msg: dict[str, Any], key: str, answer: str, lo: int = 0) -> int:
    value = msg.get(key)
    if type(value) is not int or not lo <= value <= _MAX_INT:  # bool is not an int here
        raise bad_answer(answer, key, f"must be an integer >= {lo}, got {value!r:.80}")
    return value


def _str(msg: dict[str, Any], key: str, answer: str, optional: bool = False) -> str | None:
    value = msg.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise bad_answer(answer, key, f"must be a string, got {value!r:.80}")
    return value


def _device_type(msg: dict[str, Any], answer: str) -> str:
    value = msg.get("device_type")
    if not isinstance(value, str) or value.upper() not in DEVICE_TYPES:
        raise bad_answer(answer, "device_type", f"must be one of {list(DEVICE_TYPES)}, "
                                                f"got {value!r:.40}")
    return value.upper()


@dataclass(frozen=True, slots=True)
class Device:
    """One device of the node (``list_devices``, ``hello["devices"]``)."""

    key: str  # "cpu:0", "cuda:1"
    device_type: str  # "CPU" or "GPU"
    device: int
    total: int
    free: int
    largest_free: int


def parse_device(msg: Any, answer: str = "list_devices") -> Device:
    """Raises BAD_REQUEST naming the field (``devices.<key>``)."""
    if not isinstance(msg, dict):
        raise bad_answer(answer, "devices", f"must hold maps, got {type(msg).__name__}")
    try:
        key = _str(msg, "key", answer)
        assert key is not None
        return Device(key, _device_type(msg, answer), _int(msg, "device", answer),
                      _int(msg, "total", answer), _int(msg, "free", answer),
                      _int(msg, "largest_free", answer))
    except BadRequest as exc:
        field = f"devices.{exc.details['field']}"
        raise bad_answer(answer, field, exc.message.split(f" {exc.details['field']} ", 1)[-1]
                         ) from None


def parse_devices(msgs: Any, answer: str = "list_devices") -> tuple[Device, ...]:
    if not isinstance(msgs, list):
        raise bad_answer(answer, "devices", "must be a list")
    return tuple(parse_device(m, answer) for m in msgs)


@dataclass(frozen=True, slots=True)
class BufferMeta:
    """A buffer's metadata (``request_buffer``, ``get_buffer_meta``,
    ``open_buffer``); ``tensors``, the manifest's entries, stay on the dict."""

    buffer_id: str
    size: int
    device_type: str
    device: int
    manifest_version: int | None  # None: the answer did not say (an older daemon)
    tensors_end: int | None

    @property
    def gpu(self) -> bool:
        return self.device_type == "GPU"


def parse_meta(msg: dict[str, Any], answer: str = "buffer meta") -> BufferMeta:
    """Raises BAD_REQUEST naming a malformed field."""
    buffer_id = _str(msg, "buffer_id", answer)
    assert buffer_id is not None
    # request_buffer's answer of an older daemon may leave the device out: CPU.
    device_type = _device_type(msg, answer) if "device_type" in msg else "CPU"
    device = _int(msg, "device", answer) if "device" in msg else 0
    size = _int(msg, "size", answer) if "size" in msg else 0
    version = _int(msg, "manifest_version", answer) if "manifest_version" in msg else None
    end = _int(msg, "tensors_end", answer) if "tensors_end" in msg else None
    tensors = msg.get("tensors")
    if tensors is not None and not isinstance(tensors, dict):
        raise bad_answer(answer, "tensors", "must be a map of entries")
    return BufferMeta(buffer_id, size, device_type, device, version, end)


@dataclass(frozen=True, slots=True)
class Stats:
    """What ``stats`` says of this tenant (the dict has more: see the daemon)."""

    node_id: str
    sessions: int
    buffers: int
    bytes_stored: int
    bytes_read: int
    verify_failures: int


def parse_stats(msg: dict[str, Any]) -> Stats:
    """Each field the daemon sent must have its type; one it left out
    (an older daemon) reads as 0.  Raises BAD_REQUEST naming the field."""
    def count(key: str) -> int:
        return _int(msg, key, "stats") if key in msg else 0

    node_id = _str(msg, "node_id", "stats", optional=True) or ""
    return Stats(node_id, count("sessions"), count("buffers"), count("bytes_stored"),
                 count("bytes_read"), count("verify_failures"))
