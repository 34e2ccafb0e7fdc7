"""Batches: many ranges of one buffer in one round trip, as a ``Transfer``.

Columns all the way (10,000 small tensors are one request): items are put
in offset order once (``order`` keeps the caller's), touching items become
runs (one UCX message each), nearby read ranges spans.  Synchronous: check
the items, build the request, and return the transfer and what turns the
answer into what the caller gets.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rpcbuf.control.client.arrays import as_bytes, host_data
from rpcbuf.control.client.datapath import Transfer
from rpcbuf.control.client.tensors import (
    XXH3,
    Items,
    Packed,
    bulk_views,
    in_caller_order,
    offset_order,
    plan_spans,
)
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.control.wire.runs import plan_runs

Manifest = tuple[list[str], list[str], list[list[int]]] | Packed


def store_batch(buffer_id: str, items: Sequence[tuple[int, Any]], verify: str | None,
                manifest: Manifest | None, manifest_version: int | None,
                checksums: Sequence[int] | None = None,
                ) -> tuple[Transfer, Callable[[dict[str, Any]], dict[str, Any]]]:
    """The transfer of a ``store_batch`` and what puts its answer in the
    caller's order.  ``checksums``: the items' xxh3-64 when known (else, with
    ``verify``, computed here).  Raises BAD_REQUEST."""
    if verify not in (None, "checksum"):
        raise BadRequest(f"verify must be None or 'checksum', got {verify!r}")
    n = len(items)
    known: np.ndarray | None = None  # the items' sizes, when given as columns
    if isinstance(items, Items):
        offsets, arrays, known = items.offsets.astype(np.int64), items.arrays, items.sizes
    else:
        try:
            offsets = np.fromiter(map(_FIRST, items), dtype=np.int64, count=n)
            arrays = list(map(_SECOND, items))
        except (TypeError, ValueError, OverflowError, IndexError):
            raise BadRequest("items must be (offset, array) pairs with integer "
                             "offsets") from None
    if n and offsets.min() < 0:
        raise BadRequest("offsets must be non-negative")
    packed = _packed(manifest, n)
    given = _given_checksums(checksums, n) if verify else None
    order = offset_order(offsets)
    if order is not None:
        offsets = offsets[order]
        arrays = [arrays[i] for i in order.tolist()]
        packed = packed.take(order) if packed is not None else None
        known = known[order] if known is not None else None
        given = given[order] if given is not None else None
    datas = host_data(arrays, "store_batch takes host arrays; store GPU tensors with "
                      "store_tensor")
    if known is None or datas is not arrays:
        sizes = np.fromiter(map(_NBYTES, datas), dtype=np.uint64, count=n)
    else:
        sizes = known.astype(np.uint64)
    offsets_u = offsets.astype(np.uint64)
    if given is not None:
        sums: P.U64Array | None = P.pack_u64(given)
    else:
        sums = P.pack_u64(np.fromiter(map(XXH3, datas), dtype=np.uint64,
                                      count=n)) if verify else None
    # The manifest's checksums are xxh3-64 whatever the buffer's device.
    req = P.StoreBatch(buffer_id=buffer_id, offsets=P.pack_u64(offsets_u),
                       sizes=P.pack_u64(sizes), checksums=sums,
                       verify=verify,  # type: ignore[arg-type]
                       manifest_version=manifest_version,
                       **(packed.fields() if packed is not None else {}))

    def messages() -> list[Any]:
        return [_payload(datas[first:stop])
                for _, _, first, stop in plan_runs(offsets_u, sizes)]

    return Transfer(req, datas, messages), lambda r: _in_caller_order(r, order)


def read_batch(buffer_id: str, ranges: Sequence[tuple[int, int]]
               ) -> tuple[Transfer, Callable[[], list[np.ndarray]]]:
    """The transfer of a ``read_batch`` and what cuts its blocks into the
    ranges asked, in the order asked.  Raises BAD_REQUEST."""
    n = len(ranges)
    try:
        offsets = np.fromiter(map(_FIRST, ranges), dtype=np.int64, count=n)
        sizes = np.fromiter(map(_SECOND, ranges), dtype=np.int64, count=n)
    except (TypeError, ValueError, OverflowError, IndexError):
        raise BadRequest("ranges must be (offset, nbytes) pairs of ints") from None
    if n and (offsets.min() < 0 or sizes.min() < 0):
        raise BadRequest("offsets and sizes must be non-negative")
    order = offset_order(offsets)
    if order is not None:
        offsets, sizes = offsets[order], sizes[order]
    starts, lengths, span_of = plan_spans(offsets, sizes)
    starts_u, lengths_u = starts.astype(np.uint64), lengths.astype(np.uint64)
    req = P.ReadBatch(buffer_id=buffer_id, offsets=P.pack_u64(starts_u),
                      sizes=P.pack_u64(lengths_u))
    # One block per run of spans (spans never touch, so in practice one
    # per span); each span lands at its place in its block.
    runs = plan_runs(starts_u, lengths_u)
    blocks = [np.empty(nb, dtype=np.uint8) for _, nb, _, _ in runs]
    block_of = np.repeat(np.arange(len(runs), dtype=np.intp),
                         [stop - first for _, _, first, stop in runs])
    in_block = starts - np.array([off for off, _, _, _ in runs], dtype=np.int64)[block_of] \
        if runs else starts

    def views() -> list[np.ndarray]:
        return _byte_views(blocks, block_of, in_block, span_of, offsets, starts, sizes, order)

    return Transfer(req, blocks, lambda: blocks), views


_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)
_NBYTES = operator.attrgetter("nbytes")


def _packed(manifest: tuple[list[str], list[str], list[list[int]]] | Packed | None,
            n: int) -> Packed | None:
    if manifest is None:
        return None
    packed = manifest if isinstance(manifest, Packed) else Packed.of_columns(*manifest)
    if len(packed) != n:
        raise BadRequest(f"the manifest lists {len(packed)} tensors for {n} items")
    return packed


def _given_checksums(checksums: Sequence[int] | None, n: int) -> np.ndarray | None:
    if checksums is None:
        return None
    try:
        sums = np.asarray(checksums, dtype=np.uint64)
    except (TypeError, ValueError, OverflowError):
        raise BadRequest("checksums must be unsigned 64-bit integers") from None
    if sums.shape != (n,):
        raise BadRequest(f"{sums.size} checksums for {n} items")
    return sums


def _payload(datas: list[np.ndarray]) -> np.ndarray:
    if len(datas) == 1:
        return as_bytes(datas[0])
    if len({d.dtype for d in datas}) == 1:  # one dtype: NumPy flattens and joins in C
        return np.concatenate(datas, axis=None).view(np.uint8)
    return np.concatenate([as_bytes(d) for d in datas])


def _in_caller_order(result: dict[str, Any], order: np.ndarray | None) -> dict[str, Any]:
    """Answers come per item in offset order: ``checksums`` in the caller's."""
    if order is not None and result.get("checksums"):
        sums = P.unpack_u64(result["checksums"])
        back = np.empty_like(sums)
        back[order] = sums
        result["checksums"] = P.pack_u64(back)
    return result


def _byte_views(blocks: list[np.ndarray], block_of: np.ndarray, in_block: np.ndarray,
                span_of: np.ndarray, offsets: np.ndarray, starts: np.ndarray,
                sizes: np.ndarray, order: np.ndarray | None) -> list[np.ndarray]:
    """Each item as a uint8 view into its block, in the caller's order."""
    if not len(sizes):
        return []
    rel = offsets - starts[span_of] + in_block[span_of]
    uniq, kinds = np.unique(sizes, return_inverse=True)
    views = bulk_views(blocks, block_of[span_of], rel, kinds.reshape(-1),
                       [np.dtype(np.uint8)] * len(uniq), [(int(u),) for u in uniq.tolist()])
    return in_caller_order(views, order)
