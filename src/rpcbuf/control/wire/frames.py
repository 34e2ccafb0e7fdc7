"""Frames of the control channel, with no I/O: a 4-byte big-endian length, then
that many bytes of msgpack.

``FrameDecoder.feed`` gives the same messages whether bytes come whole or one at
a time.  An oversized frame or one that is not a msgpack map raises
``FrameError``: the stream is untrusted after that, so the caller closes it.

A frame's size does not bound decoding (msgpack's 1-byte empty map costs Python
~70: 16 MiB of them built 1.1 GiB).  So a frame over ``SCAN_FROM`` bytes is first
walked by its headers alone (``_census``) and refused past ``MAX_OBJECTS`` or
``MAX_DEPTH``; no container holds more than ``MAX_CONTAINER`` items; ext types
are refused.  A smaller frame builds at most ~70x its bytes.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from rpcbuf.control.wire.errors import BadRequest

DEFAULT_MAX_FRAME = 16 << 20  # room for a 100,000-tensor manifest
# The limit until hello succeeds: a hello (token, probe, nonce) is well under
# it, and a stranger gets no more of our memory than this.
HELLO_MAX_FRAME = 4 << 10
_HEADER = struct.Struct("!I")
# Lists and packed arrays on the wire hold at most 100,000 items
# (fields.MAX_ITEMS); a map holds a message's fields.  Slack for the encoder's
# own wrapping.
MAX_CONTAINER = 100_000 + 16
# Objects of one frame, scalars included: a 100,000-tensor batch with a
# distinct 4-dimension shape each holds 700,000; a frame at the bound decodes
# into at most about 70 MiB.
MAX_OBJECTS = 1_000_000
MAX_DEPTH = 32  # a message nests 4 deep; msgpack's own stack allows 1024
SCAN_FROM = 64 << 10  # smaller frames build at most ~4.5 MiB: not walked

class FrameError(BadRequest):
    """The byte stream is broken (oversized, truncated or not msgpack)."""


def encode_frame(message: dict[str, Any], max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > max_frame:
        raise FrameError(f"frame of {len(body)} bytes exceeds the limit of {max_frame}")
    return _HEADER.pack(len(body)) + body


class FrameDecoder:
    """Bytes in, messages out.  When the stream breaks, ``feed`` still returns
    the whole messages before the break and keeps ``error``, raised by any later
    ``feed``.  ``max_frame`` may change between feeds; ``feed(data, most=1)`` parses
    one message, leaving the rest for a later ``feed(b"")``."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, why: str = "") -> None:
        self.max_frame = max_frame
        self.why = why  # appended to the oversize error: which limit this is
        self.error: FrameError | None = None
        self._buf = bytearray()

    def feed(self, data: bytes, most: int | None = None) -> list[Any]:
        if self.error is not None:
            raise self.error
        self._buf += data
        out: list[Any] = []
        try:
            while len(self._buf) >= _HEADER.size and (most is None or len(out) < most):
                msg = self._next()
                if msg is None:
                    break
                out.append(msg)
        except FrameError as exc:
            self.error = exc
            self._buf.clear()
            if not out:
                raise
        return out

    def _next(self) -> Any:
        (length,) = _HEADER.unpack_from(self._buf)
        if length > self.max_frame:
            raise FrameError(
                f"frame of {length} bytes exceeds the limit of {self.max_frame}{self.why}",
                {"max_frame": self.max_frame, "length": length},
            )
        end = _HEADER.size + length
        if len(self._buf) < end:
            return None
        body = bytes(self._buf[_HEADER.size : end])
        del self._buf[:end]
        try:
            msg = _unpack(body)
        except _TooMany as exc:
            raise FrameError(f"frame holds {exc}", {"max_objects": MAX_OBJECTS,
                                                    "max_depth": MAX_DEPTH}) from None
        except Exception as exc:  # msgpack raises several unrelated types
            raise FrameError(f"frame is not valid msgpack: {exc}") from exc
        if not isinstance(msg, dict):
            raise FrameError("frame is not a msgpack map")
        return msg

    @property
    def pending(self) -> int:
        return len(self._buf)


class _TooMany(Exception):
    """A frame past ``MAX_OBJECTS`` or ``MAX_DEPTH``; its text says which."""


_ARRAYS = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])
_MAPS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"ext type {code} is not part of the protocol")


def _census(body: bytes) -> None:
    """Walk ``body``'s headers, building nothing: ``_TooMany`` past the object
    or depth bound; msgpack's errors for malformed bytes and oversized containers."""
    up = msgpack.Unpacker(max_buffer_size=len(body), max_array_len=MAX_CONTAINER,
                          max_map_len=MAX_CONTAINER)
    up.feed(body)
    left = MAX_OBJECTS
    open_ = [1]  # objects still to come in each open container, the frame itself outermost
    while open_:
        if not open_[-1]:
            open_.pop()
            continue
        open_[-1] -= 1
        left -= 1
        if left < 0:
            raise _TooMany(f"more than {MAX_OBJECTS} objects")
        first = body[up.tell()]
        if first in _ARRAYS:
            n = up.read_array_header()
        elif first in _MAPS:
            n = 2 * up.read_map_header()
        else:
            up.skip()
            continue
        if n:
            if len(open_) > MAX_DEPTH:
                raise _TooMany(f"arrays or maps nested more than {MAX_DEPTH} deep")
            open_.append(n)


def _unpack(body: bytes) -> Any:
    """``body`` decoded within the bounds above."""
    if len(body) > SCAN_FROM:
        _census(body)
    return msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=len(body),
                           max_str_len=len(body), max_array_len=MAX_CONTAINER,
                           max_map_len=MAX_CONTAINER, ext_hook=_no_ext)
