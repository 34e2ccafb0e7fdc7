"""Model upload: a safetensors/GGUF model's tensors placed across a cluster.

One named buffer per used slot, ``NAME/slotN``, tensors back to back; a buffer
of that name that already holds part of the slot's plan is reused.  Each slot
sends batches that ramp from ``FIRST_BATCH`` up to ``batch_bytes``, hashed one
ahead in a worker thread, deduplicated against what the node holds, at most
``IN_FLIGHT`` on the wire.  Nothing is complete until every slot's manifest
matched the checksums computed here; only then is the load committed.

On failure or cancellation the buffers this call created are released on every
node that still answers and ``ClusterError`` names the failed nodes; reused
buffers are kept (their verified tensors are not sent again).  The model file's
mapping is always closed before ``load_model`` returns.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rpcbuf.control.client.cluster import Cluster
from rpcbuf.control.client.tensors import (
    Packed,
    manifest_columns,
)
from rpcbuf.control.wire.errors import (
    BadRequest,
    NotFound,
    RpcBufError,
    VerifyFailed,
)
from rpcbuf.control.wire.manifest import Source, source_columns
from rpcbuf.dataplane.checksum import checksum
from rpcbuf.models import commit as CM, metadata as MD, placement as PL, record as LR
from rpcbuf.models.acquire import acquire, as_if_released
from rpcbuf.models.modelfile import ModelFile, TensorSpec, open_model
from rpcbuf.models.reading import (
    DEFAULT_BATCH,
    FIRST_BATCH,
    HashAhead,
    HashLookup,
    KnownHashes,
    batches,
    read_batch,
)
from rpcbuf.models.slots import (
    SlotJob,
    buffer_name,
    carry_metadata,
    is_model_buffer,
    metadata_names,
    metadata_offset,
    room_for_metadata,
    slot_offsets,
)

if TYPE_CHECKING:
    from rpcbuf.control.client.context import RpcContext

IN_FLIGHT = 2  # batches a slot has on the wire at once
ProgressFn = Callable[[str, int, int], None]  # endpoint, bytes done, bytes total


@dataclass
class NodeStats:
    endpoint: str
    bytes_total: int = 0
    bytes_sent: int = 0
    bytes_placed: int = 0
    tensors: int = 0
    seconds: float = 0.0
    buffers: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"bytes_total": self.bytes_total, "bytes_sent": self.bytes_sent,
                "bytes_deduped": self.bytes_placed, "tensors": self.tensors,
                "seconds": round(self.seconds, 4), "buffers": self.buffers}


@dataclass
class LoadResult:
    name: str
    model: str
    format: str
    placement: PL.Placement
    nodes: dict[str, NodeStats]
    buffers: list[dict[str, Any]]
    seconds: float

    @property
    def bytes_sent(self) -> int:
        return sum(n.bytes_sent for n in self.nodes.values())

    @property
    def bytes_total(self) -> int:
        return sum(n.bytes_total for n in self.nodes.values())

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model, "format": self.format,
                "placement": self.placement.spec, "seconds": round(self.seconds, 4),
                "bytes_total": self.bytes_total, "bytes_sent": self.bytes_sent,
                "nodes": {a: n.to_json() for a, n in self.nodes.items()},
                "buffers": self.buffers}


class _Progress:
    """Per-node byte counters, shown with rich when asked and on a terminal."""

    def __init__(self, totals: dict[str, int], show: bool, callback: ProgressFn | None) -> None:
        self.totals = totals
        self.done = dict.fromkeys(totals, 0)
        self.callback = callback
        self._bar: Any = None
        self._tasks: dict[str, Any] = {}
        if show and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            from rpcbuf.control.client.progress import byte_columns

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), *byte_columns(),
                                 TimeRemainingColumn(), console=Console(stderr=True))
            for addr, total in totals.items():
                self._tasks[addr] = self._bar.add_task(addr, total=total)
            self._bar.start()

    def advance(self, endpoint: str, nbytes: int) -> None:
        self.done[endpoint] += nbytes
        if self._bar is not None:
            self._bar.update(self._tasks[endpoint], advance=nbytes)
        if self.callback is not None:
            self.callback(endpoint, self.done[endpoint], self.totals[endpoint])

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


async def load_model(cluster: Cluster, path: str | Path | ModelFile,
                     placement: str | None = None,
                     name: str | None = None, progress: bool = True, *,
                     batch_bytes: int = DEFAULT_BATCH, dedup: bool = True,
                     on_progress: ProgressFn | None = None,
                     hash_cache: bool = True) -> LoadResult:
    """Upload the model at ``path`` (a file, a shard directory, or an open
    ``ModelFile``, closed here) across ``cluster``.  ``placement``: a spec or None
    (by free memory); ``dedup`` False sends every byte; ``hash_cache`` reuses the
    hashes of an unchanged file.
    Raises BAD_REQUEST (bad spec or name, model does not fit or is no model)
    before any buffer is requested, OSError for a missing file, else ``ClusterError``
    naming each failed node (after releasing what this call created)."""
    t0 = time.perf_counter()
    if batch_bytes <= 0:
        raise BadRequest("batch_bytes must be positive")
    model = path if isinstance(path, ModelFile) else await asyncio.to_thread(open_model, path)
    path = model.path
    is_dir = model.files[0] != Path(path)  # a directory of shards
    name = name or (Path(path).name if is_dir else Path(path).stem)
    if not name or len(name) > 200:
        raise BadRequest(f"bad model name {name!r}")
    known: KnownHashes | None = None
    if dedup and hash_cache:
        try:
            known = await asyncio.to_thread(KnownHashes, model)
        except OSError:
            known = None  # cannot stat the files: hash them
    hashing = HashAhead(model, known)
    unmapping: asyncio.Future[None] | None = None
    try:
        try:
            plan, existing, jobs = await place_and_acquire(
                cluster, name, [(t.name, t.nbytes) for t in model.tensors],
                model.by_name.__getitem__, MD.encode(model.format, model.metadata), placement,
                known.lookup if known is not None else None, hashing if dedup else None)
        finally:
            ahead = await hashing.stop()
        stats = {a: NodeStats(a) for a in cluster.endpoints}
        try:
            bar = start_progress(jobs, stats, progress, on_progress)
            try:
                await _upload(cluster, model, jobs, stats, bar, batch_bytes, dedup, t0, known,
                              ahead)
            finally:
                bar.close()
            # Every tensor is on its node and verified: the file's mapping goes
            # now, in a worker thread, while the nodes commit (unmapping 1 GiB of
            # mapped pages took 27-37 ms here, on the load's critical path).
            unmapping = asyncio.ensure_future(asyncio.to_thread(model.close))
            if known is not None:
                await asyncio.to_thread(known.save)
            await _release_stale(cluster, existing, name, {j.buffer_name for j in jobs})
            await CM.commit(cluster, jobs)  # PutEnd: only now is the model complete
        except BaseException:
            await CM.abort(cluster, jobs)
            raise
    finally:
        if unmapping is not None:
            await CM.settle(unmapping)  # gone before we return, even when cancelled
        model.close()
    return LoadResult(name, str(path), model.format, plan, stats, described(jobs),
                      time.perf_counter() - t0)


async def place_and_acquire(cluster: Cluster, name: str, sizes: list[tuple[str, int]],
                            spec_of: Callable[[str], TensorSpec], blob: np.ndarray,
                            placement: str | None, known: HashLookup | None = None,
                            hashing: HashAhead | None = None
                            ) -> tuple[PL.Placement, dict[str, list[dict[str, Any]]],
                                       list[SlotJob]]:
    """Step 1 of any load: placement over the slots (this model's old buffers
    counted free, room left for the metadata ``blob``), a job per slot, its buffer
    reused or made, its load record planned."""
    slots = [PL.Slot.from_device(d["slot"], d["endpoint"], d) for d in await cluster.devices()]
    existing = await cluster.list_buffers()
    slots = as_if_released(slots, existing, name)
    # room for a load record naming every tensor: any slot's is smaller
    most = LR.room(LR.plan(range(len(slots)), 0, [n for n, _ in sizes] + [MD.META_TENSOR],
                           LR.new_load_id()))
    plan = PL.plan(PL.Groups.of(sizes), room_for_metadata(slots, blob, most), placement)
    jobs = [SlotJob(p, [spec_of(n) for n in p.tensors], buffer_name(name, p.slot.slot))
            for p in plan.slots]
    carry_metadata(jobs, blob)
    load, numbers = LR.new_load_id(), [p.slot.slot for p in plan.slots]
    for j in jobs:
        j.record = LR.plan(numbers, j.plan.slot.slot,
                           [s.name for s in j.specs] + sorted(metadata_names(j)), load)
    try:
        await acquire(cluster, jobs, existing, name, known, hashing)
        for j in jobs:
            got = known(j.specs) if known is not None else {}
            if hashing is not None and j.cloned:
                got = {**hashing.hashes, **got}  # a clone was decided by them
            if all(s.name in got for s in j.specs):
                j.expect = {s.name: got[s.name][1] for s in j.specs}
                if j.metadata is not None:
                    j.expect[MD.META_TENSOR] = checksum(j.metadata)
        await CM.start(cluster, jobs)  # PutStart, before any byte of a slot changes
    except BaseException:
        await CM.abort(cluster, jobs)
        raise
    return plan, existing, jobs


def start_progress(jobs: list[SlotJob], stats: dict[str, Any], show: bool,
                   callback: ProgressFn | None) -> _Progress:
    """Count each node's share into ``stats`` and start the progress bars."""
    for j in jobs:
        node = stats[j.plan.slot.endpoint]
        node.bytes_total += sum(s.nbytes for s in j.specs)
        node.tensors += len(j.specs)
        node.buffers.append(j.buffer_name)
    return _Progress({a: n.bytes_total for a, n in stats.items() if n.tensors}, show, callback)


