"""A loaded model's own metadata (GGUF key/values, safetensors ``__metadata__``)
as one uint8 tensor, ``META_TENSOR``, after the tensors of the model's first
slot on each node: msgpack of ``{"rpcbuf_model_metadata": 1, "format",
"metadata"}``, quota-charged, deduplicated and checksummed like any tensor.

Both ends are bounded: ``encode`` makes at most ``MAX_BLOB`` (the worst widening
of an accepted file), and ``decode`` trusts no daemon: at most ``MAX_BLOB``
bytes, containers bounded as unpacked, the shape walked without recursion.  A
bad blob is BAD_REQUEST (``reason: bad_answer``, ``field: metadata``).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from rpcbuf.control.client.answers import bad_answer
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.control.wire.manifest import META_TENSOR as META_TENSOR  # reserved there (re-exported)
from rpcbuf.models.modelcheck import (
    GGUF_MAX_NESTING,
    MAX_METADATA_BYTES,
    MAX_METADATA_ITEMS,
    MAX_METADATA_KEYS,
)

FORMATS = ("gguf", "safetensors")
VERSION = 1
MAX_BLOB = 80 << 20  # >= 2.25 x MAX_METADATA_BYTES (float32 arrays widen to doubles) + room
_ANSWER = "model metadata"
_KEYS = {"rpcbuf_model_metadata", "format", "metadata"}


def encode(fmt: str, metadata: dict[str, Any]) -> np.ndarray:
    """The blob as a uint8 tensor.  Raises BAD_REQUEST past ``MAX_BLOB`` or for
    a value msgpack cannot hold."""
    if fmt not in FORMATS:
        raise BadRequest(f"unknown model format {fmt!r}")
    try:
        raw = msgpack.packb({"rpcbuf_model_metadata": VERSION, "format": fmt,
                             "metadata": metadata}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadRequest(f"the model's metadata cannot be stored: {exc}") from None
    if len(raw) > MAX_BLOB:
        raise BadRequest(f"the model's metadata takes {len(raw)} bytes stored (at most "
                         f"{MAX_BLOB})", {"limit": MAX_BLOB})
    return np.frombuffer(raw, dtype=np.uint8)


def decode(data: bytes | np.ndarray) -> tuple[str, dict[str, Any]]:
    """``(format, metadata)``.  Raises BAD_REQUEST (``reason: bad_answer``)."""
    raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    if len(raw) > MAX_BLOB:
        raise bad_answer(_ANSWER, "metadata", f"is {len(raw)} bytes (at most {MAX_BLOB})")
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True,
                              max_str_len=MAX_METADATA_BYTES, max_bin_len=0, max_ext_len=0,
                              max_array_len=MAX_METADATA_ITEMS, max_map_len=MAX_METADATA_KEYS)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # msgpack's messages name positions and limits, never the bytes
        raise bad_answer(_ANSWER, "metadata", f"is not msgpack within bounds: {exc}"
                         ) from None
    if not isinstance(obj, dict) or set(obj) != _KEYS \
            or obj["rpcbuf_model_metadata"] != VERSION:
        raise bad_answer(_ANSWER, "metadata", f"is not rpcbuf's metadata, version {VERSION}")
    fmt, meta = obj["format"], obj["metadata"]
    if fmt not in FORMATS:
        raise bad_answer(_ANSWER, "metadata", f"names no known format (want one of "
                                              f"{list(FORMATS)})")
    if not isinstance(meta, dict):
        raise bad_answer(_ANSWER, "metadata", "holds no map of key/values")
    _check_values(meta)
    return fmt, meta


def _check_values(meta: dict[str, Any]) -> None:
    """Ints, floats, bools, strings or lists of those, nested at most
    ``GGUF_MAX_NESTING``, at most ``MAX_METADATA_ITEMS``: walked with a stack."""
    budget = MAX_METADATA_ITEMS - len(meta)
    stack: list[tuple[Any, int]] = [(v, 0) for v in meta.values()]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, list):
            if depth >= GGUF_MAX_NESTING:
                raise bad_answer(_ANSWER, "metadata", f"nests lists more than "
                                                      f"{GGUF_MAX_NESTING} deep")
            budget -= len(value)
            if budget < 0:
                raise bad_answer(_ANSWER, "metadata", f"holds more than {MAX_METADATA_ITEMS} "
                                                      "values")
            stack.extend((v, depth + 1) for v in value)
        elif not isinstance(value, (bool, int, float, str)):
            raise bad_answer(_ANSWER, "metadata", f"holds a value of type "
                                                  f"{type(value).__name__}")
