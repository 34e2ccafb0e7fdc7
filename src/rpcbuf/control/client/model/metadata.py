"""A loaded model's own metadata, stored with its tensors: encoded on load, decoded on read.

``load_model`` keeps the model file's metadata (``ModelFile.metadata``: the
GGUF key/values as plain Python, or the safetensors ``__metadata__``
strings) in rpcbuf's own terms, with no daemon state of its own: one uint8
tensor, ``META_TENSOR``, in the first slot buffer the model has on each node
(so every node that holds part of a model can describe it), right after
that slot's tensors.  It is charged to the tenant's quota, deduplicated,
checksummed and released like every other tensor.  Its bytes are msgpack of
``{"rpcbuf_model_metadata": 1, "format": "gguf" | "safetensors",
"metadata": {...}}``.

Both ends are bounded.  What a file may hold is bounded before it is read
(``modelcheck``: ``MAX_METADATA_KEYS`` keys, ``MAX_METADATA_ITEMS`` values,
``MAX_METADATA_BYTES`` of the file), and so is what ``encode`` makes
(``MAX_BLOB``: room for the worst widening of an accepted file, float32
arrays as msgpack doubles, 2.25x).  What a daemon hands back is untrusted
(``decode``): at most ``MAX_BLOB`` bytes, every container and string within
the file bounds as it is unpacked, then the shape walked without recursion
(a map of keys to ints, floats, bools, strings and lists of those, nested at
most ``GGUF_MAX_NESTING`` deep, ``MAX_METADATA_ITEMS`` values in all).  A
blob that fails is BAD_REQUEST (``reason: bad_answer``, ``field:
metadata``).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from rpcbuf.control.client.answers import bad_answer
from rpcbuf.control.client.model.modelcheck import (
    GGUF_MAX_NESTING,
    MAX_METADATA_BYTES,
    MAX_METADATA_ITEMS,
    MAX_METADATA_KEYS,
)
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.control.wire.manifest import META_TENSOR as META_TENSOR  # reserved there (re-exported)

FORMATS = ("gguf", "safetensors")
VERSION = 1
MAX_BLOB = 80 << 20  # >= 2.25 x MAX_METADATA_BYTES (float32 arrays widen to doubles) + room
_ANSWER = "model metadata"
_KEYS = {"rpcbuf_model_metadata", "format", "metadata"}


def encode(fmt: str, metadata: dict[str, Any]) -> np.ndarray:
    """The metadata blob of a model of format ``fmt``, as the uint8 tensor
    ``load_model`` stores.  Raises BAD_REQUEST past ``MAX_BLOB`` or for a
    value msgpack cannot hold (neither comes from a file ``modelcheck``
    accepted)."""
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
    """``(format, metadata)`` of a blob a daemon handed back.  Raises
    BAD_REQUEST (``reason: bad_answer``) for one that is too big, not
    msgpack, or not the shape ``encode`` makes (see the module docstring)."""
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
    """Every value an int, float, bool, string or list of those, lists nested
    at most ``GGUF_MAX_NESTING`` deep, at most ``MAX_METADATA_ITEMS`` values:
    walked with a stack, never recursively."""
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
