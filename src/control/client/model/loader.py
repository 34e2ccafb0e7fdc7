"""Model upload: place a safetensors/GGUF model's tensors across a cluster.

``load_model(cluster, path)`` (and ``rpcbuf load``) does, in order:

1. read the model's metadata (``modelfile``) and the cluster's devices, and
   plan the placement (``placement``: a spec or proportional to free memory);
   a bad spec or a model that does not fit fails here, before any request;
2. request one named buffer per used slot, ``f"{name}/slot{i}"``, sized with
   ``calculate_buffer_size(..., headroom=0)`` on that slot's device; a buffer
   of that name that already holds part of this slot's plan is reused (a
   re-load, or a retry after a failure, then fills it in place); if any
   request fails, the buffers just created are released and nothing is sent.
   Meanwhile a worker thread hashes the tensors the hash cache does not know
   (``_HashAhead``: a node backs a new buffer's memory before it answers);
   then every slot gets its planned load record (``commit.start``);
3. per slot, concurrently: read a batch of at most ``batch_bytes`` (a worker
   thread reads and hashes the next batch, each tensor once, while this one
   travels), place it with ``store_tensors_dedup`` (the node places what
   this tenant already holds; the rest is sent and checksum-verified, with
   the checksums hashed here), ``IN_FLIGHT`` batches on the wire at once
   (the node verifies one while the next arrives), and report progress;
4. store the file's own metadata (``metadata``: one tensor in the first slot
   buffer on each node) and record each tensor's source type and logical
   shape in the manifests (``TensorSpec.source``);
5. check every slot's manifest against the checksums computed here, and
   only once every slot passed, commit the load (``commit.commit``): until
   then the model is not complete (``record``).

Named buffers outlive the client, so the model stays loaded after the CLI
exits; ``unload_model`` (``rpcbuf unload NAME``) releases it on every node.

If a node fails mid-upload the other slots stop at their next batch, the
buffers this call created are released on every node that still answers,
and ``ClusterError`` names the node(s) that failed.  Buffers it reused are
kept: they hold verified tensors a retry will not send again.  A cancelled
load (Ctrl-C, SIGTERM in the CLI) releases the same way (``commit.abort``).
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from control.client.cluster import Cluster, ClusterError
from control.client.dedup import content_hashes
from control.client.model import commit as CM
from control.client.model import metadata as MD
from control.client.model import placement as PL
from control.client.model import record as LR
from control.client.model.hashcache import HashCache, file_key, tensor_key
from control.client.model.modelfile import ModelFile, TensorSpec, open_model
from control.client.tensors import (
    ALIGN,
    Packed,
    calculate_buffer_size,
    manifest_columns,
    plan_layout,
)
from control.wire.errors import (
    BadRequest,
    NotFound,
    OutOfMemory,
    RpcBufError,
    UnsupportedDevice,
    VerifyFailed,
)
from control.wire.manifest import Source, align, source_columns
from dataplane.checksum import checksum

if TYPE_CHECKING:
    from control.client.context import RpcContext

DEFAULT_BATCH = 64 << 20
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


def buffer_name(name: str, slot: int) -> str:
    return f"{name}/slot{slot}"


def _is_model_buffer(name: str, buf_name: str | None) -> bool:
    return buf_name is not None and re.fullmatch(re.escape(name) + r"/slot\d+", buf_name) \
        is not None


def _batches(specs: Sequence[TensorSpec], limit: int) -> Iterator[list[TensorSpec]]:
    batch: list[TensorSpec] = []
    size = 0
    for s in specs:
        if batch and size + s.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(s)
        size += s.nbytes
    if batch:
        yield batch


class _KnownHashes:
    """This model's tensors' hashes from the client-side ``HashCache``: the
    file identities are taken once, before anything is read, and the cache is
    saved only if they are unchanged after the upload."""

    def __init__(self, model: ModelFile) -> None:
        self.model = model
        self.cache = HashCache()
        self.fkeys = [file_key(f) for f in model.files]
        self.hits = 0

    def _key(self, spec: TensorSpec) -> tuple[str, str]:
        file, offset = self.model.where(spec.name)
        return self.fkeys[file], tensor_key(spec.name, offset, spec.nbytes)

    def knows(self, spec: TensorSpec) -> bool:
        return self.cache.get(*self._key(spec)) is not None

    def lookup(self, batch: list[TensorSpec]) -> dict[str, tuple[int, int]]:
        out = {}
        for s in batch:
            got = self.cache.get(*self._key(s))
            if got is not None:
                out[s.name] = got
        self.hits += len(out)
        return out

    def record(self, batch: list[TensorSpec], hashes: dict[str, tuple[int, int]]) -> None:
        for s in batch:
            if s.name in hashes:
                self.cache.put(*self._key(s), hashes[s.name])

    def save(self) -> None:
        try:
            same = [file_key(f) for f in self.model.files] == self.fkeys
        except OSError:
            same = False
        if same:  # else a file changed while it was read: its hashes may mix old and new
            for k in set(self.fkeys):
                self.cache.touch(k)
            self.cache.save()


def _read(model: ModelFile, batch: list[TensorSpec], known: _KnownHashes | None = None,
          ahead: dict[str, tuple[int, int]] | None = None
          ) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, int]]]:
    """The batch's arrays (memory-map views: nothing is read yet) and their
    hashes, computed only for the tensors neither ``ahead`` (``_HashAhead``)
    nor the hash cache knows."""
    arrays = model.read([s.name for s in batch])
    early = {n: ahead[n] for n in arrays if n in ahead} if ahead else {}
    cached = known.lookup([s for s in batch if s.name not in early]) \
        if known is not None else {}
    fresh = content_hashes({n: a for n, a in arrays.items()
                            if n not in cached and n not in early})
    if known is not None and (fresh or early):
        known.record(batch, {**early, **fresh})
    return arrays, {**cached, **early, **fresh}


class _HashAhead:
    """Hashes the model's tensors, in file order, in a worker thread while
    the nodes answer the buffer requests: a new buffer's fresh memory is
    backed before its request is answered (0.6-1 s per GiB on the 2-core
    VM), time in which this client would otherwise wait idle and then hash
    during the transfer, where both cores are busy.  ``stop`` ends it at
    its next tensor, so the upload waits for at most one tensor's hash;
    what it has not reached is hashed by the upload's read-ahead as before.
    Tensors the hash cache knows are skipped."""

    def __init__(self, model: ModelFile, known: _KnownHashes | None) -> None:
        self.hashes: dict[str, tuple[int, int]] = {}
        self._model, self._known = model, known
        self._stop = threading.Event()
        self._job = asyncio.ensure_future(asyncio.to_thread(self._run))

    def _run(self) -> None:
        known = self._known
        for group in _batches(self._model.tensors, DEFAULT_BATCH):
            todo = [s.name for s in group if known is None or not known.knows(s)]
            for n, a in (self._model.read(todo) if todo else {}).items():
                if self._stop.is_set():
                    return
                self.hashes.update(content_hashes({n: a}))

    async def finish(self) -> dict[str, tuple[int, int]]:
        """Wait until every tensor is hashed (a clone is decided by them);
        the hashes.  A file error ends it early: what it has."""
        await asyncio.wait([self._job])
        return self.hashes

    async def stop(self) -> dict[str, tuple[int, int]]:
        """Stop at the next tensor and wait for that (even when cancelled:
        the thread reads the model's mapping, which the caller closes after);
        the hashes so far."""
        self._stop.set()
        cancelled = False
        while not self._job.done():
            try:
                await asyncio.wait([self._job])
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError
        if not self._job.cancelled():
            self._job.exception()  # a file that vanished: the upload will say so
        return self.hashes


class Hashes(Protocol):
    """Tensors' hashes known before anything is read: the hash cache
    (``_KnownHashes``), a node-local load's hash manifest."""

    def lookup(self, batch: list[TensorSpec]) -> dict[str, tuple[int, int]]: ...


@dataclass
class _SlotJob:
    plan: PL.SlotPlan
    specs: list[TensorSpec]
    buffer_name: str
    buffer_id: str = ""
    created: bool = False
    cloned: bool = False  # made by ``clone_buffer`` from a buffer that held this plan
    released: bool = False  # created, then released by a failed load's cleanup
    # Its buffer's request or clone while on its way: it runs to its end even
    # when the load is cancelled meanwhile, and records what it made (``_make``).
    making: asyncio.Future[str] | None = None
    metadata: np.ndarray | None = None  # the model's metadata blob, on this node's first slot
    record: LR.LoadRecord | None = None  # this slot's load record, planned (``commit``)
    sums: dict[str, int] = field(default_factory=dict)  # verified checksums, for the commit
    held: dict[str, Any] | None = None  # a reused or cloned buffer's manifest when acquired
    expect: dict[str, int] | None = None  # every checksum, when known before the load
    inherited: bool = False  # its committed record already says what this load puts there

    @property
    def endpoint(self) -> str:
        return self.plan.slot.endpoint

    @property
    def record_offset(self) -> int:
        return _record_offset(self, slot_offsets(self))

    def layout(self) -> dict[str, int]:
        """Where each tensor of the slot goes, the metadata too."""
        offsets = slot_offsets(self)
        if self.metadata is not None:
            offsets[MD.META_TENSOR] = _metadata_offset(self, offsets)
        return offsets


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

            from control.client.progress import byte_columns

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
    """Upload the model at ``path`` across ``cluster``; see the module docstring.

    ``path`` may be a model ``open_model`` opened already (it is closed
    here); ``placement`` is a spec (``"0:prolog,epilog;1:20;2:all"``) or None for a
    split by free memory; ``name`` defaults to the file's stem; ``progress``
    shows rich progress bars on stderr when it is a terminal;
    ``on_progress(endpoint, done, total)`` is called after every batch;
    ``hash_cache`` (with ``dedup``) reuses the tensors' hashes remembered
    from an earlier upload of the unchanged file (``hashcache``), so a
    re-upload reads only what it sends.
    Raises BAD_REQUEST (bad spec, model does not fit, not a model file) before
    anything is requested; ``ClusterError`` naming each failed node otherwise
    (after releasing the buffers this call created)."""
    t0 = time.perf_counter()
    if batch_bytes <= 0:
        raise BadRequest("batch_bytes must be positive")
    model = path if isinstance(path, ModelFile) else await asyncio.to_thread(open_model, path)
    path = model.path
    is_dir = model.files[0] != Path(path)  # a directory of shards
    name = name or (Path(path).name if is_dir else Path(path).stem)
    if not name or len(name) > 200:
        raise BadRequest(f"bad model name {name!r}")
    known: _KnownHashes | None = None
    if dedup and hash_cache:
        try:
            known = await asyncio.to_thread(_KnownHashes, model)
        except OSError:
            known = None  # cannot stat the files: hash them
    hashing = _HashAhead(model, known)
    try:
        try:
            plan, existing, jobs = await place_and_acquire(
                cluster, name, [(t.name, t.nbytes) for t in model.tensors],
                model.by_name.__getitem__, MD.encode(model.format, model.metadata), placement,
                known, hashing if dedup else None)
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
            if known is not None:
                await asyncio.to_thread(known.save)
            await _release_stale(cluster, existing, name, {j.buffer_name for j in jobs})
            await CM.commit(cluster, jobs)  # PutEnd: only now is the model complete
        except BaseException:
            await CM.abort(cluster, jobs, existing)
            raise
    finally:
        model.close()
    return LoadResult(name, str(path), model.format, plan, stats, described(jobs),
                      time.perf_counter() - t0)


async def place_and_acquire(cluster: Cluster, name: str, sizes: list[tuple[str, int]],
                            spec_of: Callable[[str], TensorSpec], blob: np.ndarray,
                            placement: str | None, known: Hashes | None = None,
                            hashing: _HashAhead | None = None
                            ) -> tuple[PL.Placement, dict[str, list[dict[str, Any]]],
                                       list[_SlotJob]]:
    """Step 1 of a load, an upload's or a node-local one alike: the placement
    over the nodes' slots (this model's old buffers counted free, room left
    for the metadata ``blob``), a job per slot, its buffer reused or made."""
    slots = await cluster.slots()
    existing = await cluster.list_buffers()
    slots = _as_if_released(slots, existing, name)
    # room for a load record naming every tensor: any slot's is smaller
    most = LR.room(LR.plan(range(len(slots)), 0, [n for n, _ in sizes] + [MD.META_TENSOR],
                           LR.new_load_id()))
    plan = PL.plan(PL.Groups.of(sizes), _room_for_metadata(slots, blob, most), placement)
    jobs = [_SlotJob(p, [spec_of(n) for n in p.tensors], buffer_name(name, p.slot.slot))
            for p in plan.slots]
    _carry_metadata(jobs, blob)
    load, numbers = LR.new_load_id(), [p.slot.slot for p in plan.slots]
    for j in jobs:
        j.record = LR.plan(numbers, j.plan.slot.slot,
                           [s.name for s in j.specs] + sorted(_metadata_names(j)), load)
    try:
        await _acquire(cluster, jobs, existing, name, known, hashing)
        for j in jobs:
            got = known.lookup(j.specs) if known is not None else {}
            if hashing is not None and j.cloned:
                got = {**hashing.hashes, **got}  # a clone was decided by them
            if all(s.name in got for s in j.specs):
                j.expect = {s.name: got[s.name][1] for s in j.specs}
                if j.metadata is not None:
                    j.expect[MD.META_TENSOR] = checksum(j.metadata)
        await CM.start(cluster, jobs)  # PutStart, before any byte of a slot changes
    except BaseException:
        await CM.abort(cluster, jobs, existing)
        raise
    return plan, existing, jobs


def start_progress(jobs: list[_SlotJob], stats: dict[str, Any], show: bool,
                   callback: ProgressFn | None) -> _Progress:
    """Count each node's share into ``stats`` and start the progress bars."""
    for j in jobs:
        node = stats[j.plan.slot.endpoint]
        node.bytes_total += sum(s.nbytes for s in j.specs)
        node.tensors += len(j.specs)
        node.buffers.append(j.buffer_name)
    return _Progress({a: n.bytes_total for a, n in stats.items() if n.tensors}, show, callback)


def described(jobs: list[_SlotJob]) -> list[dict[str, Any]]:
    """What a load result says of each buffer."""
    return [{"name": j.buffer_name, "buffer_id": j.buffer_id, "slot": j.plan.slot.slot,
             "endpoint": j.plan.slot.endpoint, "device": j.plan.slot.key,
             "reused": not j.created, "cloned": j.cloned,
             **{k: v for k, v in j.plan.describe().items()
                if k in ("prolog", "epilog", "layers", "tensors", "nbytes")}} for j in jobs]


def _as_if_released(slots: list[PL.Slot], existing: dict[str, list[dict[str, Any]]],
                    name: str) -> list[PL.Slot]:
    """Count this model's old buffers as free: a re-load reuses or replaces them."""
    out = []
    for s in slots:
        mine = [b for b in existing.get(s.endpoint, []) if _is_model_buffer(name, b["name"])
                and b["device_type"] == s.device_type and b["device"] == s.device]
        held = sum(int(b["alloc_size"]) for b in mine)
        biggest = max((int(b["alloc_size"]) for b in mine), default=0)
        out.append(PL.Slot(s.slot, s.endpoint, s.device_type, s.device, s.free + held,
                           max(s.largest_free, biggest), s.allocator))
    return out


async def _acquire(cluster: Cluster, jobs: list[_SlotJob],
                   existing: dict[str, list[dict[str, Any]]], name: str,
                   known: Hashes | None = None,
                   hashing: _HashAhead | None = None) -> None:
    """Reuse, clone or request each slot's buffer; on any failure release
    what was created and raise ``ClusterError``.  A clone (``clone_buffer``:
    no copy, no fresh memory) when the node holds, under another name, a
    buffer whose manifest is exactly this slot's plan with these tensors'
    checksums (from the hash cache, ``known``; else, when such a buffer is
    there, from ``hashing`` once it has hashed the whole file); the upload
    then finds every tensor in place (and verifies that it is, by its
    hashes)."""
    errors: dict[str, RpcBufError] = {}
    for j in jobs:
        slot = j.plan.slot
        ctx = cluster[slot.endpoint]
        need = calculate_buffer_size([(s.shape, s.dtype) for s in j.specs], headroom=0.0) \
            + _metadata_bytes(j) + _record_bytes(j)
        old = next((b for b in existing.get(slot.endpoint, []) if b["name"] == j.buffer_name),
                   None)
        try:
            if old is not None:
                planned = {s.name for s in j.specs} | _metadata_names(j) | {LR.LOAD_TENSOR}
                fits = int(old["size"]) >= need and old["device_type"] == slot.device_type \
                    and old["device"] == slot.device
                held = old.get("tensors")
                if held is None:  # a listing without manifests
                    held = (await ctx.get_buffer_meta(str(old["buffer_id"])))["tensors"]
                if fits and set(held) <= planned:
                    j.buffer_id, j.held = str(old["buffer_id"]), dict(held)
                    continue
                await ctx.release_buffer(str(old["buffer_id"]))  # another layout: replace it
            src = None
            layout, candidates = _clone_candidates(existing.get(slot.endpoint, []), j, need)
            if candidates:  # laid out as this slot: a clone if the content is the same
                hashes = known.lookup(j.specs) if known is not None else {}
                if len(hashes) < len(j.specs) and hashing is not None:
                    hashes = {**await hashing.finish(), **hashes}  # hash the file first
                src = _clone_source(j, layout, candidates, hashes)
            if src is not None:
                try:
                    await _make(j, ctx.clone_buffer(src, name=j.buffer_name), cloned=True)
                    j.held = next(b["tensors"] for b in candidates if b["buffer_id"] == src)
                    continue
                except (NotFound, OutOfMemory, UnsupportedDevice):
                    pass  # released meanwhile, no block free, a GPU: request one instead
            await _make(j, ctx.request_buffer(need, device_type=slot.device_type,
                                              device=slot.device, name=j.buffer_name))
        except RpcBufError as exc:
            errors[slot.endpoint] = exc
            break
    if errors:
        cleaned = await CM.release_created(cluster, jobs)
        raise ClusterError.of("requesting buffers", errors, cleaned=cleaned)


async def _make(j: _SlotJob, making: Awaitable[str], cloned: bool = False) -> None:
    """Await ``making`` (the request or clone of ``j``'s buffer), shielded: if
    the load is cancelled meanwhile it still runs to its end, and the id it
    answers is recorded in ``j`` (``created``), so the cleanup releases
    exactly the buffer this load made, never another loader's of that name
    (``commit.abort`` waits for it first)."""
    fut = j.making = asyncio.ensure_future(making)

    def made(f: asyncio.Future[str]) -> None:
        j.making = None
        if not f.cancelled() and f.exception() is None:
            j.buffer_id, j.created = f.result(), True
            j.cloned = j.cloned or cloned

    fut.add_done_callback(made)
    await asyncio.shield(fut)


def _clone_candidates(bufs: list[dict[str, Any]], job: _SlotJob,
                      need: int) -> tuple[dict[str, tuple[int, int]], list[dict[str, Any]]]:
    """This slot's plan as ``{tensor: (offset, nbytes)}`` (the metadata
    tensor too where it carries it), and the buffers of ``bufs`` (one node's
    listing, manifests included) laid out exactly so: a clone of one holds
    this slot if its checksums are the tensors' too (``_clone_source``)."""
    slot = job.plan.slot
    offsets = slot_offsets(job)
    layout = {sp.name: (offsets[sp.name], sp.nbytes) for sp in job.specs}
    if job.metadata is not None:
        layout[MD.META_TENSOR] = (_metadata_offset(job, offsets), int(job.metadata.nbytes))
    out = []
    for b in bufs:
        try:
            held = {n: e for n, e in (b.get("tensors") or {}).items() if n != LR.LOAD_TENSOR}
            if (b.get("device_type") != slot.device_type or b.get("device") != slot.device
                    or int(b.get("size", 0)) < need or len(held) != len(layout)
                    or b.get("name") == job.buffer_name):
                continue
            if all(isinstance(e := held.get(n), dict) and (e.get("offset"), e.get("nbytes")) == w
                   for n, w in layout.items()) and isinstance(b.get("buffer_id"), str):
                out.append(b)
        except (AttributeError, TypeError, ValueError):
            continue  # a listing no daemon of ours sends: not a candidate
    return layout, out


def _clone_source(job: _SlotJob, layout: dict[str, tuple[int, int]],
                  candidates: list[dict[str, Any]],
                  hashes: dict[str, tuple[int, int]]) -> str | None:
    """The first candidate whose manifest has every tensor's checksum as
    ``hashes`` says (and the metadata's); None when any hash is unknown."""
    sums = {n: h[1] for n, h in hashes.items()}
    if job.metadata is not None:
        sums[MD.META_TENSOR] = checksum(job.metadata)
    if any(n not in sums for n in layout):
        return None
    for b in reversed(candidates):  # the newest first: the likeliest still indexed there
        held = b["tensors"]
        if all(held[n].get("checksum") == sums[n] for n in layout):
            return str(b["buffer_id"])
    return None


async def _upload(cluster: Cluster, model: ModelFile, jobs: list[_SlotJob],
                  stats: dict[str, NodeStats], bar: _Progress, batch_bytes: int,
                  dedup: bool, t0: float, known: _KnownHashes | None = None,
                  ahead: dict[str, tuple[int, int]] | None = None) -> None:
    failed = asyncio.Event()  # the other slots stop at their next batch

    async def one(j: _SlotJob) -> None:
        ctx = cluster[j.plan.slot.endpoint]
        node = stats[j.plan.slot.endpoint]
        offsets = slot_offsets(j)
        sums: dict[str, int] = {}
        batches = list(_batches(j.specs, batch_bytes))

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
            for k, batch in enumerate(batches):
                if failed.is_set():
                    return
                if reading is None:
                    reading = asyncio.ensure_future(asyncio.to_thread(_read, model, batch,
                                                                      known, ahead))
                arrays, hashes = await reading
                reading = None
                if k + 1 < len(batches):
                    reading = asyncio.ensure_future(asyncio.to_thread(
                        _read, model, batches[k + 1], known, ahead))
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


def _carry_metadata(jobs: list[_SlotJob], blob: np.ndarray) -> None:
    """The first slot of each node holds the model's metadata (``metadata``)."""
    seen: set[str] = set()
    for j in jobs:  # by slot number
        if j.plan.slot.endpoint not in seen:
            seen.add(j.plan.slot.endpoint)
            j.metadata = blob


def slot_offsets(job: _SlotJob) -> dict[str, int]:
    """Where each of the slot's tensors lies in its buffer: back to back, in
    plan order (an upload and a node-local load lay a slot out alike)."""
    return plan_layout({sp.name: sp for sp in job.specs}, {}, start=0)


def _metadata_offset(job: _SlotJob, offsets: dict[str, int]) -> int:
    """Where the metadata tensor goes: aligned, right after the slot's tensors."""
    return align(max((offsets[sp.name] + sp.nbytes for sp in job.specs), default=0), ALIGN)


def _metadata_bytes(job: _SlotJob) -> int:
    return 0 if job.metadata is None else align(job.metadata.nbytes, ALIGN)


def _record_offset(job: _SlotJob, offsets: dict[str, int]) -> int:
    """Where the load record goes (``commit``): after the tensors and the metadata."""
    return _metadata_offset(job, offsets) + _metadata_bytes(job)


def _record_bytes(job: _SlotJob) -> int:
    return 0 if job.record is None else LR.room(job.record)


def _metadata_names(job: _SlotJob) -> set[str]:
    return set() if job.metadata is None else {MD.META_TENSOR}


def _room_for_metadata(slots: list[PL.Slot], blob: np.ndarray, record: int = 0
                       ) -> list[PL.Slot]:
    """Slots as placement should see them: each less the metadata's aligned
    bytes (any may be a node's first slot, which holds it) and ``record``,
    the room its load record needs at most."""
    less = align(blob.nbytes, ALIGN) + record
    return [PL.Slot(s.slot, s.endpoint, s.device_type, s.device, max(0, s.free - less),
                    max(0, s.largest_free - less), s.allocator) for s in slots]


async def _store_metadata(ctx: RpcContext, job: _SlotJob, offsets: dict[str, int],
                          sums: dict[str, int]) -> None:
    """The metadata tensor of a slot that carries it, right after the slot's
    tensors (deduplicated: a re-load sends nothing); its checksum joins
    ``sums`` for the manifest check."""
    if job.metadata is None:
        return
    await ctx.store_tensors_dedup(job.buffer_id, {MD.META_TENSOR: job.metadata},
                                  {MD.META_TENSOR: _metadata_offset(job, offsets)}, "checksum")
    sums[MD.META_TENSOR] = checksum(job.metadata)


async def _check_manifest(ctx: RpcContext, job: _SlotJob, sums: dict[str, int]) -> None:
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
            if _is_model_buffer(name, b["name"]) and b["name"] not in keep:
                try:
                    await cluster[addr].release_buffer(str(b["buffer_id"]))
                except RpcBufError:
                    pass  # released meanwhile


async def unload_model(cluster: Cluster, name: str) -> dict[str, list[str]]:
    """Release every buffer ``f"{name}/slotN"`` on every node; return the names
    released per node.  Raises ``ClusterError`` for nodes that failed (after
    unloading from the others) and NOT_FOUND when no node held the model."""

    async def one(ctx: RpcContext) -> list[str]:
        done = []
        for b in await ctx.list_buffers():
            if _is_model_buffer(name, b["name"]):
                await ctx.release_buffer(str(b["buffer_id"]))
                done.append(str(b["name"]))
        return done

    got = await cluster.gather(one, "unload")
    if not any(got.values()):
        raise NotFound(f"no node holds a model named {name!r}", {"name": name})
    return got
