"""The wire-fp16 store: a float32 tensor sent as float16 and widened back by the
daemon.  ``nbytes`` is always the widened size, what the range checks see.
"""

from __future__ import annotations

from typing import Any

from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.dataplane.cuda_arena import is_device_arena

WIRE_DTYPES = {"float16": "float32"}  # wire dtype -> the only dtype it may widen into


def check_wire_f16(arena: Any, base: int, offset: int, nbytes: int) -> None:
    """Whole float32 values, float32-aligned on a GPU (a kernel writes them)."""
    if nbytes % 4:
        raise BadRequest(f"wire_dtype='float16': nbytes ({nbytes}) must be a whole number of "
                         "float32 values (a multiple of 4)", {"nbytes": nbytes})
    if is_device_arena(arena) and (base + offset) % 4:
        raise BadRequest(f"wire_dtype='float16': offset {offset} is not float32-aligned "
                         "in this GPU buffer", {"offset": offset})


def check_wire_dtype(wire_dtype: str | None, dtype: Any) -> None:
    """Client side: only float32 tensors travel as float16."""
    if wire_dtype is None:
        return
    if wire_dtype not in WIRE_DTYPES:
        raise BadRequest(f"wire_dtype must be None or 'float16', got {wire_dtype!r}")
    name = str(dtype).removeprefix("torch.")
    if name != WIRE_DTYPES[wire_dtype]:
        raise BadRequest(f"wire_dtype={wire_dtype!r} needs a float32 tensor, got {name}")
