"""The model file a client uploads, its header checked before anything
parses it: the walks are ``control/wire/modelcheck.py`` (shared with the
daemon, which checks the files of its ``--model-dir``); this module opens
the file and turns what is wrong into one ``BadRequest`` naming it."""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from control.wire.errors import BadRequest
from control.wire.modelcheck import (
    Malformed,
    gguf_ranges,
    safetensors_length,
    safetensors_parse,
)


def check_gguf(path: Path) -> None:
    """Walk a GGUF file's whole header against its size.  Raises BAD_REQUEST
    naming the file and the first thing wrong with it."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            gguf_ranges(data)
    except (Malformed, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise BadRequest(f"{path}: not a valid GGUF file: {exc}", {"file": str(path)}) from None


def safetensors_header(path: Path, itemsizes: Mapping[str, int]
                       ) -> tuple[int, dict[str, Any]]:
    """``(where the data starts, the header)`` of a safetensors file, every
    entry checked against the file (``wire.modelcheck.safetensors_parse``).
    Raises BAD_REQUEST naming the file and what is wrong."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = safetensors_length(f.read(8), size)
            raw = f.read(n)
        if len(raw) != n:
            raise Malformed("the file shrank while it was read")
        return safetensors_parse(raw, size, itemsizes)
    except Malformed as exc:
        raise BadRequest(f"{path}: not a valid safetensors file: {exc}",
                         {"file": str(path)}) from None
