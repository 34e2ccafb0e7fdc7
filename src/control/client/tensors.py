"""Named tensor layouts: which tensor lives at which offset of a remote buffer.

The models and plans, with no I/O (``tensorops.py`` runs them over a
context's batch ops).  ``store_tensors`` gives each tensor an aligned slot
(256 bytes, GPU-friendly), stores them all in one batch (one control round
trip; touching small tensors travel as one UCX message) and has the daemon
record a manifest — name -> dtype, shape, offset, nbytes, checksum — that
``get_buffer_meta`` returns under ``tensors``.  ``load_tensors`` reads them
back, with their dtype and shape, in one batch; any process of the same
tenant can do so once it has the buffer id (``open_buffer(name)`` finds a
named buffer).

The checksum in the manifest is the daemon's xxh3-64 of the bytes it
received; ``load_tensors(verify=True)`` recomputes it on what arrived.

Big batches (10,000 small tensors) are handled as columns, not per tensor:
the manifest goes out packed (a table of distinct dtype/shape *kinds* plus one
kind index per tensor, see ``Packed``), the client caches manifests as NumPy
columns (``ManifestTable``, a read-only mapping whose entry dicts are built
on access), layouts are planned with NumPy, and ``load_tensors`` reads a few
contiguous spans and cuts them into arrays a kind at a time.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from control.wire import protocol as P
from control.wire.errors import BadRequest

ALIGN = 256


def _align(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def _nbytes(spec: Any) -> int:
    """Bytes of an array, or of a ``(shape, dtype)`` spec."""
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
    specs, as a mapping or a sequence) in aligned slots, plus ``headroom``."""
    if headroom < 0:
        raise BadRequest("headroom must be >= 0")
    specs = tensors.values() if isinstance(tensors, Mapping) else tensors
    total = sum(_align(_nbytes(s), align) for s in specs)
    return _align(int(total * (1.0 + headroom)), align)


