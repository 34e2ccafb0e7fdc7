"""Frames of the control channel, with no I/O (sans-I/O, like h11).

A frame is a 4-byte big-endian length followed by that many bytes of msgpack.
``FrameDecoder.feed`` takes whatever bytes arrived and returns the complete
messages; feeding the same bytes whole or one at a time gives the same
messages.  A frame longer than the limit, or bytes that are not a msgpack map,
raise ``FrameError``: the stream cannot be trusted after that, so the caller
closes that one connection.  Until hello succeeds the daemon parses frames
one at a time under ``HELLO_MAX_FRAME``.

A frame's bytes do not bound what decoding it costs: msgpack spends one byte
on an empty map, which Python holds in about 70, so a 16 MiB frame of empty
maps made the decoder build 1.1 GiB and held the event loop for seconds.
Decoding is therefore bounded in objects, before anything is built: a frame
of more than ``SCAN_FROM`` bytes is first walked by its headers alone
(``_census``: arrays and maps are entered, every other object skipped in
C), counting every object, scalars too, and refused past ``MAX_OBJECTS``
or nested deeper than ``MAX_DEPTH``; no array or map holds more than
``MAX_CONTAINER`` items; ext types are refused.  A smaller frame cannot
build more than about 70 times its bytes.  A 100,000-tensor batch holds
300,000 to 700,000 objects; the walk costs about half of its decode.
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
    """Incremental frame parser: bytes in, messages out.

    When the stream breaks, ``feed`` still returns the whole messages that came
    before the break and keeps the error in ``error``; the caller handles
    those messages, then raises ``error``.  Any later ``feed`` raises it.

    ``max_frame`` may change between feeds (the daemon raises it once hello
    succeeded; ``why`` then names the limit in the error); ``feed(data,
    most=1)`` parses only the next message, leaving the rest buffered for a
    later ``feed(b"")`` under whatever limit holds then."""

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
        """Bytes received that do not yet form a whole frame."""
        return len(self._buf)


class _TooMany(Exception):
    """A frame past ``MAX_OBJECTS`` or ``MAX_DEPTH``; its text says which."""


_ARRAYS = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])
_MAPS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"ext type {code} is not part of the protocol")


def _census(body: bytes) -> None:
    """Walk ``body``'s headers without building anything: ``_TooMany`` past
    ``MAX_OBJECTS`` objects or ``MAX_DEPTH`` levels; msgpack's own errors for
    malformed bytes and containers past ``MAX_CONTAINER``."""
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
