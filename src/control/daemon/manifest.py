"""The daemon's side of tensor manifests: check a batch's manifest columns,
build its entries, merge them into a buffer's manifest.

A batch names its tensors' dtypes and shapes in one of two forms:

* the list form: ``dtypes`` and ``shapes``, one per item;
* the packed form: a small table of *kinds* (``kind_dtypes[k]``,
  ``kind_shapes[k]``) and ``kinds``, each item's kind as packed uint64s —
  10,000 tensors of a few distinct shapes decode and check in a fraction of
  the time, since the work per item is NumPy's, not Python's.

Both are checked the same way, per kind (a dtype NumPy knows, not of Python
objects; shape product x itemsize == the item's nbytes, for every item, at
once); names must be unique.  Nothing here touches buffer bytes.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from control.daemon.registry import Buffer, Registry
from control.wire import protocol as P
from control.wire.errors import BadRequest
from control.wire.units import THREAD_BYTES
from dataplane.arena import Arena

_DTYPES: dict[str, tuple[str, int]] = {}  # wire name -> (canonical dtype.str, itemsize)
_NO_SIZE = (1 << 64) - 1  # a kind whose byte count is past 2**63: matches no item


def dtype_of(name: str) -> tuple[str, int]:
    """(canonical ``dtype.str``, itemsize) of a wire dtype; BAD_REQUEST for
    one NumPy does not know or one holding Python objects."""
    got = _DTYPES.get(name)
    if got is None:
        try:
            dt = np.dtype(name)
        except (TypeError, ValueError):
            raise BadRequest(f"unknown dtype {name!r}") from None
        if dt.hasobject:
            raise BadRequest(f"dtype {name!r} holds Python objects")
        got = (dt.str, dt.itemsize)
        if len(_DTYPES) < 4096:  # wire names are the client's: bound the cache
            _DTYPES[name] = got
    return got


@dataclass
class Columns:
    """A batch's checked manifest: item ``i`` is ``names[i]`` with dtype
    ``dtypes[kinds[i]]`` and shape ``shapes[kinds[i]]`` (or ``item_shapes[i]``
    for a batch in the list form: each entry keeps its own list)."""

    names: list[str]
    kinds: np.ndarray  # intp, one per item
    dtypes: list[str]  # canonical, one per kind
    shapes: list[tuple[int, ...]]  # one per kind
    item_shapes: list[list[int]] | None = None

    def entries(self, offsets: np.ndarray, sizes: np.ndarray,
                checksums: Sequence[int | None], lo: int = 0,
                hi: int | None = None) -> dict[str, dict[str, Any]]:
        """The manifest entries of items ``lo:hi``, one dict per tensor
        (``checksums`` are those items' only).  Entries of one kind share its
        shape tuple."""
        hi = len(self.names) if hi is None else hi
        kinds = self.kinds[lo:hi].tolist()
        dts = map(self.dtypes.__getitem__, kinds)
        shapes: Iterable[Any] = self.item_shapes[lo:hi] if self.item_shapes is not None \
            else map(self.shapes.__getitem__, kinds)
        return {n: {"dtype": d, "shape": s, "offset": o, "nbytes": z, "checksum": c}
                for n, d, s, o, z, c in zip(self.names[lo:hi], dts, shapes,
                                            offsets[lo:hi].tolist(), sizes[lo:hi].tolist(),
                                            checksums, strict=True)}


def check(req: P.StoreBatch | P.DedupStore, sizes: np.ndarray) -> Columns | None:
    """The batch's manifest, checked against the items' ``sizes``; None when
    the request records none.  BAD_REQUEST says what is wrong."""
    n = len(sizes)
    names, dtypes, shapes = req.names, req.dtypes, req.shapes
    packed = getattr(req, "kinds", None), getattr(req, "kind_dtypes", None), \
        getattr(req, "kind_shapes", None)
    if all(c is None for c in packed):
        if names is None and dtypes is None and shapes is None:
            return None
        if names is None or dtypes is None or shapes is None \
                or not len(names) == len(dtypes) == len(shapes) == n:
            raise BadRequest(f"names, dtypes and shapes must each list all {n} items")
        _unique(names)
        table, kinds = P.intern_kinds(list(zip(dtypes, map(tuple, shapes), strict=True)))
        cols = Columns(names, kinds, [], [s for _, s in table], item_shapes=shapes)
        raw_dtypes = [d for d, _ in table]
    else:
        if dtypes is not None or shapes is not None:
            raise BadRequest("a manifest is either dtypes and shapes or kinds, kind_dtypes "
                             "and kind_shapes, not both")
        ids_raw, kind_dtypes, kind_shapes = packed
        if names is None or kind_dtypes is None or kind_shapes is None:
            raise BadRequest("a packed manifest needs names, kind_dtypes and kind_shapes "
                             "(and kinds, unless there is one kind)")
        if ids_raw is None:
            if len(kind_dtypes) != 1:
                raise BadRequest(f"a packed manifest of {len(kind_dtypes)} kinds needs kinds")
            ids = np.zeros(n, dtype=np.uint64)
        else:
            ids = P.unpack_u64(ids_raw)
        if not len(names) == len(ids) == n:
            raise BadRequest(f"names and kinds must each list all {n} items "
                             f"(got {len(names)} and {len(ids)})")
        if len(kind_dtypes) != len(kind_shapes):
            raise BadRequest(f"{len(kind_dtypes)} kind_dtypes for {len(kind_shapes)} kind_shapes")
        if n and int(ids.max()) >= len(kind_dtypes):
            i = int(np.argmax(ids >= len(kind_dtypes)))
            raise BadRequest(f"tensor {names[i]!r}: kind {int(ids[i])} is not in the "
                             f"table of {len(kind_dtypes)} kinds")
        _unique(names)
        cols = Columns(names, ids.astype(np.intp), [], [tuple(s) for s in kind_shapes])
        raw_dtypes = list(kind_dtypes)
    # Per kind: the dtype, and the bytes its shape takes; then every item at once.
    nbytes = np.empty(len(raw_dtypes), dtype=np.uint64)
    for k, (dt, shape) in enumerate(zip(raw_dtypes, cols.shapes, strict=True)):
        canonical, itemsize = dtype_of(dt)
        cols.dtypes.append(canonical)
        total = math.prod(shape) * itemsize
        nbytes[k] = total if total <= P.MAX_INT else _NO_SIZE
    if n:
        bad = nbytes[cols.kinds] != sizes
        if bad.any():
            i = int(np.argmax(bad))
            k = int(cols.kinds[i])
            said = list(cols.shapes[k]) if cols.item_shapes is None else cols.item_shapes[i]
            raise BadRequest(f"tensor {names[i]!r}: shape {said} of {raw_dtypes[k]} is not "
                             f"{int(sizes[i])} bytes")
    return cols


def _unique(names: list[str]) -> None:
    if len(set(names)) != len(names):
        raise BadRequest("tensor names in one batch must be unique")


def _merge_plan(buf: Buffer, names: Iterable[str], written: list[tuple[int, int]],
                hull: tuple[int, int]) -> tuple[list[str], int]:
    """What merging tensors ``names`` written over ``written`` (sorted
    ranges inside ``hull``) does to the buffer's manifest: the names of other
    entries whose bytes they overwrite (dropped), and the entry count after."""
    new = set(names)
    dropped: list[str] = []
    others = buf.tensors.keys() - new if buf.tensors else set()  # renewed names stay
    if others:
        starts = [w[0] for w in written]
        for name in others:
            e = buf.tensors[name]
            a, b = e["offset"], e["offset"] + e["nbytes"]
            if a >= hull[1] or b <= hull[0]:
                continue
            j = bisect.bisect_left(starts, b)  # written[j-1]: the last range starting before b
            if j and written[j - 1][1] > a:
                dropped.append(name)
    count = len(buf.tensors) - len(dropped) + len(new - buf.tensors.keys())
    return dropped, count


def _check_count(count: int) -> None:
    if count > P.MAX_ITEMS:
        raise BadRequest(f"a buffer's manifest holds at most {P.MAX_ITEMS} tensors; this "
                         f"batch would make it {count}", {"limit": P.MAX_ITEMS})


def plan_record(registry: Registry, buf: Buffer, names: list[str], offsets: np.ndarray,
                sizes: np.ndarray) -> None:
    """Refuse, before anything changes, a batch whose tensors would make the
    buffer's manifest too big (BAD_REQUEST) or pass the tenant's quota with
    their entries (QUOTA_EXCEEDED)."""
    if not names:
        return
    order = np.argsort(offsets, kind="stable")
    written = list(zip(offsets[order].tolist(), (offsets + sizes)[order].tolist(), strict=True))
    hull = (written[0][0], max(e for _, e in written))
    _, count = _merge_plan(buf, names, written, hull)
    _check_count(count)
    registry.charge_entries(buf, count, dry_run=True)


def record(registry: Registry, buf: Buffer, manifest: dict[str, dict[str, Any]],
           hull: tuple[int, int], end: int | None = None) -> list[str]:
    """Merge ``manifest`` into the buffer's; entries whose bytes were just
    overwritten by other tensors are dropped (they no longer hold).  ``end``:
    the end of the highest entry written, when the caller knows it.
    Checked (size, quota) before anything changes.  Returns the dropped names."""
    written = sorted((e["offset"], e["offset"] + e["nbytes"]) for e in manifest.values())
    dropped, count = _merge_plan(buf, manifest.keys(), written, hull)
    _check_count(count)
    registry.charge_entries(buf, count)
    for name in dropped:
        del buf.tensors[name]
    buf.tensors.update(manifest)
    buf.manifest_version += 1
    if end is None:
        end = max((e["offset"] + e["nbytes"] for e in manifest.values()), default=0)
    buf.tensors_end = max(buf.tensors_end, -(-end // 256) * 256)
    return dropped


async def landed_checksums(arena: Arena, offsets: np.ndarray, sizes: np.ndarray,
                           nbytes: int) -> list[int]:
    """xxh3-64 of each arena range: in a worker thread when they add up to
    ``THREAD_BYTES`` or more (xxhash drops the GIL while it hashes a big
    range), so the event loop serves on."""
    if nbytes >= THREAD_BYTES:
        return await asyncio.to_thread(arena.checksums, offsets, sizes)
    return arena.checksums(offsets, sizes)



class Landing:
    """A same-host store's ``landed`` callback (see ``cma.Peer.read``): hash
    the items that have arrived, and build their manifest entries, while the
    rest still copies.  Called from the copying threads, for disjoint ranges."""

    def __init__(self, arena: Arena, at: np.ndarray, sizes: np.ndarray,
                 cols: Columns | None, offsets: np.ndarray) -> None:
        self._arena, self._at, self._sizes = arena, at, sizes
        self._cols, self._offsets = cols, offsets
        self.sums: list[int] = [0] * len(sizes)
        self._parts: dict[int, dict[str, dict[str, Any]]] = {}

    def __call__(self, lo: int, hi: int) -> None:
        got = self._arena.checksums(self._at[lo:hi], self._sizes[lo:hi])
        self.sums[lo:hi] = got
        if self._cols is not None:
            self._parts[lo] = self._cols.entries(self._offsets, self._sizes, got, lo, hi)

    def entries(self) -> dict[str, dict[str, Any]]:
        """Every item's entry, in item order."""
        out: dict[str, dict[str, Any]] = {}
        for lo in sorted(self._parts):
            out.update(self._parts[lo])
        return out
