"""The model file a client uploads, its header checked (the shared walks of
``wire.modelcheck``) before anything parses it; what is wrong is one
``BadRequest`` naming the file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rpcbuf.control.formats.modelheaders import (
    GGUF_MAX_NESTING,
    MAX_METADATA_BYTES,
    MAX_METADATA_ITEMS,
    MAX_METADATA_KEYS,
    MAX_NAME,
    Malformed,
    gguf_walk,
    safetensors_length,
    safetensors_parse,
)
from rpcbuf.control.wire.errors import BadRequest

__all__ = ["GGUF_MAX_NESTING", "MAX_METADATA_BYTES", "MAX_METADATA_ITEMS", "MAX_METADATA_KEYS",
           "MAX_NAME", "check_gguf", "metadata_of_safetensors", "safetensors_header"]


def check_gguf(path: Path) -> dict[str, Any]:
    """The header's key/values.  Raises BAD_REQUEST naming the file and the
    first thing wrong."""
    try:
        with open(path, "rb") as f:
            fd = f.fileno()
            return gguf_walk(lambda offset, n: os.pread(fd, n, offset), os.fstat(fd).st_size)[1]
    except Malformed as exc:
        raise BadRequest(f"{path}: not a valid GGUF file: {exc.detail}",
                         {"file": str(path)}) from None


def metadata_of_safetensors(path: Path, header: Mapping[str, Any]) -> dict[str, str]:
    """``__metadata__`` within ``MAX_METADATA_KEYS`` and ``MAX_METADATA_BYTES``.
    Raises BAD_REQUEST naming the file."""
    meta = header.get("__metadata__") or {}
    size = sum(len(k) + len(v) for k, v in meta.items())  # characters: at most the bytes
    if len(meta) > MAX_METADATA_KEYS or size > MAX_METADATA_BYTES:
        raise BadRequest(f"{path}: its __metadata__ has {len(meta)} keys and {size} characters "
                         f"(rpcbuf reads at most {MAX_METADATA_KEYS} keys and "
                         f"{MAX_METADATA_BYTES} characters)", {"file": str(path)})
    return dict(meta)


def safetensors_header(path: Path, itemsizes: Mapping[str, int]
                       ) -> tuple[int, dict[str, Any]]:
    """``(data start, header)``, every entry checked against the file.
    Raises BAD_REQUEST naming the file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = safetensors_length(f.read(8), size)
            raw = f.read(n)
        if len(raw) != n:
            raise Malformed("the file shrank while it was read")
        return safetensors_parse(raw, size, itemsizes)
    except Malformed as exc:
        raise BadRequest(f"{path}: not a valid safetensors file: {exc.detail}",
                         {"file": str(path)}) from None
