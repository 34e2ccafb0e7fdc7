"""The daemon's allocators by name (``--allocator``): buddy (default), linear, slab."""

from __future__ import annotations

from rpcbuf.dataplane.allocator import Allocator, BuddyAllocator, LinearAllocator
from rpcbuf.dataplane.slab import SlabAllocator

ALLOCATORS: dict[str, type[Allocator]] = {
    "buddy": BuddyAllocator,
    "linear": LinearAllocator,
    "slab": SlabAllocator,
}


def make_allocator(name: str, size: int, min_block: int = 256) -> Allocator:
    """The allocator ``name`` over ``size`` bytes, blocks multiples of ``min_block``.
    ValueError for an unknown name."""
    try:
        cls = ALLOCATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown allocator {name!r}; available: {', '.join(sorted(ALLOCATORS))}"
        ) from None
    return cls(size, min_block)
