"""The daemon's answers as frozen dataclasses, parsed and checked once, at the edge.

An answer the client acts on is read field by field here, one function per
answer; the rest of the client reads attributes, never keys.  A malformed
answer is BAD_REQUEST naming the field (``reason: bad_answer``).  The
public API still returns the wire dicts, checked first.  Sans-I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rpcbuf.control.wire import protocol as P
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
    """Raises BAD_REQUEST naming the field."""
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
    """A buffer's metadata; the manifest's entries stay on the dict."""

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


def parse_buffers(msg: dict[str, Any]) -> list[dict[str, Any]]:
    """``list_buffers``'s answer, each checked as ``parse_meta``.  Raises
    BAD_REQUEST."""
    buffers = msg.get("buffers")
    if not isinstance(buffers, list) or not all(isinstance(b, dict) for b in buffers):
        raise bad_answer("list_buffers answer", "buffers", "must be a list of maps")
    for b in buffers:
        parse_meta(b, "list_buffers answer")
    return buffers


def parse_expiry(msg: dict[str, Any], answer: str) -> float | None:
    """An ``expires_at``: a finite unix time, or None (no lease)."""
    if "expires_at" not in msg:
        raise bad_answer(answer, "expires_at", "is missing")
    value = msg["expires_at"]
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value):
        raise bad_answer(answer, "expires_at", f"must be a number or nil, got {value!r:.40}")
    return float(value)


@dataclass(frozen=True, slots=True)
class TenantStats:
    """What ``stats`` says of this tenant."""

    node_id: str
    sessions: int
    buffers: int
    bytes_stored: int
    bytes_read: int
    verify_failures: int


def parse_stats(msg: dict[str, Any]) -> TenantStats:
    """A field left out reads as 0.  Raises BAD_REQUEST naming the field."""
    def count(key: str) -> int:
        return _int(msg, key, "stats") if key in msg else 0

    node_id = _str(msg, "node_id", "stats", optional=True) or ""
    return TenantStats(node_id, count("sessions"), count("buffers"), count("bytes_stored"),
                       count("bytes_read"), count("verify_failures"))


# -- the block tier's answers (``blockops.py``) -----------------------------------------

MAX_BLOCK_NBYTES = 1 << 30  # the largest block ``get_block`` allocates on the daemon's word


@dataclass(frozen=True, slots=True)
class BlockInfo:
    nbytes: int
    meta: bytes | None
    expires_at: float | None


def _per_key(msg: dict[str, Any], key: str, n: int, answer: str) -> list[Any]:
    """``msg[key]``: one item per key asked (absent or None: None each)."""
    value = msg.get(key)
    if value is None:
        return [None] * n
    if not isinstance(value, list) or len(value) != n:
        raise bad_answer(answer, key, f"must be a list of {n} items, one per key")
    return value


def parse_block_lookup(msg: dict[str, Any], n: int) -> list[BlockInfo | None]:
    """Per key None (a miss) or its size (>= 1), meta and expiry.  Raises
    BAD_REQUEST."""
    answer = "block_lookup answer"
    if not isinstance(msg.get("sizes"), list):
        raise bad_answer(answer, "sizes", "must be a list")
    sizes = _per_key(msg, "sizes", n, answer)
    metas = _per_key(msg, "metas", n, answer)
    expires = _per_key(msg, "expires_at", n, answer)
    out: list[BlockInfo | None] = []
    for size, meta, exp in zip(sizes, metas, expires, strict=True):
        if size is None:
            out.append(None)
            continue
        if type(size) is not int or not 1 <= size <= _MAX_INT:
            raise bad_answer(answer, "sizes", f"must hold integers >= 1, got {size!r:.40}")
        if meta is not None and not isinstance(meta, bytes):
            raise bad_answer(answer, "metas", f"must hold bytes, got {type(meta).__name__}")
        if exp is not None and (type(exp) not in (int, float) or not math.isfinite(exp)):
            raise bad_answer(answer, "expires_at", f"must hold numbers, got {exp!r:.40}")
        out.append(BlockInfo(size, meta, None if exp is None else float(exp)))
    return out


def parse_block_list(msg: dict[str, Any], limit: int, prefix: str | None,
                     start_after: str | None) -> tuple[list[str], bool]:
    """At most ``limit`` keys, strictly increasing, after ``start_after``,
    starting with ``prefix``: a daemon cannot make a pager go round for ever
    nor hand it more than asked.  Raises BAD_REQUEST."""
    answer = "block_list answer"
    keys, more = msg.get("keys"), msg.get("more")
    if type(more) is not bool:
        raise bad_answer(answer, "more", f"must be true or false, got {more!r:.40}")
    if not isinstance(keys, list) or len(keys) > limit:
        raise bad_answer(answer, "keys", f"must be a list of at most {limit} keys")
    if keys and not P.block_keys_ok(keys):
        raise bad_answer(answer, "keys", f"must be printable strings of 1 to "
                                         f"{P.MAX_BLOCK_KEY} characters")
    last = start_after
    for k in keys:
        if (last is not None and k <= last) or (prefix is not None and not k.startswith(prefix)):
            raise bad_answer(answer, "keys", "must be in increasing order, after start_after "
                                             "and starting with prefix")
        last = k
    if more and not keys:
        raise bad_answer(answer, "more", "says more keys follow a page with none")
    return keys, more


def parse_removed(msg: dict[str, Any], n: int) -> int:
    """``block_remove``'s count: 0 to ``n``."""
    removed = _int(msg, "removed", "block_remove answer")
    if removed > n:
        raise bad_answer("block_remove answer", "removed", f"must be at most {n}")
    return removed
