"""Node-local load: each node reads its share of a model from its own disk, so no
tensor crosses the network.

The driver knows the model from a hash manifest, or its header plus hashes read
here.  Placement, buffers, layout and the load record are an upload's, so a
model loaded either way lies the same.  Before any node reads a byte, every
node opens its copy of each file its slots read (``_check_copies``).  Each slot
then sends ``load_file`` batches (two in flight) naming the file, each tensor's
byte range, place and hashes; the node records only what verified.  The
metadata is stored from the driver as an upload stores it.  Failure and
cleanup are an upload's.
"""

from __future__ import annotations

import asyncio
import posixpath
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rpcbuf.control.client.cluster import Cluster
from rpcbuf.control.client.fileload import FileTensor
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.models import commit as CM
from rpcbuf.models.hashfile import (
    DIR_NAME,
    SUFFIX,
    HashedModel,
    HashedTensor,
    describe,
)
from rpcbuf.models.loader import (
    LoadResult,
    NodeStats,
    ProgressFn,
    _check_manifest,
    _Progress,
    _release_stale,
    _store_metadata,
    described,
    place_and_acquire,
    start_progress,
)
from rpcbuf.models.modelfile import TensorSpec
from rpcbuf.models.reading import HashLookup
from rpcbuf.models.slots import SlotJob, slot_offsets

if TYPE_CHECKING:
    from rpcbuf.control.client.context import RpcContext

IN_FLIGHT = 2  # load_file requests per slot at once: the node's reader never waits for us
# Bytes per load_file request.  Each request costs the node a few thread hops
# and the driver a round trip; reading 1 GiB took 0.60-0.78 s in 256 MiB or
# bigger requests, 0.69-0.96 s in 64 MiB, 0.92-1.08 s in 16 MiB (one node,
# this 2-core VM, busy), and an in-place re-load 0.03-0.08 s, 0.09-0.15 s and
# 0.18-0.33 s.  Progress moves a request at a time.
NODE_BATCH = 256 << 20
MAX_BATCH_TENSORS = P.MAX_ITEMS // 2


@dataclass
class NodeLoadStats(NodeStats):
    bytes_read: int = 0  # read from the node's own disk
    bytes_in_place: int = 0  # already in the buffer, verified earlier: not read again

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out.pop("bytes_deduped", None)
        return {**out, "bytes_read_locally": self.bytes_read,
                "bytes_in_place": self.bytes_in_place}


@dataclass
class NodeLoadResult(LoadResult):
    node_path: str = ""
    hashes: str = "manifest"  # where the driver got the hashes: manifest, hashed, cache
    bytes_hashed: int = 0  # bytes the driver read to hash them

    @property
    def bytes_read(self) -> int:
        return sum(getattr(n, "bytes_read", 0) for n in self.nodes.values())

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "source": "node", "node_path": self.node_path,
                "hashes": self.hashes, "bytes_hashed": self.bytes_hashed,
                "bytes_read_locally": self.bytes_read}


def default_names(path: Path) -> tuple[str, str]:
    """(name, path on the nodes) from the model's path, or the model beside a
    manifest."""
    model = path
    if path.name == DIR_NAME:
        model = path.parent
    elif path.name.endswith(SUFFIX):
        model = path.with_name(path.name[:-len(SUFFIX)])
    return (model.name if _shards(path) else model.stem), str(model)


def _shards(path: Path) -> bool:
    """A directory of shards (or its manifest): the nodes' path is a directory too."""
    return path.name == DIR_NAME or path.is_dir()


async def load_from_node(cluster: Cluster, path: str | Path | HashedModel,
                         node_path: str | None = None, placement: str | None = None,
                         name: str | None = None, progress: bool = True, *,
                         batch_bytes: int = NODE_BATCH,
                         on_progress: ProgressFn | None = None,
                         hash_cache: bool = True) -> NodeLoadResult:
    """Load the model at ``path`` (here: a model or its hash manifest, or a
    ``describe`` result) from each node's copy at ``node_path`` (relative: in the
    nodes' ``--model-dir``).  Other arguments as ``load_model``.  Raises
    BAD_REQUEST before anything is requested, else ``ClusterError`` naming each
    failed node (after releasing what this call created)."""
    t0 = time.perf_counter()
    if batch_bytes <= 0:
        raise BadRequest("batch_bytes must be positive")
    hm = path if isinstance(path, HashedModel) else \
        await asyncio.to_thread(describe, path, hash_cache)
    local = Path(hm.path)
    auto_name, auto_path = default_names(local)
    name = name or auto_name
    node_path = node_path or auto_path
    if not name or len(name) > 200:
        raise BadRequest(f"bad model name {name!r}")
    shards = _shards(local)
    files = [posixpath.join(node_path, f.name) if shards else node_path for f in hm.files]
    tensors = {t.name: (k, t) for k, t in hm.tensors}
    plan, existing, jobs = await place_and_acquire(
        cluster, name, [(t.name, t.nbytes) for _, t in hm.tensors],
        lambda n: _spec(*tensors[n]), hm.blob(), placement, _manifest_lookup(hm))
    stats = {a: NodeLoadStats(a) for a in cluster.endpoints}
    try:
        await _check_copies(cluster, jobs, tensors, hm, files, batch_bytes)
        bar = start_progress(jobs, stats, progress, on_progress)
        try:
            await _read_on_nodes(cluster, jobs, tensors, hm, files, stats, bar, batch_bytes,
                                 t0)
        finally:
            bar.close()
        await _release_stale(cluster, existing, name, {j.buffer_name for j in jobs})
        await CM.commit(cluster, jobs)
    except BaseException:
        await CM.abort(cluster, jobs)
        raise
    return NodeLoadResult(name, str(local), hm.format, plan, dict(stats), described(jobs),
                          time.perf_counter() - t0, node_path=node_path, hashes=hm.source,
                          bytes_hashed=hm.hashed)


