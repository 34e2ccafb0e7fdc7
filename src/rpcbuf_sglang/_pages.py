"""Flat uint8 views of SGLang's host KV pool and of the tensors its generic calls
hand over, to read into and write from in place.  SGLang names a page's memory
by raw address: an address is never dereferenced as such; it must lie, with its
size, inside one of the pool's own tensors, and the view is a slice of that
tensor.  Anything else is a ValueError (a miss), never a write elsewhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rpcbuf.dataplane.devsum import memory_kind

PAGE_LAYOUTS = ("page_first", "page_first_direct", "page_head")  # one span per K/V per page


def tensor_bytes(t: Any) -> np.ndarray | None:
    """A flat writable uint8 view of a contiguous CPU tensor or array; None for
    anything else (reading into a copy would lose the bytes)."""
    if isinstance(t, np.ndarray):
        if not t.flags.c_contiguous or not t.flags.writeable:
            return None
        return t.reshape(-1).view(np.uint8)
    import torch

    if not isinstance(t, torch.Tensor) or memory_kind(t) != "host" or not t.is_contiguous():
        return None
    out: np.ndarray = t.detach().reshape(-1).view(torch.uint8).numpy()
    return out


def split(view: np.ndarray, parts: int) -> list[np.ndarray] | None:
    """``view`` in ``parts`` equal spans (a flat page's K and V halves)."""
    n = len(view)
    if n == 0 or n % parts:
        return None
    step = n // parts
    return [view[i * step:(i + 1) * step] for i in range(parts)]


class PoolViews:
    """The host pool's tensors as byte spans, and its pages as views."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.layout = str(getattr(pool, "layout", ""))
        tensors = [getattr(pool, "kv_buffer", None)]
        more = getattr(pool, "get_hybrid_pool_buffer", None)
        if callable(more):
            tensors += list(more())
        self._spans: list[tuple[int, int, np.ndarray]] = []
        seen: set[int] = set()
        for t in tensors:
            if t is None:
                continue
            view = tensor_bytes(t)
            if view is None or view.ctypes.data in seen or len(view) == 0:
                continue
            seen.add(view.ctypes.data)
            self._spans.append((view.ctypes.data, len(view), view))
        if not self._spans:
            raise ValueError("rpcbuf_sglang: the host KV pool has no contiguous CPU tensor "
                             "to read pages into")

    def view(self, ptr: int, size: int) -> np.ndarray:
        """The ``size`` bytes at ``ptr``, a slice of one pool tensor."""
        for base, n, arr in self._spans:
            if base <= ptr and size > 0 and ptr + size <= base + n:
                return arr[ptr - base:ptr - base + size]
        raise ValueError(f"a span of {size} bytes at an address outside the host pool")

    def pages(self, host_indices: Any, n_pages: int, parts: int) -> list[list[np.ndarray]]:
        """Each page's ``parts`` spans for ``n_pages`` pages at ``host_indices``."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        if len(ptrs) != n_pages * parts or len(sizes) != len(ptrs):
            raise ValueError(f"the pool names {len(ptrs)} spans for {n_pages} pages of "
                             f"{parts} (layout {self.layout!r})")
        views = [self.view(int(p), int(s)) for p, s in zip(ptrs, sizes, strict=True)]
        return [views[i * parts:(i + 1) * parts] for i in range(n_pages)]

    def page_bytes(self) -> int:
        """The bytes of one page (K and V), for the bandwidth figures."""
        size = getattr(self.pool, "get_size_per_token", None)
        page = int(getattr(self.pool, "page_size", 0) or 0)
        return int(size()) * page if callable(size) else 0