def named_arrays(tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``{name: array}`` as NumPy arrays; BAD_REQUEST for a non-string name or
    an array of Python objects."""
    names, arrays = names_and_arrays(tensors)
    return dict(zip(names, arrays, strict=True))


def names_and_arrays(tensors: Mapping[str, Any]) -> tuple[list[str], list[np.ndarray]]:
    """(names, NumPy arrays) of ``tensors``, checked as ``named_arrays`` says."""
    names = list(tensors)
    values = list(tensors.values())
    if not all(map(isinstance, names, itertools.repeat(str))):
        bad = next(n for n in names if not isinstance(n, str))
        raise BadRequest(f"tensor names must be strings, got {bad!r}")
    arrays = values if all(map(isinstance, values, itertools.repeat(np.ndarray))) \
        else [np.asarray(v) for v in values]
    if any(dt.hasobject for dt in set(map(_DTYPE, arrays))):
        bad = next(n for n, a in zip(names, arrays, strict=True) if a.dtype.hasobject)
        raise BadRequest(f"tensor {bad!r} holds Python objects")
    return names, arrays


_DTYPE = operator.attrgetter("dtype")
XXH3: Callable[[Any], int] = xxhash.xxh3_64_intdigest  # of any C-contiguous buffer
_SHAPE = operator.attrgetter("shape")
_NDIM = operator.attrgetter("ndim")
_SIZE = operator.attrgetter("size")
Columns = tuple[list[str], list[str], list[list[int]]]


def manifest_columns(arrays: Mapping[str, Any], names: Iterable[str]) -> Columns:
    """(names, dtypes, shapes) of ``names``: the manifest a batch records."""
    names = list(names)
    return (names, [arrays[n].dtype.str for n in names],
            [list(arrays[n].shape) for n in names])


class Packed:
    """A batch's manifest, packed for the wire: item ``i`` is ``names[i]``,
    of dtype ``dtypes[kinds[i]]`` and shape ``shapes[kinds[i]]`` (the
    ``kinds``/``kind_dtypes``/``kind_shapes`` fields of ``StoreBatch``).
    ``kind_nbytes``: each kind's bytes (None when built from columns)."""

    __slots__ = ("dtypes", "kind_nbytes", "kinds", "names", "shapes")

    def __init__(self, names: list[str], kinds: np.ndarray, dtypes: list[str],
                 shapes: list[tuple[int, ...]], kind_nbytes: np.ndarray | None = None) -> None:
        self.names = names
        self.kinds = kinds
        self.dtypes = dtypes
        self.shapes = shapes
        self.kind_nbytes = kind_nbytes

    def __len__(self) -> int:
        return len(self.names)

    @classmethod
    def of_arrays(cls, names: list[str], arrays: Sequence[np.ndarray]) -> Packed:
        n = len(arrays)
        dtypes = list(map(_DTYPE, arrays))
        # Kinds are keyed by the dtype object's identity: equal dtypes that are
        # distinct objects just make two equal kinds (the arrays keep them alive).
        # 1-D arrays are told apart by size: no shape tuple per array.
        ids = list(map(id, dtypes))
        flat = list(map(_NDIM, arrays)).count(1) == n
        shapes: list[Any] = list(map(_SIZE, arrays)) if flat else list(map(_SHAPE, arrays))
        if n and ids.count(ids[0]) == n and shapes.count(shapes[0]) == n:  # one kind (C loops)
            kinds = np.zeros(n, dtype=np.intp)
            kind_dtypes, kind_shapes = dtypes[:1], shapes[:1]
        else:
            table, kinds = P.intern_kinds(list(zip(ids, shapes, strict=True)))
            by_id = dict(zip(ids, dtypes, strict=True))
            kind_dtypes = [by_id[i] for i, _ in table]
            kind_shapes = [s for _, s in table]
        if flat:
            kind_shapes = [(int(size),) for size in kind_shapes]
        return cls(names, kinds, [dt.str for dt in kind_dtypes], kind_shapes,
                   np.array([math.prod(s) * dt.itemsize
                             for dt, s in zip(kind_dtypes, kind_shapes, strict=True)],
                            dtype=np.int64))

    @classmethod
    def of_columns(cls, names: Sequence[str], dtypes: Sequence[Any],
                   shapes: Sequence[Sequence[int]]) -> Packed:
        """From the (names, dtypes, shapes) lists of ``manifest_columns``."""
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(f"names, dtypes and shapes must be equally long, got "
                             f"{len(names)}, {len(dtypes)} and {len(shapes)}")
        try:
            table, kinds = P.intern_kinds(list(zip(dtypes, map(tuple, shapes), strict=True)))
            kind_dtypes = [d if isinstance(d, str) else np.dtype(d).str for d, _ in table]
            kind_shapes = [tuple(map(operator.index, s)) for _, s in table]
        except TypeError as exc:
            raise BadRequest(f"bad manifest columns: {exc}") from None
        return cls(list(names), kinds, kind_dtypes, kind_shapes)

    def item_nbytes(self) -> np.ndarray:
        assert self.kind_nbytes is not None
        return self.kind_nbytes[self.kinds]

    def take(self, order: np.ndarray) -> Packed:
        """The items in ``order`` (indices)."""
        names = self.names
        return Packed([names[i] for i in order.tolist()], self.kinds[order], self.dtypes,
                      self.shapes, self.kind_nbytes)

    def fields(self) -> dict[str, Any]:
        """The ``StoreBatch`` fields (no ``kinds`` for a one-kind table)."""
        return {"names": self.names,
                "kinds": P.pack_u64(self.kinds) if len(self.dtypes) != 1 else None,
                "kind_dtypes": self.dtypes, "kind_shapes": [list(s) for s in self.shapes]}


class Items(Sequence[tuple[int, Any]]):
    """``store_batch`` items as columns: ``(offsets[i], arrays[i])``, each of
    ``sizes[i]`` bytes (``store_tensors`` has them so; ``store_batch`` then
    skips taking 10,000 tuples apart)."""

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


class ManifestTable(Mapping[str, dict[str, Any]]):
    """A buffer's manifest as NumPy columns: what the client caches and what
    ``store_tensors`` returns.  Read as a mapping name -> entry (``dtype``,
    ``shape``, ``offset``, ``nbytes``, ``checksum``); each entry dict is built
    when asked for.  Never modified: ``merged`` makes a new one."""

    def __init__(self, names: list[str], offsets: np.ndarray, nbytes: np.ndarray,
                 checksums: np.ndarray, has_sum: np.ndarray, kinds: np.ndarray,
                 dtypes: list[str], shapes: list[tuple[int, ...]]) -> None:
        self.names = names
        self.offsets = offsets  # int64
        self.nbytes = nbytes  # int64
        self.checksums = checksums  # uint64, valid where has_sum
        self.has_sum = has_sum  # bool
        self.kinds = kinds  # intp: index into dtypes/shapes
        self.dtypes = dtypes
        self.shapes = shapes
        self._index: dict[str, int] | None = None  # name -> row, made when first needed

    @property
    def _rows(self) -> dict[str, int]:
        if self._index is None:
            self._index = dict(zip(self.names, range(len(self.names)), strict=True))
        return self._index

    @classmethod
    def empty(cls) -> ManifestTable:
        z = np.zeros(0, dtype=np.int64)
        return cls([], z, z, z.astype(np.uint64), z.astype(bool), z.astype(np.intp), [], [])

    @classmethod
    def of_batch(cls, packed: Packed, offsets: np.ndarray, sizes: np.ndarray,
                 checksums: np.ndarray) -> ManifestTable:
        n = len(packed)
        sums = checksums if len(checksums) == n else np.zeros(n, dtype=np.uint64)
        return cls(packed.names, offsets.astype(np.int64), sizes.astype(np.int64),
                   sums.astype(np.uint64), np.full(n, len(checksums) == n),
                   packed.kinds, packed.dtypes, packed.shapes)

    @classmethod
    def of_entries(cls, entries: Mapping[str, Mapping[str, Any]]) -> ManifestTable:
        """From entry dicts (``get_buffer_meta``'s ``tensors``)."""
        if isinstance(entries, ManifestTable):
            return entries
        names, es, n = list(entries), list(entries.values()), len(entries)
        sums = [e.get("checksum") for e in es]
        has = np.fromiter((c is not None for c in sums), dtype=bool, count=n)
        table, kinds = P.intern_kinds([(e["dtype"], tuple(e["shape"])) for e in es])
        return cls(
            names,
            np.fromiter(map(operator.itemgetter("offset"), es), dtype=np.int64, count=n),
            np.fromiter(map(operator.itemgetter("nbytes"), es), dtype=np.int64, count=n),
            np.fromiter((c or 0 for c in sums), dtype=np.uint64, count=n), has,
            kinds, [d for d, _ in table], [s for _, s in table])

    # -- the mapping ----------------------------------------------------------------

    def __getitem__(self, name: str) -> dict[str, Any]:
        return self.entry(self._rows[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self._rows

    def __repr__(self) -> str:
        return f"ManifestTable({len(self)} tensors)"

    def entry(self, row: int) -> dict[str, Any]:
        k = int(self.kinds[row])
        return {"dtype": self.dtypes[k], "shape": list(self.shapes[k]),
                "offset": int(self.offsets[row]), "nbytes": int(self.nbytes[row]),
                "checksum": int(self.checksums[row]) if self.has_sum[row] else None}

    # -- columns ----------------------------------------------------------------------

    def rows(self, names: Sequence[str]) -> np.ndarray:
        """Each name's row, -1 for a name not in the manifest."""
        return np.fromiter(map(self._rows.get, names, itertools.repeat(-1)), dtype=np.intp,
                           count=len(names))

    @property
    def end(self) -> int:
        """The end of the highest slot, aligned."""
        if not len(self.names):
            return 0
        return _align(int((self.offsets + self.nbytes).max()))

    def merged(self, written: ManifestTable, dropped: Sequence[str] = ()) -> ManifestTable:
        """This manifest with ``written`` recorded (names kept in place, new
        ones appended, like ``dict.update``) and ``dropped`` removed."""
        ids = {k: i for i, k in enumerate(zip(self.dtypes, self.shapes, strict=True))}
        dtypes, shapes = list(self.dtypes), list(self.shapes)
        remap = np.empty(len(written.dtypes), dtype=np.intp)
        for j, key in enumerate(zip(written.dtypes, written.shapes, strict=True)):
            if key not in ids:
                ids[key] = len(dtypes)
                dtypes.append(key[0])
                shapes.append(key[1])
            remap[j] = ids[key]
        rows = self.rows(written.names)
        old = rows >= 0
        mine = [self.offsets, self.nbytes, self.checksums, self.has_sum, self.kinds]
        theirs = [written.offsets, written.nbytes, written.checksums, written.has_sum,
                  remap[written.kinds]]
        cols = []
        for a, w in zip(mine, theirs, strict=True):
            a = a.copy()
            a[rows[old]] = w[old]
            cols.append(np.concatenate((a, w[~old])))
        same_names = bool(old.all()) and not dropped
        names = self.names if same_names else \
            self.names + list(itertools.compress(written.names, (~old).tolist()))
        if dropped:
            gone = set(dropped)
            keep = np.fromiter((n not in gone for n in names), dtype=bool, count=len(names))
            names = list(itertools.compress(names, keep.tolist()))
            cols = [c[keep] for c in cols]
        offsets, nbytes, checksums, has_sum, kinds = cols
        table = ManifestTable(names, offsets, nbytes, checksums, has_sum, kinds, dtypes, shapes)
        if same_names:
            table._index = self._index  # the same rows: share the (read-only) index
        return table


def _end_of(existing: Mapping[str, Mapping[str, Any]]) -> int:
    if isinstance(existing, ManifestTable):
        return existing.end
    return max((_align(e["offset"] + e["nbytes"]) for e in existing.values()), default=0)


def plan_offsets(names: Sequence[str], sizes: np.ndarray,
                 existing: Mapping[str, Mapping[str, Any]],
                 start: int | None = None, end: int | None = None) -> np.ndarray:
    """``plan_layout`` as an int64 array, index-aligned with ``names``."""
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
    """Offsets for ``tensors``: a name already in the manifest with the same
    size keeps its slot; the others go after the highest slot in use (``end``,
    else computed from ``existing``) or at ``start``, in the mapping's order,
    each aligned."""
    names = list(tensors)
    sizes = np.fromiter((int(a.nbytes) for a in tensors.values()), dtype=np.int64,
                        count=len(names))
    return dict(zip(names, plan_offsets(names, sizes, existing, start, end).tolist(),
                    strict=True))


# -- reading many ranges ---------------------------------------------------------------

SPAN_GAP = 4096  # ranges this close share one read (the bytes between come along)


def plan_spans(offsets: np.ndarray, sizes: np.ndarray, gap: int = SPAN_GAP
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, lengths, span of each item) of the spans that cover
    ``offsets``-sorted items: items overlapping or less than ``gap`` bytes
    apart share a span, so 10,000 slots read as one range."""
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
    """The stable order that sorts ``offsets``; None when they already are
    (the common case: then nothing needs reordering, either way)."""
    if len(offsets) > 1 and (offsets[1:] < offsets[:-1]).any():
        return np.argsort(offsets, kind="stable")
    return None


def in_caller_order(items: list[Any], order: np.ndarray | None) -> list[Any]:
    """``items`` made in ``offset_order`` put back in the order asked."""
    if order is None:
        return items
    out: list[Any] = [None] * len(items)
    for j, i in enumerate(order.tolist()):
        out[i] = items[j]
    return out


def bulk_views(blocks: Sequence[np.ndarray], which: np.ndarray, rel: np.ndarray,
               kinds: np.ndarray, dtypes: Sequence[np.dtype[Any]],
               shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """Item ``i``: an array of dtype/shape ``kinds[i]`` over
    ``blocks[which[i]]`` from byte ``rel[i]``.  A run of items of one kind at
    a constant stride becomes one strided array, cut into its rows by NumPy
    (a tenth of the cost of making each view)."""
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


def _np_dtype(name: str) -> np.dtype[Any]:
    dt = _DTYPES.get(name)
    if dt is None:
        dt = _DTYPES[name] = np.dtype(name)
    return dt


_DTYPES: dict[str, np.dtype[Any]] = {}


class LazyDtypes(Sequence[np.dtype[Any]]):
    """``np.dtype`` of a manifest's dtype strings, made when first used."""

    def __init__(self, names: list[str]) -> None:
        self._names = names

    def __getitem__(self, k: Any) -> Any:
        return _np_dtype(self._names[k])

    def __len__(self) -> int:
        return len(self._names)
