"""Operations on arena ranges of either kind (NumPy host arenas, CuPy device
arenas): checksums, scratch buffers, fills and the float16 -> float32
widening of wire-fp16 stores.
"""

from __future__ import annotations

from typing import Any, Literal

from rpcbuf.dataplane.checksum import xxh3

from .cuda_arena import active, array_module, is_device_arena
from .devsum import devsum

ChecksumKind = Literal["xxh3", "devsum"]
CHECKSUM_KINDS: tuple[str, ...] = ("xxh3", "devsum")


def range_checksum(arena: Any, offset: int, nbytes: int, kind: str) -> int:
    """``kind`` checksum of ``arena[offset:offset+nbytes]``."""
    if kind == "devsum":
        with active(arena):
            return devsum(arena.view(offset, nbytes))
    if is_device_arena(arena):  # xxh3 of device memory: through the host (slow)
        with active(arena):
            host = arena.xp.asnumpy(arena.view(offset, nbytes))
        return xxh3(host.data)
    return int(arena.checksum(offset, nbytes))  # xxh3, the host arena's own


def scratch(arena: Any, nbytes: int) -> Any:
    """A uint8 receive buffer of ``nbytes`` in the arena's kind of memory."""
    xp = array_module(arena)
    with active(arena):
        return xp.empty(nbytes, dtype=xp.uint8)


def widen_f16(arena: Any, offset: int, src: Any) -> None:
    """Write ``src``'s float16 values (uint8 bytes) as float32 at ``offset``."""
    xp = array_module(arena)
    n = int(src.nbytes)
    with active(arena):
        dst = arena.view(offset, 2 * n).view(xp.float32)
        xp.copyto(dst, src.view(xp.float16))
        if is_device_arena(arena):
            arena.synchronize()


def fill(arena: Any, view: Any, value: int) -> None:
    """``view.fill(value)`` on the arena's device, from any thread."""
    with active(arena):
        view.fill(value)
        if is_device_arena(arena):
            arena.synchronize()
