"""Named tensor layouts: which tensor lives at which offset of a remote buffer.

``store_tensors`` gives each tensor an aligned slot (256 bytes, GPU-friendly),
stores them all in one batch (one control round trip; touching small tensors
travel as one UCX message) and has the daemon record a manifest — name ->
dtype, shape, offset, nbytes, checksum — that ``get_buffer_meta`` returns
under ``tensors``.  ``load_tensors`` reads them back, with their dtype and
shape, in one batch; any process of the same tenant can do so once it has
the buffer id (``open_buffer(name)`` finds a named buffer).

The checksum in the manifest is the daemon's xxh3-64 of the bytes it
received; ``load_tensors(verify=True)`` recomputes it on what arrived.

Big batches (10,000 small tensors) are handled as columns, not per tensor:
the manifest goes out packed (a table of distinct dtype/shape *kinds* plus one
kind index per tensor, see ``Packed``), the client caches manifests as NumPy
columns (``ManifestTable``, a read-only mapping whose entry dicts are built
on access; both are the one manifest model of ``control/wire/manifest.py``,
which the daemon checks and records with), layouts are planned with NumPy,
and ``load_tensors`` reads a few contiguous spans and cuts them into arrays
a kind at a time.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from control.wire import protocol as P
from control.wire.errors import BadRequest, NotFound, VerifyFailed
from control.wire.manifest import ALIGN, ManifestTable, Packed, manifest_columns, np_dtype
from control.wire.manifest import align as _align

__all__ = ["ALIGN", "Items", "ManifestTable", "Packed", "TensorOps", "calculate_buffer_size",
           "manifest_columns", "named_arrays", "plan_layout", "plan_offsets", "plan_spans"]


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
    names, arrays = _named(tensors)
    return dict(zip(names, arrays, strict=True))


def _named(tensors: Mapping[str, Any]) -> tuple[list[str], list[np.ndarray]]:
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


@dataclass
class _Manifest:
    """A client's copy of one buffer's manifest, valid while ``version`` is."""

    version: int
    end: int
    table: ManifestTable

    def update(self, version: int, written: ManifestTable, dropped: list[str]) -> None:
        self.table = self.table.merged(written, dropped)
        self.version = version
        self.end = max(self.end, written.end)


class TensorOps:
    """Mixin for ``RpcContext``: the named-tensor layer over the batch ops."""

    _manifests: dict[str, _Manifest]

    if TYPE_CHECKING:  # provided by RpcContext
        async def get_buffer_meta(self, buffer_id: str, tensors: bool = True,
                                  ) -> dict[str, Any]: ...

        async def store_batch(
            self, buffer_id: str, items: Sequence[tuple[int, Any]], verify: str | None = None,
            manifest: tuple[list[str], list[str], list[list[int]]] | Packed | None = None,
            manifest_version: int | None = None,
        ) -> dict[str, Any]: ...

        async def read_batch(self, buffer_id: str,
                             ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]: ...

    async def store_tensors(self, buffer_id: str, tensors: Mapping[str, Any],
                            offset: int | None = None,
                            verify: str | None = None) -> ManifestTable:
        """Store ``{name: array}`` at aligned offsets and record the manifest.

        Returns the manifest entries written (a read-only mapping name ->
        offset, nbytes, dtype, shape, checksum).
        Names already stored with the same size are overwritten in place;
        ``offset`` places the new slots from there instead.  Two clients
        storing into one buffer at once should use distinct ``offset``s.
        Raises NOT_FOUND, OUT_OF_RANGE (the buffer is too small: size it with
        ``calculate_buffer_size``), VERIFY_FAILED, BAD_REQUEST."""
        names, arrays = _named(tensors)
        packed = Packed.of_arrays(names, arrays)
        sizes = packed.item_nbytes()
        for attempt in (0, 1):
            cached = self._manifests.get(buffer_id)
            if cached is None:
                await self.get_buffer_meta(buffer_id)  # fills the cache
                cached = self._manifests[buffer_id]
            offsets = plan_offsets(names, sizes, cached.table, offset, cached.end)
            try:
                result = await self.store_batch(
                    buffer_id, Items(offsets, arrays, sizes), verify=verify,
                    manifest=packed, manifest_version=cached.version)
                break
            except BadRequest as exc:
                # Another client changed the manifest since we cached it: the
                # daemon refused before any byte landed; re-read and re-plan once.
                self._manifests.pop(buffer_id, None)
                if attempt or exc.details.get("reason") != "manifest_changed":
                    raise
        assert cached is not None
        written = ManifestTable.of_batch(packed, offsets, sizes,
                                         P.unpack_u64(result.get("checksums", b"")))
        cached.update(result.get("manifest_version", cached.version), written,
                      result.get("dropped", []))
        return written

    def _remember_manifest(self, buffer_id: str, meta: dict[str, Any]) -> None:
        if meta.get("tensors") is not None:
            self._manifests[buffer_id] = _Manifest(
                meta["manifest_version"], meta["tensors_end"],
                ManifestTable.of_entries(meta["tensors"]))

    async def _manifest_of(self, buffer_id: str) -> ManifestTable:
        """The manifest, from the cache when its version is still current
        (a small answer) and from the daemon otherwise."""
        cached = self._manifests.get(buffer_id)
        if cached is not None:
            meta = await self.get_buffer_meta(buffer_id, tensors=False)
            if meta["manifest_version"] == cached.version:
                return cached.table
        meta = await self.get_buffer_meta(buffer_id)
        cached = self._manifests.get(buffer_id)
        return cached.table if cached is not None \
            else ManifestTable.of_entries(meta.get("tensors") or {})

    async def load_tensors(self, buffer_id: str, names: Iterable[str] | None = None,
                           verify: bool = True) -> dict[str, np.ndarray]:
        """``{name: array}`` with the stored dtype and shape, in one batch.

        With ``verify`` each tensor's xxh3 is compared with the manifest.
        Raises NOT_FOUND (buffer, or a name not in its manifest), VERIFY_FAILED."""
        table = await self._manifest_of(buffer_id)
        if names is None:
            wanted = list(table.names)
            rows = np.arange(len(wanted), dtype=np.intp)
        else:
            wanted = list(names)
            rows = table.rows(wanted)
            if len(rows) and rows.min() < 0:
                missing = [n for n, r in zip(wanted, rows.tolist(), strict=True) if r < 0]
                raise NotFound(f"no tensor(s) {missing[:5]} in this buffer's manifest",
                               {"missing": missing[:20]})
        arrays = await self._read_tensors(buffer_id, table, rows)
        if verify and len(arrays):
            got = np.fromiter(map(XXH3, arrays), dtype=np.uint64,
                              count=len(arrays))
            bad = np.flatnonzero(table.has_sum[rows] & (got != table.checksums[rows]))
            if len(bad):
                raise VerifyFailed(f"{len(bad)} tensor(s) do not match their manifest checksum",
                                   {"tensors": [wanted[i] for i in bad[:20].tolist()]})
        return dict(zip(wanted, arrays, strict=True))

    async def _read_tensors(self, buffer_id: str, table: ManifestTable,
                            rows: np.ndarray) -> list[np.ndarray]:
        """The tensors at ``rows`` of ``table``, typed, in that order: read as
        a few spans (``plan_spans``), cut a kind at a time (``bulk_views``)."""
        offsets = table.offsets[rows]
        order = offset_order(offsets)
        if order is not None:
            rows, offsets = rows[order], offsets[order]
        starts, lengths, span_of = plan_spans(offsets, table.nbytes[rows])
        blocks = await self.read_batch(buffer_id, list(zip(starts.tolist(), lengths.tolist(),
                                                           strict=True)))
        arrays = bulk_views(blocks, span_of, offsets - starts[span_of], table.kinds[rows],
                            _LazyDtypes(table.dtypes), table.shapes)
        return in_caller_order(arrays, order)


class _LazyDtypes(Sequence[np.dtype[Any]]):
    """``np.dtype`` of a manifest's dtype strings, made when first used."""

    def __init__(self, names: list[str]) -> None:
        self._names = names

    def __getitem__(self, k: Any) -> Any:
        return np_dtype(self._names[k])

    def __len__(self) -> int:
        return len(self._names)
