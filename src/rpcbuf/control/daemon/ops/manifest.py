"""The daemon's side of tensor manifests: what needs the registry or the arena
(the model itself is ``control/wire/manifest.py``).  ``plan_record`` refuses,
before any byte lands, a batch that would overfill the manifest or the
quota; ``record`` merges a batch's entries; ``drop_written`` drops entries a
failed op overwrote; ``range_digests`` and ``Landing`` hash what landed (on
host memory, xxh3-64 and xxh3-128 in one pass).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from rpcbuf.control.wire.manifest import (
    ALIGN,
    Packed,
    align,
    check,
    check_count,
    merge_entries,
    merge_plan,
)
from rpcbuf.dataplane.checksum import digests
from rpcbuf.dataplane.cuda_arena import is_device_arena

if TYPE_CHECKING:
    from rpcbuf.control.daemon.accounting.registry import Buffer, Registry
    from rpcbuf.dataplane.arena import Arena

__all__ = ["Landing", "check", "drop_written", "plan_record", "range_digests", "record"]


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
    _, count = merge_plan(buf.tensors, names, written, hull)
    check_count(count)
    registry.charge_entries(buf, count, dry_run=True)


def record(registry: Registry, buf: Buffer, manifest: dict[str, dict[str, Any]],
           hull: tuple[int, int], end: int | None = None) -> list[str]:
    """Merge ``manifest`` into the buffer's, dropping entries whose bytes were
    just overwritten; ``end``: the end of the highest entry written, if known.
    Returns the dropped names."""
    written = sorted((e["offset"], e["offset"] + e["nbytes"]) for e in manifest.values())
    dropped, count = merge_plan(buf.tensors, manifest.keys(), written, hull)
    check_count(count)
    registry.charge_entries(buf, count)
    merge_entries(buf.tensors, manifest, dropped)
    buf.manifest_version += 1
    if end is None:
        end = max((e["offset"] + e["nbytes"] for e in manifest.values()), default=0)
    buf.tensors_end = max(buf.tensors_end, align(end, ALIGN))
    return dropped


def drop_written(registry: Registry, buf: Buffer, ranges: list[tuple[int, int]]) -> list[str]:
    """Drop the entries whose bytes lie in ``ranges`` (written by an op that
    then failed: they no longer hold what their checksums say).  Returns the
    dropped names."""
    written = sorted(r for r in ranges if r[1] > r[0])
    if not written or not buf.tensors:
        return []
    hull = (written[0][0], max(e for _, e in written))
    dropped, count = merge_plan(buf.tensors, (), written, hull)
    if dropped:
        merge_entries(buf.tensors, {}, dropped)
        registry.charge_entries(buf, count)
        buf.manifest_version += 1
    return dropped


def host_arena(arena: Arena) -> bool:
    """Whether ``arena`` is host memory (its views have the buffer protocol)."""
    return not is_device_arena(arena)


def range_digests(arena: Arena, offsets: np.ndarray, sizes: np.ndarray
                  ) -> tuple[list[int], list[int]]:
    """``(xxh3-64s, xxh3-128s)`` of each range of a host arena, each range read
    once (``checksum.digests``); bounds checked here too."""
    offs = np.asarray(offsets, dtype=np.int64)
    ends = offs + np.asarray(sizes, dtype=np.int64)
    if not len(offs):
        return [], []
    if offs.min() < 0 or int(ends.max()) > arena.size or (ends < offs).any():
        raise IndexError("a range is outside the arena")
    mem = memoryview(arena.view(0, arena.size))
    pairs = [digests(mem[a:b]) for a, b in zip(offs.tolist(), ends.tolist(), strict=True)]
    return [c for _, c in pairs], [d for d, _ in pairs]


class Landing:
    """A same-host store's ``landed`` callback (``staging.Area.pump``): hash
    the items that have arrived, and build their manifest entries, while the
    rest still copies.  Called from the copying threads, for disjoint ranges."""

    def __init__(self, arena: Arena, at: np.ndarray, sizes: np.ndarray,
                 cols: Packed | None, offsets: np.ndarray, with_digests: bool = False) -> None:
        self._arena, self._at, self._sizes = arena, at, sizes
        self._cols, self._offsets = cols, offsets
        self.sums: list[int] = [0] * len(sizes)
        # each item's xxh3-128 too (same pass) when asked: None otherwise
        self.digests: list[int] | None = [0] * len(sizes) if with_digests else None
        self._parts: dict[int, dict[str, dict[str, Any]]] = {}

    def __call__(self, lo: int, hi: int) -> None:
        if self.digests is not None:
            got, self.digests[lo:hi] = range_digests(self._arena, self._at[lo:hi],
                                                     self._sizes[lo:hi])
        else:
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
