"""Named tensor layouts: which tensor lives at which offset of a buffer.

Models and plans, with no I/O.  Each tensor gets a 256-byte aligned slot;
the manifest (name -> dtype, shape, offset, nbytes, xxh3-64 of what the
daemon received) is stored with the bytes in one batch.  Big batches
(10,000 tensors) are columns, not objects: the manifest goes out packed
(distinct dtype/shape kinds plus a kind index per tensor), the cache is
NumPy columns (``ManifestTable``), layouts are planned with NumPy, and a
load reads a few spans and cuts them a kind at a time.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rpcbuf.control.client.arrays import host_array, refuse_device
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.control.wire.manifest import (
    ALIGN,
    ManifestTable,
    Packed,
    Source,
    align as _align,
    manifest_columns,
    np_dtype,
)
from rpcbuf.dataplane.checksum import xxh3

__all__ = ["ALIGN", "Items", "ManifestTable", "Packed", "calculate_buffer_size",
           "manifest_columns", "named_arrays", "plan_layout", "plan_offsets", "plan_spans"]


def _nbytes(spec: Any) -> int:
    if hasattr(spec, "nbytes"):
        return int(spec.nbytes)
    try:
        shape, dtype = spec
        return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    except (TypeError, ValueError):
        raise BadRequest(f"expected an array or a (shape, dtype) pair, got {spec!r}") from None


def calculate_buffer_size(tensors: Mapping[str, Any] | Iterable[Any],
                          headroom: float = 0.10, align: int = ALIGN) -> int:
    """Bytes a buffer needs for ``tensors`` (arrays or ``(shape, dtype)``
    specs) in slots aligned to ``align``, plus ``headroom`` (0.10 is 10%).
    Raises BAD_REQUEST."""
    if headroom < 0:
        raise BadRequest("headroom must be >= 0")
    specs = tensors.values() if isinstance(tensors, Mapping) else tensors
    total = sum(_align(_nbytes(s), align) for s in specs)
    return _align(int(total * (1.0 + headroom)), align)


def named_arrays(tensors: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Source]]:
    """``{name: array}`` as NumPy arrays, and the torch-bits source of each
    that has one.  BAD_REQUEST for a non-string name, an object array, or GPU
    memory (the checksum is computed here, on the host)."""
    names, arrays, bits = names_and_arrays(tensors)
    return dict(zip(names, arrays, strict=True)), bits


def names_and_arrays(tensors: Mapping[str, Any]
                     ) -> tuple[list[str], list[np.ndarray], dict[str, Source]]:
    """(names, arrays, sources) of ``tensors``, checked as ``named_arrays``."""
    names = list(tensors)
    values = list(tensors.values())
    bits: dict[str, Source] = {}
    if not all(map(isinstance, names, itertools.repeat(str))):
        bad = next(n for n in names if not isinstance(n, str))
        raise BadRequest(f"tensor names must be strings, got {bad!r}")
    if all(map(isinstance, values, itertools.repeat(np.ndarray))):
        arrays = values
    else:
        refuse_device(values, "store_tensors takes host arrays; store GPU tensors with "
                      "store_tensor", names)
        arrays = []
        for name, value in zip(names, values, strict=True):
            arr, source = host_array(value)
            arrays.append(arr)
            if source is not None:
                bits[name] = (source, arr.shape)
    if any(dt.hasobject for dt in set(map(_DTYPE, arrays))):
        bad = next(n for n, a in zip(names, arrays, strict=True) if a.dtype.hasobject)
        raise BadRequest(f"tensor {bad!r} holds Python objects")
    return names, arrays, bits


def with_bits(sources: Mapping[str, Source] | None, bits: Mapping[str, Source]
              ) -> Mapping[str, Source] | None:
    """The caller's ``sources``, and the torch bits' for the names it has none for."""
    if not bits:
        return sources
    return {**bits, **(sources or {})}


_DTYPE = operator.attrgetter("dtype")
XXH3: Callable[[Any], int] = xxh3  # of any C-contiguous buffer (rpcbuf.dataplane.checksum)
class Items(Sequence[tuple[int, Any]]):
    """``store_batch`` items as columns: ``(offsets[i], arrays[i])`` of
    ``sizes[i]`` bytes (no 10,000 tuples to take apart)."""

    def __init__(self, offsets: np.ndarray, arrays: list[np.ndarray], sizes: np.ndarray) -> None:
        self.offsets = offsets
        self.arrays = arrays
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.arrays)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(zip(self.offsets[i].tolist(), self.arrays[i], strict=True))
        return int(self.offsets[i]), self.arrays[i]


def _end_of(existing: Mapping[str, Mapping[str, Any]]) -> int:
    if isinstance(existing, ManifestTable):
        return existing.end
    return max((_align(e["offset"] + e["nbytes"]) for e in existing.values()), default=0)


def plan_offsets(names: Sequence[str], sizes: np.ndarray,
                 existing: Mapping[str, Mapping[str, Any]],
                 start: int | None = None, end: int | None = None) -> np.ndarray:
    n = len(names)
    sizes = np.asarray(sizes, dtype=np.int64)
    offsets = np.zeros(n, dtype=np.int64)
    keep = np.zeros(n, dtype=bool)
    if start is None and n and len(existing):
        if isinstance(existing, ManifestTable):
            rows = existing.rows(names)
            found = rows >= 0
            keep = found & (existing.nbytes[rows] == sizes)
            offsets[keep] = existing.offsets[rows[keep]]
        else:
            for i, (name, size) in enumerate(zip(names, sizes.tolist(), strict=True)):
                old = existing.get(name)
                if old is not None and old["nbytes"] == size:
                    keep[i] = True
                    offsets[i] = int(old["offset"])
    if end is None:
        end = _end_of(existing)
    cursor = _align(end if start is None else start)
    new = ~keep
    slots = (sizes[new] + (ALIGN - 1)) // ALIGN * ALIGN
    offsets[new] = cursor + np.cumsum(slots) - slots
    return offsets


def plan_layout(tensors: Mapping[str, Any], existing: Mapping[str, Mapping[str, Any]],
                start: int | None = None, end: int | None = None) -> dict[str, int]:
    """Offsets for ``tensors``: a name in the manifest with the same size
    keeps its slot; the others go after the highest slot in use (or from
    ``start``), aligned."""
    names = list(tensors)
    sizes = np.fromiter((int(a.nbytes) for a in tensors.values()), dtype=np.int64,
                        count=len(names))
    return dict(zip(names, plan_offsets(names, sizes, existing, start, end).tolist(),
                    strict=True))


# -- reading many ranges ---------------------------------------------------------------

SPAN_GAP = 4096  # ranges this close share one read (the bytes between come along)


def plan_spans(offsets: np.ndarray, sizes: np.ndarray, gap: int = SPAN_GAP
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, lengths, span of each item) of the spans covering sorted
    items: items less than ``gap`` apart share a span."""
    n = len(offsets)
    if not n:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z.astype(np.intp)
    reach = np.maximum.accumulate(offsets + sizes)
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    np.greater(offsets[1:], reach[:-1] + gap, out=brk[1:])
    first = np.flatnonzero(brk)
    last = np.append(first[1:], n) - 1
    starts = offsets[first]
    return starts, reach[last] - starts, np.cumsum(brk, dtype=np.intp) - 1


