"""The tensor manifest, one model for client and daemon, with no I/O.

A manifest maps names to entries (``dtype``, ``shape``, ``offset``, ``nbytes``,
``checksum``, and for tensors from a model file ``source_type`` and
``logical_shape``, recorded as said; each key only when given).  A batch packs
dtypes and shapes as a small table of kinds plus each item's kind (uint64s), so
10,000 tensors of a few shapes are checked by NumPy, not per item in Python.

``Packed`` is built by the client (``of_arrays``, ``of_columns``) and rebuilt by
the daemon with ``check`` (known non-object dtype, shape x itemsize == nbytes
for every item at once, unique names).  ``ManifestTable`` is a manifest as NumPy
columns.  ``merge_plan``, ``merge_entries`` and ``ManifestTable.merged`` are the
one merge rule: a recorded name keeps its place, a new one is appended, entries
whose bytes others just overwrote are dropped.  Nothing here touches buffer bytes.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.control.wire.packed import (
    Entry as Entry,
    ManifestColumns as ManifestColumns,
    Packed as Packed,
    intern_kinds as intern_kinds,
    manifest_columns as manifest_columns,
)

# Entries rpcbuf's model loader keeps in a slot buffer beside the model's
# tensors (the file's metadata blob, the load record): not tensors of the
# file, so listings count them out and load_tensors gives them only by name.
META_TENSOR = "__rpcbuf_metadata__"
LOAD_TENSOR = "__rpcbuf_load__"
RESERVED = frozenset({META_TENSOR, LOAD_TENSOR})
ALIGN = 256  # tensor slots start at multiples of this (GPU-friendly); so does ``tensors_end``
_NO_SIZE = (1 << 64) - 1  # a kind whose byte count is past 2**63: matches no item
_DTYPE_CACHE_MAX = 4096  # wire names are the peer's: bound the cache
_DTYPES: dict[str, np.dtype[Any]] = {}
# What a model file says a tensor is: (source type, logical shape), either None.
Source = tuple[str | None, Sequence[int] | None]


def align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def np_dtype(name: str) -> np.dtype[Any]:
    """BAD_REQUEST for a dtype NumPy does not know or one of Python objects."""
    dt = _DTYPES.get(name)
    if dt is None:
        try:
            dt = np.dtype(name)
        except (TypeError, ValueError):
            raise BadRequest(f"unknown dtype {name!r}") from None
        if dt.hasobject:
            raise BadRequest(f"dtype {name!r} holds Python objects")
        if len(_DTYPES) < _DTYPE_CACHE_MAX:
            _DTYPES[name] = dt
    return dt


def dtype_of(name: str) -> tuple[str, int]:
    """(canonical ``dtype.str``, itemsize) of a wire dtype; raises as ``np_dtype``."""
    dt = np_dtype(name)
    return dt.str, dt.itemsize


def source_columns(names: Sequence[str], sources: Mapping[str, Source] | None
                   ) -> tuple[list[str | None] | None, list[list[int] | None] | None]:
    """The (source types, logical shapes) columns of ``names`` from
    ``sources``; a column is None when no tensor has one.  BAD_REQUEST for a bad pair."""
    if not sources:
        return None, None
    try:
        pairs = [sources.get(n) or (None, None) for n in names]
        srcs = [s for s, _ in pairs]
        logs = [None if g is None else list(map(operator.index, g)) for _, g in pairs]
    except (TypeError, ValueError):
        raise BadRequest("sources must map tensor names to (source type, logical shape) "
                         "pairs") from None
    return (srcs if any(s is not None for s in srcs) else None,
            logs if any(g is not None for g in logs) else None)


def check(req: P.StoreBatch | P.DedupStore | P.LoadFile, sizes: np.ndarray
          ) -> Packed | None:
    """The batch's packed manifest checked against the items' ``sizes``, with
    canonical dtypes; None when it records none.  BAD_REQUEST says what is wrong."""
    n = len(sizes)
    names, kind_dtypes, kind_shapes = req.names, req.kind_dtypes, req.kind_shapes
    kind_srcs, kind_logs = req.kind_source_types, req.kind_logical_shapes
    if names is None and kind_dtypes is None and kind_shapes is None and req.kinds is None:
        if kind_srcs is not None or kind_logs is not None:
            raise BadRequest("kind_source_types and kind_logical_shapes need a manifest "
                             "(names, kind_dtypes and kind_shapes)")
        return None
    if names is None or kind_dtypes is None or kind_shapes is None:
        raise BadRequest("a manifest needs names, kind_dtypes and kind_shapes "
                         "(and kinds, unless there is one kind)")
    if req.kinds is None:
        if len(kind_dtypes) != 1:
            raise BadRequest(f"a manifest of {len(kind_dtypes)} kinds needs kinds")
        ids = np.zeros(n, dtype=np.uint64)
    else:
        ids = P.unpack_u64(req.kinds)
    if not len(names) == len(ids) == n:
        raise BadRequest(f"names and kinds must each list all {n} items "
                         f"(got {len(names)} and {len(ids)})")
    if len(kind_dtypes) != len(kind_shapes):
        raise BadRequest(f"{len(kind_dtypes)} kind_dtypes for {len(kind_shapes)} kind_shapes")
    if n and int(ids.max()) >= len(kind_dtypes):
        i = int(np.argmax(ids >= len(kind_dtypes)))
        raise BadRequest(f"tensor {names[i]!r}: kind {int(ids[i])} is not in the "
                         f"table of {len(kind_dtypes)} kinds")
    for what, col in (("kind_source_types", kind_srcs), ("kind_logical_shapes", kind_logs)):
        if col is not None and len(col) != len(kind_dtypes):
            raise BadRequest(f"{len(col)} {what} for {len(kind_dtypes)} kinds")
    _unique(names)
    cols = Packed(names, ids.astype(np.intp), [], [tuple(s) for s in kind_shapes],
                  sources=list(kind_srcs) if kind_srcs is not None else None,
                  logicals=None if kind_logs is None else
                  [None if s is None else tuple(s) for s in kind_logs])
    # Per kind: the dtype, and the bytes its shape takes; then every item at once.
    nbytes = np.empty(len(kind_dtypes), dtype=np.uint64)
    for k, (dt, shape) in enumerate(zip(kind_dtypes, cols.shapes, strict=True)):
        canonical, itemsize = dtype_of(dt)
        cols.dtypes.append(canonical)
        total = math.prod(shape) * itemsize
        nbytes[k] = total if total <= P.MAX_INT else _NO_SIZE
    if n:
        bad = nbytes[cols.kinds] != sizes
        if bad.any():
            i = int(np.argmax(bad))
            k = int(cols.kinds[i])
            raise BadRequest(f"tensor {names[i]!r}: shape {list(cols.shapes[k])} of "
                             f"{kind_dtypes[k]} is not {int(sizes[i])} bytes")
    return cols


def _unique(names: list[str]) -> None:
    if len(set(names)) != len(names):
        raise BadRequest("tensor names in one batch must be unique")


# -- the merge rule ----------------------------------------------------------------------


def merge_plan(existing: Mapping[str, Mapping[str, Any]], names: Iterable[str],
               written: list[tuple[int, int]], hull: tuple[int, int]) -> tuple[list[str], int]:
    """Merging ``names`` written over ``written`` (sorted ranges inside
    ``hull``) into ``existing``: the overwritten names to drop, and the count after."""
    new = set(names)
    dropped: list[str] = []
    others = existing.keys() - new if existing else set()  # renewed names stay
    if others:
        starts = [w[0] for w in written]
        for name in others:
            e = existing[name]
            a, b = e["offset"], e["offset"] + e["nbytes"]
            if a >= hull[1] or b <= hull[0]:
                continue
            j = bisect.bisect_left(starts, b)  # written[j-1]: the last range starting before b
            if j and written[j - 1][1] > a:
                dropped.append(name)
    count = len(existing) - len(dropped) + len(new - existing.keys())
    return dropped, count


def check_count(count: int) -> None:
    """BAD_REQUEST when a manifest would hold more than ``MAX_ITEMS`` entries."""
    if count > P.MAX_ITEMS:
        raise BadRequest(f"a buffer's manifest holds at most {P.MAX_ITEMS} tensors; this "
                         f"batch would make it {count}", {"limit": P.MAX_ITEMS})


def merge_entries(entries: MutableMapping[str, Entry], written: Mapping[str, Entry],
                  dropped: Iterable[str]) -> None:
    """Apply a merge to entry dicts in place (``merged`` does it to columns)."""
    for name in dropped:
        del entries[name]
    entries.update(written)


class ManifestTable(Mapping[str, Entry]):
    """A manifest as NumPy columns, read as a mapping name -> entry dict (built
    when asked for).  Never modified: ``merged`` makes a new one."""

    def __init__(self, names: list[str], offsets: np.ndarray, nbytes: np.ndarray,
                 checksums: np.ndarray, has_sum: np.ndarray, kinds: np.ndarray,
                 dtypes: list[str], shapes: list[tuple[int, ...]],
                 sources: list[str | None] | None = None,
                 logicals: list[tuple[int, ...] | None] | None = None) -> None:
        self.names = names
        self.offsets = offsets  # int64
        self.nbytes = nbytes  # int64
        self.checksums = checksums  # uint64, valid where has_sum
        self.has_sum = has_sum  # bool
        self.kinds = kinds  # intp: index into dtypes/shapes (and sources/logicals)
        self.dtypes = dtypes
        self.shapes = shapes
        self.sources = sources  # per kind, None for a kind without; None: no kind has one
        self.logicals = logicals  # likewise
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
        """A batch's entries; ``checksums`` one per item, or empty for none."""
        n = len(packed)
        sums = checksums if len(checksums) == n else np.zeros(n, dtype=np.uint64)
        return cls(packed.names, offsets.astype(np.int64), sizes.astype(np.int64),
                   sums.astype(np.uint64), np.full(n, len(checksums) == n),
                   packed.kinds, packed.dtypes, packed.shapes, packed.sources,
                   packed.logicals)

    @classmethod
    def of_entries(cls, entries: Mapping[str, Mapping[str, Any]]) -> ManifestTable:
        if isinstance(entries, ManifestTable):
            return entries
        names, es, n = list(entries), list(entries.values()), len(entries)
        sums = [e.get("checksum") for e in es]
        has = np.fromiter((c is not None for c in sums), dtype=bool, count=n)
        table, kinds = intern_kinds([
            (e["dtype"], tuple(e["shape"]), e.get("source_type"),
             None if (g := e.get("logical_shape")) is None else tuple(g)) for e in es])
        described = any(k[2] is not None or k[3] is not None for k in table)
        return cls(
            names,
            np.fromiter(map(operator.itemgetter("offset"), es), dtype=np.int64, count=n),
            np.fromiter(map(operator.itemgetter("nbytes"), es), dtype=np.int64, count=n),
            np.fromiter((c or 0 for c in sums), dtype=np.uint64, count=n), has,
            kinds, [k[0] for k in table], [k[1] for k in table],
            [k[2] for k in table] if described else None,
            [k[3] for k in table] if described else None)

    # -- the mapping ----------------------------------------------------------------

    def __getitem__(self, name: str) -> Entry:
        return self.entry(self._rows[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self._rows

    def __repr__(self) -> str:
        return f"ManifestTable({len(self)} tensors)"

    def entry(self, row: int) -> Entry:
        k = int(self.kinds[row])
        out = {"dtype": self.dtypes[k], "shape": list(self.shapes[k]),
               "offset": int(self.offsets[row]), "nbytes": int(self.nbytes[row]),
               "checksum": int(self.checksums[row]) if self.has_sum[row] else None}
        if self.sources is not None and self.sources[k] is not None:
            out["source_type"] = self.sources[k]
        if self.logicals is not None and (logical := self.logicals[k]) is not None:
            out["logical_shape"] = list(logical)
        return out

    def _kind_keys(self, described: bool) -> list[tuple[Any, ...]]:
        if not described:
            return list(zip(self.dtypes, self.shapes, strict=True))
        n = len(self.dtypes)
        return list(zip(self.dtypes, self.shapes, self.sources or [None] * n,
                        self.logicals or [None] * n, strict=True))

    # -- columns ----------------------------------------------------------------------

    def visible_rows(self) -> np.ndarray:
        """The rows of every entry but the ``RESERVED`` ones, in order."""
        rows = np.arange(len(self.names), dtype=np.intp)
        hidden = self.rows(sorted(RESERVED))
        return np.delete(rows, hidden[hidden >= 0]) if (hidden >= 0).any() else rows

    def rows(self, names: Sequence[str]) -> np.ndarray:
        return np.fromiter(map(self._rows.get, names, itertools.repeat(-1)), dtype=np.intp,
                           count=len(names))

    @property
    def end(self) -> int:
        if not len(self.names):
            return 0
        return align(int((self.offsets + self.nbytes).max()))

    def merged(self, written: ManifestTable, dropped: Sequence[str] = ()) -> ManifestTable:
        """With ``written`` recorded (names kept in place, new ones appended) and
        ``dropped`` removed."""
        described = any(t.sources is not None or t.logicals is not None
                        for t in (self, written))
        keys = self._kind_keys(described)
        ids = {k: i for i, k in enumerate(keys)}
        remap = np.empty(len(written.dtypes), dtype=np.intp)
        for j, key in enumerate(written._kind_keys(described)):
            if key not in ids:
                ids[key] = len(keys)
                keys.append(key)
            remap[j] = ids[key]
        dtypes, shapes = [k[0] for k in keys], [k[1] for k in keys]
        sources = [k[2] for k in keys] if described else None
        logicals = [k[3] for k in keys] if described else None
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
        table = ManifestTable(names, offsets, nbytes, checksums, has_sum, kinds, dtypes, shapes,
                              sources, logicals)
        if same_names:
            table._index = self._index  # the same rows: share the (read-only) index
        return table