def _manifest_lookup(hm: HashedModel) -> HashLookup:
    by_name = {t.name: (t.digest, t.checksum) for _, t in hm.tensors}

    def lookup(batch: list[TensorSpec]) -> dict[str, tuple[int, int]]:
        return {s.name: by_name[s.name] for s in batch if s.name in by_name}

    return lookup


def _spec(k: int, t: HashedTensor) -> TensorSpec:
    return TensorSpec(t.name, t.dtype, t.shape, t.nbytes, t.source_dtype, k, t.source[1])


def _batches(job: SlotJob, tensors: dict[str, tuple[int, HashedTensor]],
             offsets: dict[str, int], limit: int) -> list[tuple[int, list[FileTensor]]]:
    """Per file, in buffer order, at most ``limit`` bytes and
    ``MAX_BATCH_TENSORS`` tensors each."""
    out: list[tuple[int, list[FileTensor]]] = []
    open_: dict[int, tuple[list[FileTensor], int]] = {}
    for spec in sorted(job.specs, key=lambda s: offsets[s.name]):
        k, t = tensors[spec.name]
        batch, size = open_.get(k, ([], 0))
        if batch and (size + t.nbytes > limit or len(batch) >= MAX_BATCH_TENSORS):
            out.append((k, batch))
            batch, size = [], 0
        batch.append(FileTensor(t.name, t.dtype, t.shape, t.file_offset, t.nbytes,
                                offsets[t.name], t.digest, t.checksum, *t.source))
        open_[k] = (batch, size + t.nbytes)
    out.extend((k, b) for k, (b, _) in open_.items() if b)
    return out


async def _check_copies(cluster: Cluster, jobs: list[SlotJob],
                        tensors: dict[str, tuple[int, HashedTensor]], hm: HashedModel,
                        files: list[str], batch_bytes: int) -> None:
    """Every node has each file its slots read, of the right size and a model
    (a ``load_file`` of no tensors), before any node reads a byte."""
    probes: dict[tuple[str, int], asyncio.Future[Any]] = {}

    async def one(j: SlotJob) -> None:
        ctx = cluster[j.plan.slot.endpoint]
        used = sorted({k for k, _ in _batches(j, tensors, slot_offsets(j), batch_bytes)})
        for k in used:
            key = (j.plan.slot.endpoint, k)
            if key not in probes:
                probes[key] = asyncio.ensure_future(
                    _load(ctx, j.buffer_id, files[k], hm.files[k].size, []))
            await asyncio.shield(probes[key])

    try:
        await CM.each_slot(cluster, jobs, one, "checking the nodes' copies")
    finally:
        for p in probes.values():
            p.cancel()
        await asyncio.gather(*probes.values(), return_exceptions=True)


async def _read_on_nodes(cluster: Cluster, jobs: list[SlotJob],
                         tensors: dict[str, tuple[int, HashedTensor]], hm: HashedModel,
                         files: list[str], stats: dict[str, NodeLoadStats], bar: _Progress,
                         batch_bytes: int, t0: float) -> None:
    failed = asyncio.Event()  # the other slots stop at their next batch

    async def one(j: SlotJob) -> None:
        ctx = cluster[j.plan.slot.endpoint]
        node = stats[j.plan.slot.endpoint]
        offsets = slot_offsets(j)  # as an upload
        slots = asyncio.Semaphore(IN_FLIGHT)

        async def batch(k: int, items: list[FileTensor]) -> None:
            async with slots:
                if failed.is_set():
                    return
                try:
                    res = await _load(ctx, j.buffer_id, files[k], hm.files[k].size, items)
                except BaseException:
                    failed.set()
                    raise
            node.bytes_read += int(res["read"])
            node.bytes_in_place += int(res["nbytes"]) - int(res["read"])
            bar.advance(j.plan.slot.endpoint, sum(t.nbytes for t in items))

        parts = [asyncio.ensure_future(batch(k, b))
                 for k, b in _batches(j, tensors, offsets, batch_bytes)]
        try:
            await asyncio.gather(*parts)
        except BaseException:
            for p in parts:
                p.cancel()
            await asyncio.gather(*parts, return_exceptions=True)
            raise
        if failed.is_set():
            return
        sums = {s.name: tensors[s.name][1].checksum for s in j.specs}
        try:
            await _store_metadata(ctx, j, offsets, sums)
        except BaseException:
            failed.set()
            raise
        await _check_manifest(ctx, j, sums)
        j.sums = sums
        node.seconds = max(node.seconds, time.perf_counter() - t0)

    await CM.each_slot(cluster, jobs, one, "loading from the nodes' own disks")


async def _load(ctx: RpcContext, buffer_id: str, path: str, size: int,
                items: list[FileTensor]) -> dict[str, Any]:
    return await ctx.load_file(buffer_id, path, size, items)
