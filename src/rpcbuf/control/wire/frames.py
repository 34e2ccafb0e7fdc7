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
Decoding is therefore bounded in objects too: no array or map holds more
than ``MAX_CONTAINER`` items (checked from its header, before anything is
built), and the items of all containers together stay within
``MAX_ELEMENTS``, counted as each container completes, so at most one
container's worth is built past the budget before the frame is refused.
A 100,000-tensor batch holds 300,000 to 600,000.
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
# Items of every array and map of one frame together (a map's pair counts
# once): a 100,000-tensor batch with a distinct 4-dimension shape each holds
# 600,000; a frame at the bound decodes into at most about 64 MiB.
MAX_ELEMENTS = 1_000_000


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
        except _TooMany:
            raise FrameError(f"frame holds more than {MAX_ELEMENTS} items in all",
                             {"max_elements": MAX_ELEMENTS}) from None
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
    """Raised from a decode hook when a frame's items pass ``MAX_ELEMENTS``."""


def _unpack(body: bytes) -> Any:
    """``body`` decoded, refusing a container of more than ``MAX_CONTAINER``
    items (ValueError from msgpack, before it is built) and more than
    ``MAX_ELEMENTS`` items in all (``_TooMany``)."""
    left = MAX_ELEMENTS

    def count(obj: Any) -> Any:
        nonlocal left
        left -= len(obj)
        if left < 0:
            raise _TooMany
        return obj

    return msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=len(body),
                           max_str_len=len(body), max_array_len=MAX_CONTAINER,
                           max_map_len=MAX_CONTAINER, max_ext_len=0,
                           list_hook=count, object_hook=count)
