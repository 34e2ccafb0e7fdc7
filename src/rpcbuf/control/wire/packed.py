"""``Packed``: a batch's manifest as columns (names, per-item kind index into a
table of distinct dtype/shape kinds, offsets, sizes, checksums, optional source
types and logical shapes), built and read alike by both sides.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest

ManifestColumns = tuple[list[str], list[str], list[list[int]]]  # (names, dtypes, shapes)
Entry = dict[str, Any]  # dtype, shape, offset, nbytes, checksum[, source_type, logical_shape]

_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_NDIM = operator.attrgetter("ndim")
_SIZE = operator.attrgetter("size")


def intern_kinds(keys: list[Any]) -> tuple[list[Any], np.ndarray]:
    """The distinct ``keys`` in first-seen order, and each key's index."""
    table = list(dict.fromkeys(keys))
    index = {k: i for i, k in enumerate(table)}
    return table, np.fromiter(map(index.__getitem__, keys), dtype=np.intp, count=len(keys))


def manifest_columns(arrays: Mapping[str, Any], names: Iterable[str]) -> ManifestColumns:
    """(names, dtypes, shapes) of ``names``, for ``Packed.of_columns``."""
    names = list(names)
    return (names, [arrays[n].dtype.str for n in names],
            [list(arrays[n].shape) for n in names])


class Packed:
    """Item ``i`` is ``names[i]`` of dtype ``dtypes[kinds[i]]`` and shape
    ``shapes[kinds[i]]``.  ``kind_nbytes`` is None when built from columns;
    ``sources``/``logicals``: per kind, None as a whole when no kind has one."""

    __slots__ = ("dtypes", "kind_nbytes", "kinds", "logicals", "names", "shapes", "sources")

    def __init__(self, names: list[str], kinds: np.ndarray, dtypes: list[str],
                 shapes: list[tuple[int, ...]], kind_nbytes: np.ndarray | None = None,
                 sources: list[str | None] | None = None,
                 logicals: list[tuple[int, ...] | None] | None = None) -> None:
        self.names = names
        self.kinds = kinds
        self.dtypes = dtypes
        self.shapes = shapes
        self.kind_nbytes = kind_nbytes
        self.sources = sources
        self.logicals = logicals

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
            table, kinds = intern_kinds(list(zip(ids, shapes, strict=True)))
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
                   shapes: Sequence[Sequence[int]],
                   source_types: Sequence[str | None] | None = None,
                   logical_shapes: Sequence[Sequence[int] | None] | None = None) -> Packed:
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(f"names, dtypes and shapes must be equally long, got "
                             f"{len(names)}, {len(dtypes)} and {len(shapes)}")
        try:
            table, kinds = intern_kinds(list(zip(dtypes, map(tuple, shapes), strict=True)))
            kind_dtypes = [d if isinstance(d, str) else np.dtype(d).str for d, _ in table]
            kind_shapes = [tuple(map(operator.index, s)) for _, s in table]
        except TypeError as exc:
            raise BadRequest(f"bad manifest columns: {exc}") from None
        return cls(list(names), kinds, kind_dtypes, kind_shapes).described(source_types,
                                                                          logical_shapes)

    def described(self, source_types: Sequence[str | None] | None,
                  logical_shapes: Sequence[Sequence[int] | None] | None) -> Packed:
        """With each item's source type and logical shape (None for a tensor
        without): kinds then differ by those too.  BAD_REQUEST for a column of the
        wrong length or a logical shape that is no sequence of ints."""
        n = len(self.names)
        srcs = list(source_types) if source_types is not None else None
        try:
            logs = None if logical_shapes is None else \
                [None if s is None else tuple(map(operator.index, s)) for s in logical_shapes]
        except TypeError as exc:
            raise BadRequest(f"bad logical shapes: {exc}") from None
        if srcs is not None and all(s is None for s in srcs):
            srcs = None
        if logs is not None and all(s is None for s in logs):
            logs = None
        for what, col in (("source types", srcs), ("logical shapes", logs)):
            if col is not None and len(col) != n:
                raise BadRequest(f"{len(col)} {what} for {n} tensors")
        if srcs is None and logs is None:
            return self
        none: list[Any] = [None] * n
        table, kinds = intern_kinds(list(zip(self.kinds.tolist(), none if srcs is None else srcs,
                                             none if logs is None else logs, strict=True)))
        base = np.fromiter((k for k, _, _ in table), dtype=np.intp, count=len(table))
        return Packed(self.names, kinds, [self.dtypes[k] for k in base.tolist()],
                      [self.shapes[k] for k in base.tolist()],
                      None if self.kind_nbytes is None else self.kind_nbytes[base],
                      [s for _, s, _ in table] if srcs is not None else None,
                      [s for _, _, s in table] if logs is not None else None)

    def item_nbytes(self) -> np.ndarray:
        assert self.kind_nbytes is not None
        return self.kind_nbytes[self.kinds]

    def take(self, order: np.ndarray) -> Packed:
        names = self.names
        return Packed([names[i] for i in order.tolist()], self.kinds[order], self.dtypes,
                      self.shapes, self.kind_nbytes, sources=self.sources,
                      logicals=self.logicals)

    def fields(self) -> dict[str, Any]:
        """The ``StoreBatch`` fields (no ``kinds`` for a one-kind table)."""
        out: dict[str, Any] = {
               "names": self.names,
               "kinds": P.pack_u64(self.kinds) if len(self.dtypes) != 1 else None,
               "kind_dtypes": self.dtypes, "kind_shapes": [list(s) for s in self.shapes]}
        if self.sources is not None:
            out["kind_source_types"] = self.sources
        if self.logicals is not None:
            out["kind_logical_shapes"] = [None if s is None else list(s) for s in self.logicals]
        return out

    def entries(self, offsets: np.ndarray, sizes: np.ndarray,
                checksums: Sequence[int | None], lo: int = 0,
                hi: int | None = None) -> dict[str, Entry]:
        """Entry dicts of items ``lo:hi``; entries of one kind share its shape tuple."""
        hi = len(self.names) if hi is None else hi
        kinds = self.kinds[lo:hi].tolist()
        dts = map(self.dtypes.__getitem__, kinds)
        shapes = map(self.shapes.__getitem__, kinds)
        out = {n: {"dtype": d, "shape": s, "offset": o, "nbytes": z, "checksum": c}
               for n, d, s, o, z, c in zip(self.names[lo:hi], dts, shapes,
                                           offsets[lo:hi].tolist(), sizes[lo:hi].tolist(),
                                           checksums, strict=True)}
        if self.sources is not None or self.logicals is not None:
            extra = [_described(self.sources[k] if self.sources is not None else None,
                                self.logicals[k] if self.logicals is not None else None)
                     for k in range(len(self.dtypes))]
            for e, k in zip(out.values(), kinds, strict=True):
                if extra[k]:
                    e.update(extra[k])
        return out


def _described(source: str | None, logical: tuple[int, ...] | None) -> dict[str, Any]:
    """An entry's ``source_type``/``logical_shape`` keys: only those given."""
    out: dict[str, Any] = {}
    if source is not None:
        out["source_type"] = source
    if logical is not None:
        out["logical_shape"] = logical
    return out