def described(jobs: list[SlotJob]) -> list[dict[str, Any]]:
    return [{"name": j.buffer_name, "buffer_id": j.buffer_id, "slot": j.plan.slot.slot,
             "endpoint": j.plan.slot.endpoint, "device": j.plan.slot.key,
             "reused": not j.created, "cloned": j.cloned,
             **{k: v for k, v in j.plan.describe().items()
                if k in ("prolog", "epilog", "layers", "tensors", "nbytes")}} for j in jobs]


async def _upload(cluster: Cluster, model: ModelFile, jobs: list[SlotJob],
                  stats: dict[str, NodeStats], bar: _Progress, batch_bytes: int,
                  dedup: bool, t0: float, known: KnownHashes | None = None,
                  ahead: dict[str, tuple[int, int]] | None = None) -> None:
    failed = asyncio.Event()  # the other slots stop at their next batch

    async def one(j: SlotJob) -> None:
        ctx = cluster[j.plan.slot.endpoint]
        node = stats[j.plan.slot.endpoint]
        offsets = slot_offsets(j)
        sums: dict[str, int] = {}
        parts = list(batches(j.specs, batch_bytes, FIRST_BATCH))

        async def store(arrays: dict[str, np.ndarray], hashes: dict[str, tuple[int, int]]
                        ) -> None:
            nbytes = sum(int(a.nbytes) for a in arrays.values())
            if dedup:
                res = await ctx.store_tensors_dedup(
                    j.buffer_id, arrays, {n: offsets[n] for n in arrays}, "checksum", hashes,
                    sources=_sources(model, arrays))
                node.bytes_sent += res["bytes_sent"]
                node.bytes_placed += res["bytes_placed"]
            else:
                await ctx.store_batch(
                    j.buffer_id, [(offsets[n], arrays[n]) for n in arrays], "checksum",
                    _described(model, arrays), checksums=[hashes[n][1] for n in arrays])
                node.bytes_sent += nbytes
            bar.advance(j.plan.slot.endpoint, nbytes)

        # Batch k+1 is read and hashed (a worker thread) and sent while batch k's
        # answer is still on its way: the node verifies k while k+1 travels.
        reading: asyncio.Future[Any] | None = None
        sending: deque[asyncio.Future[None]] = deque()
        try:
            for k, batch in enumerate(parts):
                if failed.is_set():
                    return
                if reading is None:
                    reading = asyncio.ensure_future(asyncio.to_thread(read_batch, model, batch,
                                                                      known, ahead))
                arrays, hashes = await reading
                reading = None
                if k + 1 < len(parts):
                    reading = asyncio.ensure_future(asyncio.to_thread(
                        read_batch, model, parts[k + 1], known, ahead))
                sums.update({n: h[1] for n, h in hashes.items()})
                sending.append(asyncio.ensure_future(store(arrays, hashes)))
                del arrays, hashes
                if len(sending) >= IN_FLIGHT:
                    await sending.popleft()
            while sending:
                await sending.popleft()
            await _store_metadata(ctx, j, offsets, sums)
            await _check_manifest(ctx, j, sums)
            j.sums = sums
            node.seconds = max(node.seconds, time.perf_counter() - t0)
        except BaseException:
            failed.set()
            raise
        finally:
            left = [f for f in (reading, *sending) if f is not None]
            for f in left:
                f.cancel()
            if left:  # collected, so no error of theirs goes unretrieved
                await asyncio.gather(*left, return_exceptions=True)

    await CM.each_slot(cluster, jobs, one, "uploading the model")