def offset_order(offsets: np.ndarray) -> np.ndarray | None:
    """The stable order that sorts ``offsets``; None when they already are."""
    if len(offsets) > 1 and (offsets[1:] < offsets[:-1]).any():
        return np.argsort(offsets, kind="stable")
    return None


def in_caller_order(items: list[Any], order: np.ndarray | None) -> list[Any]:
    if order is None:
        return items
    out: list[Any] = [None] * len(items)
    for j, i in enumerate(order.tolist()):
        out[i] = items[j]
    return out


def bulk_views(blocks: Sequence[np.ndarray], which: np.ndarray, rel: np.ndarray,
               kinds: np.ndarray, dtypes: Sequence[np.dtype[Any]],
               shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """Item ``i``: an array of ``kinds[i]`` over ``blocks[which[i]]`` from byte
    ``rel[i]``; a run of one kind at a constant stride is one strided array cut
    into rows (a tenth of the cost)."""
    n = len(rel)
    if not n:
        return []
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    brk[1:] = (which[1:] != which[:-1]) | (kinds[1:] != kinds[:-1])
    bounds = [*np.flatnonzero(brk).tolist(), n]
    out: list[np.ndarray] = []
    for a, b in itertools.pairwise(bounds):
        k = int(kinds[a])
        dt, shape, blk = dtypes[k], shapes[k], blocks[int(which[a])]
        if b - a > 1 and shape:
            steps = np.diff(rel[a:b])
            step = int(steps[0])
            if step > 0 and (steps == step).all():
                inner = [dt.itemsize * math.prod(shape[i + 1:]) for i in range(len(shape))]
                out.extend(np.ndarray((b - a, *shape), dt, buffer=blk, offset=int(rel[a]),
                                      strides=(step, *inner)))
                continue
        out.extend(np.ndarray(shape, dt, buffer=blk, offset=r) for r in rel[a:b].tolist())
    return out


class LazyDtypes(Sequence[np.dtype[Any]]):
    def __init__(self, names: list[str]) -> None:
        self._names = names

    def __getitem__(self, k: Any) -> Any:
        return np_dtype(self._names[k])

    def __len__(self) -> int:
        return len(self._names)
