"""The named-tensor layer: ``store_tensors`` and ``load_tensors``.

A store plans slots against the cached manifest and sends one
``store_batch`` naming the manifest version it planned against: if another
client changed it meanwhile, the daemon refuses before any byte lands and
the layout is planned again, once.  A load reads a few spans and checks
each tensor's xxh3-64.  The cache is per buffer, valid while its
``manifest_version`` is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rpcbuf.control.client.answers import bad_answer
from rpcbuf.control.client.arrays import check_framework, torch_view
from rpcbuf.control.client.rangeops import MetaOf, RangeOps
from rpcbuf.control.client.tensors import (
    XXH3,
    Items,
    LazyDtypes,
    ManifestTable,
    Packed,
    bulk_views,
    in_caller_order,
    names_and_arrays,
    offset_order,
    plan_offsets,
    plan_spans,
    with_bits,
)
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, NotFound, VerifyFailed
from rpcbuf.control.wire.manifest import Source, source_columns


@dataclass
class _Manifest:
    version: int
    end: int
    table: ManifestTable

    def update(self, version: int, written: ManifestTable, dropped: list[str]) -> None:
        self.table = self.table.merged(written, dropped)
        self.version = version
        self.end = max(self.end, written.end)


class TensorOps:
    """The named-tensor verbs and their manifest cache (buffer id -> manifest)."""

    def __init__(self, ranges: RangeOps, meta: MetaOf) -> None:
        self._ranges, self._meta = ranges, meta
        self.manifests: dict[str, _Manifest] = {}

    async def store_tensors(self, buffer_id: str, tensors: Mapping[str, Any], offset: int | None,
                            verify: str | None, sources: Mapping[str, Source] | None
                            ) -> ManifestTable:
        names, arrays, bits = names_and_arrays(tensors)
        sources = with_bits(sources, bits)
        packed = Packed.of_arrays(names, arrays)
        if sources:
            packed = packed.described(*source_columns(names, sources))
        sizes = packed.item_nbytes()
        for attempt in (0, 1):
            cached = self.manifests.get(buffer_id)
            if cached is None:
                await self._meta(buffer_id, True)  # fills the cache
                cached = self.manifests[buffer_id]
            offsets = plan_offsets(names, sizes, cached.table, offset, cached.end)
            try:
                result = await self._ranges.store_batch(
                    buffer_id, Items(offsets, arrays, sizes), verify, packed, cached.version,
                    None)
                break
            except BadRequest as exc:
                # Another client changed the manifest since we cached it: the
                # daemon refused before any byte landed; re-read and re-plan once.
                self.manifests.pop(buffer_id, None)
                if attempt or exc.details.get("reason") != "manifest_changed":
                    raise
        assert cached is not None
        written = ManifestTable.of_batch(packed, offsets, sizes,
                                         P.unpack_u64(result.get("checksums", b"")))
        cached.update(result.get("manifest_version", cached.version), written,
                      result.get("dropped", []))
        return written

    def remember(self, buffer_id: str, meta: dict[str, Any]) -> None:
        """Cache a ``get_buffer_meta`` answer's manifest.  Raises BAD_REQUEST
        (``bad_answer``) for malformed entries."""
        if meta.get("tensors") is not None:
            try:
                table = ManifestTable.of_entries(meta["tensors"])
            except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
                raise bad_answer("buffer meta", "tensors", "holds something that is no "
                                 "manifest entry") from None
            self.manifests[buffer_id] = _Manifest(meta["manifest_version"],
                                                  meta["tensors_end"], table)

    async def manifest_of(self, buffer_id: str) -> ManifestTable:
        """The manifest, from the cache while its version is current."""
        cached = self.manifests.get(buffer_id)
        if cached is not None:
            meta = await self._meta(buffer_id, False)
            if meta["manifest_version"] == cached.version:
                return cached.table
        meta = await self._meta(buffer_id, True)
        cached = self.manifests.get(buffer_id)
        return cached.table if cached is not None \
            else ManifestTable.of_entries(meta.get("tensors") or {})

    async def load_tensors(self, buffer_id: str, names: Iterable[str] | None, verify: bool,
                           framework: str) -> dict[str, Any]:
        check_framework(framework)
        table = await self.manifest_of(buffer_id)
        if names is None:  # the tensors, not the loader's reserved entries
            rows = table.visible_rows()
            wanted = [table.names[i] for i in rows.tolist()]
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
        if framework == "torch":
            srcs, logs = table.sources, table.logicals
            arrays = [torch_view(a, srcs[k] if srcs else None, logs[k] if logs else None)
                      for a, k in zip(arrays, table.kinds[rows].tolist(), strict=True)]
        return dict(zip(wanted, arrays, strict=True))

    async def _read_tensors(self, buffer_id: str, table: ManifestTable,
                            rows: np.ndarray) -> list[np.ndarray]:
        """The tensors at ``rows``, typed, in that order."""
        offsets = table.offsets[rows]
        order = offset_order(offsets)
        if order is not None:
            rows, offsets = rows[order], offsets[order]
        starts, lengths, span_of = plan_spans(offsets, table.nbytes[rows])
        spans = list(zip(starts.tolist(), lengths.tolist(), strict=True))
        blocks = await self._ranges.read_batch(buffer_id, spans)
        arrays = bulk_views(blocks, span_of, offsets - starts[span_of], table.kinds[rows],
                            LazyDtypes(table.dtypes), table.shapes)
        return in_caller_order(arrays, order)
