"""Each slot's buffer: reused (its name holds part of the slot's plan already),
cloned on its node from a buffer holding exactly these tensors (nothing sent),
or requested.  A request or clone runs to its end even when the load is
cancelled, and what it made is recorded on the slot, so cleanup releases
exactly what this load created.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from rpcbuf.control.client.cluster import Cluster, ClusterError
from rpcbuf.control.client.tensors import calculate_buffer_size
from rpcbuf.control.wire.errors import NotFound, OutOfMemory, RpcBufError, UnsupportedDevice
from rpcbuf.dataplane.checksum import checksum
from rpcbuf.models import commit as CM, metadata as MD, placement as PL, record as LR
from rpcbuf.models.reading import HashAhead, HashLookup
from rpcbuf.models.slots import (
    SlotJob,
    is_model_buffer,
    metadata_bytes,
    metadata_names,
    metadata_offset,
    record_bytes,
    slot_offsets,
)


def as_if_released(slots: list[PL.Slot], existing: dict[str, list[dict[str, Any]]],
                    name: str) -> list[PL.Slot]:
    """Count this model's old buffers as free: a re-load reuses or replaces them."""
    out = []
    for s in slots:
        mine = [b for b in existing.get(s.endpoint, []) if is_model_buffer(name, b["name"])
                and b["device_type"] == s.device_type and b["device"] == s.device]
        held = sum(int(b["alloc_size"]) for b in mine)
        biggest = max((int(b["alloc_size"]) for b in mine), default=0)
        out.append(PL.Slot(s.slot, s.endpoint, s.device_type, s.device, s.free + held,
                           max(s.largest_free, biggest), s.allocator))
    return out


async def acquire(cluster: Cluster, jobs: list[SlotJob],
                   existing: dict[str, list[dict[str, Any]]], name: str,
                   known: HashLookup | None = None,
                   hashing: HashAhead | None = None) -> None:
    """Reuse, clone or request each slot's buffer; on any failure release what
    was created and raise ``ClusterError``.  A clone when the node holds, under
    another name, a buffer whose manifest is this slot's plan with these checksums
    (``known``, else ``hashing`` once it has hashed the whole file)."""
    errors: dict[str, RpcBufError] = {}
    for j in jobs:
        slot = j.plan.slot
        ctx = cluster[slot.endpoint]
        need = calculate_buffer_size([(s.shape, s.dtype) for s in j.specs], headroom=0.0) \
            + metadata_bytes(j) + record_bytes(j)
        old = next((b for b in existing.get(slot.endpoint, []) if b["name"] == j.buffer_name),
                   None)
        try:
            if old is not None:
                planned = {s.name for s in j.specs} | metadata_names(j) | {LR.LOAD_TENSOR}
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
            layout, candidates = clone_candidates(existing.get(slot.endpoint, []), j, need)
            if candidates:  # laid out as this slot: a clone if the content is the same
                hashes = known(j.specs) if known is not None else {}
                if len(hashes) < len(j.specs) and hashing is not None:
                    hashes = {**await hashing.finish(), **hashes}  # hash the file first
                src = clone_source(j, layout, candidates, hashes)
            if src is not None:
                try:
                    await make(j, ctx.clone_buffer(src, name=j.buffer_name), cloned=True)
                    j.held = next(b["tensors"] for b in candidates if b["buffer_id"] == src)
                    continue
                except (NotFound, OutOfMemory, UnsupportedDevice):
                    pass  # released meanwhile, no block free, a GPU: request one instead
            await make(j, ctx.request_buffer(need, device_type=slot.device_type,
                                              device=slot.device, name=j.buffer_name))
        except RpcBufError as exc:
            errors[slot.endpoint] = exc
            break
    if errors:
        cleaned = await CM.release_created(cluster, jobs)
        raise ClusterError.of("requesting buffers", errors, cleaned=cleaned)


async def make(j: SlotJob, making: Awaitable[str], cloned: bool = False) -> None:
    """Await ``making``, shielded: cancelled meanwhile, it still ends and its id
    is recorded in ``j``, so cleanup releases exactly this load's buffer, never
    another loader's of that name."""
    fut = j.making = asyncio.ensure_future(making)

    def made(f: asyncio.Future[str]) -> None:
        j.making = None
        if not f.cancelled() and f.exception() is None:
            j.buffer_id, j.created = f.result(), True
            j.cloned = j.cloned or cloned

    fut.add_done_callback(made)
    await asyncio.shield(fut)


def clone_candidates(bufs: list[dict[str, Any]], job: SlotJob,
                      need: int) -> tuple[dict[str, tuple[int, int]], list[dict[str, Any]]]:
    """This slot's plan as ``{tensor: (offset, nbytes)}``, and the buffers of
    ``bufs`` (one node's listing) laid out exactly so."""
    slot = job.plan.slot
    offsets = slot_offsets(job)
    layout = {sp.name: (offsets[sp.name], sp.nbytes) for sp in job.specs}
    if job.metadata is not None:
        layout[MD.META_TENSOR] = (metadata_offset(job, offsets), int(job.metadata.nbytes))
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


def clone_source(job: SlotJob, layout: dict[str, tuple[int, int]],
                  candidates: list[dict[str, Any]],
                  hashes: dict[str, tuple[int, int]]) -> str | None:
    """The first candidate whose manifest has every checksum ``hashes`` says;
    None when any hash is unknown."""
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
