"""The daemon's allocators by name (``--allocator``): buddy (the default),
linear and slab, all of the ``Allocator`` protocol (``allocator.py``).
"""

from __future__ import annotations

from rpcbuf.dataplane.allocator import Allocator, BuddyAllocator, LinearAllocator
from rpcbuf.dataplane.slab import SlabAllocator

ALLOCATORS: dict[str, type[Allocator]] = {
    "buddy": BuddyAllocator,
    "linear": LinearAllocator,
    "slab": SlabAllocator,
}


def make_allocator(name: str, size: int, min_block: int = 256) -> Allocator:
    """The allocator called ``name`` over ``size`` bytes, every block a
    multiple of ``min_block`` (a power of two). Raises ValueError for an
    unknown name."""
    try:
        cls = ALLOCATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown allocator {name!r}; available: {', '.join(sorted(ALLOCATORS))}"
        ) from None
    return cls(size, min_block)