# -- what the manifests say beyond the NumPy views: source types, the file's metadata --


def _sources(model: ModelFile, names: Iterable[str]) -> dict[str, Source]:
    """Each tensor's (source type, logical shape), as its manifest entry records them."""
    return {n: model.by_name[n].source for n in names}


def _described(model: ModelFile, arrays: dict[str, np.ndarray]) -> Packed:
    """A batch's manifest with each tensor's source type and logical shape."""
    names = list(arrays)
    return Packed.of_columns(*manifest_columns(arrays, names),
                             *source_columns(names, _sources(model, names)))


async def _store_metadata(ctx: RpcContext, job: SlotJob, offsets: dict[str, int],
                          sums: dict[str, int]) -> None:
    """The metadata tensor after the slot's tensors (deduplicated); its
    checksum joins ``sums``."""
    if job.metadata is None:
        return
    await ctx.store_tensors_dedup(job.buffer_id, {MD.META_TENSOR: job.metadata},
                                  {MD.META_TENSOR: metadata_offset(job, offsets)}, "checksum")
    sums[MD.META_TENSOR] = checksum(job.metadata)


async def _check_manifest(ctx: RpcContext, job: SlotJob, sums: dict[str, int]) -> None:
    manifest = (await ctx.get_buffer_meta(job.buffer_id))["tensors"]
    bad = [n for n, c in sums.items() if (manifest.get(n) or {}).get("checksum") != c]
    if bad:
        raise VerifyFailed(f"{len(bad)} tensor(s) of {job.buffer_name} are missing from its "
                           "manifest or do not match", {"tensors": bad[:20]})


async def _release_stale(cluster: Cluster, existing: dict[str, list[dict[str, Any]]],
                         name: str, keep: set[str]) -> None:
    """Old buffers of this model that the new placement does not use."""
    for addr, bufs in existing.items():
        for b in bufs:
            if is_model_buffer(name, b["name"]) and b["name"] not in keep:
                try:
                    await cluster[addr].release_buffer(str(b["buffer_id"]))
                except RpcBufError:
                    pass  # released meanwhile


async def unload_model(cluster: Cluster, name: str) -> dict[str, list[str]]:
    """Release every ``NAME/slotN`` on every node; the names released per node.
    Raises ``ClusterError`` for failed nodes (after the others) and NOT_FOUND when
    no node held the model."""

    async def one(ctx: RpcContext) -> list[str]:
        done = []
        for b in await ctx.list_buffers():
            if is_model_buffer(name, b["name"]):
                await ctx.release_buffer(str(b["buffer_id"]))
                done.append(str(b["name"]))
        return done

    got = await cluster.gather(one, "unload")
    if not any(got.values()):
        raise NotFound(f"no node holds a model named {name!r}", {"name": name})
    return got
