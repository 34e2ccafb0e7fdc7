"""Attach and detach: a local reader uses a buffer's bytes in place.

``attach`` hands the session, on its handle channel, a read-only fd of one
host buffer (exactly its block: ``HostArena.export``) and makes it attached:

* the attachment holds a pin: a release takes the buffer out of every view
  at once but frees its memory (still charged) only at the last detach;
* writes into it are BUSY (checked under the range lock), so mapped bytes
  never change; attach itself takes a shared lock of the whole buffer, so
  it never hands out a half-written buffer, nor a clone's memfd that is
  about to be replaced (``Pipeline.own``);
* a KV block (``block_attach``) hands out its tenant's segment, read-only,
  with the block's ``offset`` in it: the reader can map that tenant's other
  blocks and free slots, never another tenant's bytes;
* ``hand_segments`` hands a session writable handles of its own tenant's
  segments only (anything else: RuntimeError, nothing sent), each once per
  session, audited (``map_segment``).

Only the buffer's tenant can attach (anyone else: NOT_FOUND); at most
``MAX_ATTACHED`` per session; all end with the session.  The daemon cannot
see a reader's ``dup`` of a handle, so a buffer handed out stays charged to
its tenant until that session ends (``Registry.export``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from rpcbuf.control.daemon.accounting.registry import Buffer
from rpcbuf.control.daemon.data.pipeline import Call, Ops, Pipeline, unlock
from rpcbuf.control.daemon.ops.mapops import handle_channel, seal
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import (
    BadRequest,
    ConnectionLost,
    NotFound,
    QuotaExceeded,
    UnsupportedDevice,
)
from rpcbuf.dataplane.arena import host_memory
from rpcbuf.dataplane.cuda_vmm import CudaError, NoHandleSharing

log = logging.getLogger("rpcbuf.daemon")
MAX_ATTACHED = 1024  # attachments per session (each is an fd and a mapping in the client)
MAX_NEW_MAPS = 32  # segment handles one answer sends (the client's inbox holds 64 records)
MAP_TAG = 1 << 62  # segment handles' tags: above every request id


class AttachOps:
    """One session's attachments."""

    def __init__(self, owner: Ops, pipeline: Pipeline) -> None:
        self._owner, self._pipe = owner, pipeline
        self._attached: dict[str, tuple[Buffer, int]] = {}  # buffer id -> (buffer, count)
        # Buffers this session was handed an fd of, attached or not any more:
        # charged to their tenant until the session ends (``Registry.export``).
        self._exported: dict[str, Buffer] = {}
        self._mapped: dict[str, Buffer] = {}  # segments handed writable (``hand_segments``)
        self._tags = 0

    async def attach(self, call: Call, req: P.Attach) -> dict[str, Any]:
        handle_channel(self._owner, "attach needs")  # before the lookup: BAD_REQUEST first
        return await self.attach_buffer(call, call.held.get(req.buffer_id))  # pinned now

    async def attach_buffer(self, call: Call, buf: Buffer) -> dict[str, Any]:
        """``attach`` of a buffer the request holds pinned already (a block,
        found by its key: ``blockops``)."""
        owner = self._owner
        channel = handle_channel(owner, "attach needs")
        export = buf.pool.arena.export  # a GPU arena without handles raises UNSUPPORTED_DEVICE
        # A block of the KV tier has no memfd of its own: its tenant's segment
        # is handed out, read-only, and the answer says where in it the block
        # lies (docs/kvcache.md: what such a reader can see).
        mem = buf.segment or buf
        if sum(n for _, n in self._attached.values()) >= MAX_ATTACHED:
            raise QuotaExceeded(f"a session may hold at most {MAX_ATTACHED} attachments",
                                {"limit": "attachments"})
        grants = await self._pipe.lock(call.held, buf, [(0, buf.size)], False, forget=False)
        try:
            if buf.owning is not None:  # a copy of its own (``Pipeline.own``) that outlived
                await asyncio.wait([buf.owning])  # its writer: hand out the memfd it ends with
            if buf.released:
                raise NotFound(f"no buffer {buf.buffer_id!r}")
            if mem is buf:  # once written in place: a sealed copy goes out (mapops)
                seal(buf)
            try:
                fd = export(mem.offset, mem.alloc_size)
            except (NoHandleSharing, CudaError) as exc:  # a GPU without VMM handles
                raise UnsupportedDevice(f"buffers on {buf.pool.key} cannot be attached: "
                                        f"{exc}") from None
            try:
                self._take(buf)  # before the record leaves: a detach may follow at once
                if mem.buffer_id not in self._exported:  # the fd may arrive, sent or not
                    self._owner.registry.export(mem)
                    self._exported[mem.buffer_id] = mem
                try:
                    await channel.send(call.req_id, mem.alloc_size, fd)
                except (OSError, TimeoutError) as exc:
                    self._drop(buf)
                    raise ConnectionLost(f"the handle channel failed: {exc}") from None
            finally:
                os.close(fd)
        finally:
            unlock(grants)
        owner.audit("attach", buf, 0, buf.size, note=f"attached={buf.attached}")
        return {"buffer_id": buf.buffer_id, "size": buf.size, "alloc_size": mem.alloc_size,
                "offset": buf.offset - mem.offset,
                "device_type": buf.pool.arena.device_type, "device": buf.pool.arena.device,
                "tensors": buf.tensors, "manifest_version": buf.manifest_version}

    def check_same_host(self) -> None:
        handle_channel(self._owner, "blocks in place need")

    async def hand_segments(self, call: Call, segs: list[Buffer]
                            ) -> tuple[list[str], list[int], list[list[Any]]]:
        """The distinct segments of ``segs`` (their ids), each entry's index among
        them, and ``[id, tag, size]`` for each not yet handed to this session (its
        fd sent now).  BAD_REQUEST (reason ``segments``) past ``MAX_NEW_MAPS``."""
        owner = self._owner
        channel = handle_channel(owner, "blocks in place need")
        tenant = owner.owner
        ids: dict[str, int] = {}
        which: list[int] = []
        new: list[Buffer] = []
        for seg in segs:
            i = ids.get(seg.buffer_id)
            if i is None:
                if seg.tenant != tenant:  # never another tenant's memory
                    raise RuntimeError(f"segment {seg.buffer_id} is not {tenant!r}'s")
                i = ids[seg.buffer_id] = len(ids)
                if seg.buffer_id not in self._mapped:
                    new.append(seg)
            which.append(i)
        if len(new) > MAX_NEW_MAPS:
            raise BadRequest(f"{len(new)} segments to map at once, at most {MAX_NEW_MAPS}",
                             {"reason": "segments"})
        maps: list[list[Any]] = []
        for seg in new:
            host = host_memory(seg.pool.arena)
            assert host is not None  # blocks live in host memory
            fd = host.export_writable(seg.offset, seg.alloc_size)
            try:
                self._tags += 1
                tag = MAP_TAG + self._tags
                self._mapped[seg.buffer_id] = seg
                if seg.buffer_id not in self._exported:  # charged until the session ends
                    owner.registry.export(seg)
                    self._exported[seg.buffer_id] = seg
                try:
                    await channel.send(tag, seg.alloc_size, fd)
                except (OSError, TimeoutError) as exc:
                    raise ConnectionLost(f"the handle channel failed: {exc}") from None
            finally:
                os.close(fd)
            owner.audit("map_segment", seg, 0, seg.alloc_size, note="writable")
            maps.append([seg.buffer_id, tag, seg.alloc_size])
        return list(ids), which, maps

    def detach(self, req: P.Detach) -> dict[str, Any]:
        got = self._attached.get(req.buffer_id) if isinstance(req.buffer_id, str) else None
        if got is None:
            raise NotFound(f"this session has not attached {req.buffer_id!r}")
        buf = got[0]
        self._drop(buf)
        self._owner.audit("detach", buf, 0, buf.size, note=f"attached={buf.attached}")
        return {"attached": buf.attached}

    def detach_all(self) -> None:
        """The session ends: every attachment with it, and the charge for
        memory its client may still hold a dup of."""
        for buf, count in list(self._attached.values()):
            for _ in range(count):
                self._drop(buf)
            self._owner.audit("detach", buf, 0, buf.size, note="session closed")
        mapped, self._mapped = self._mapped, {}
        for seg in mapped.values():
            self._owner.audit("unmap_segment", seg, 0, seg.alloc_size, note="session closed")
        exported, self._exported = self._exported, {}
        for buf in exported.values():
            self._owner.registry.unexport(buf)

    def _take(self, buf: Buffer) -> None:
        self._owner.registry.pin(buf)
        buf.attached += 1
        count = self._attached.get(buf.buffer_id, (buf, 0))[1]
        self._attached[buf.buffer_id] = (buf, count + 1)

    def _drop(self, buf: Buffer) -> None:
        _, count = self._attached[buf.buffer_id]
        if count == 1:
            del self._attached[buf.buffer_id]
        else:
            self._attached[buf.buffer_id] = (buf, count - 1)
        buf.attached -= 1
        self._owner.registry.unpin(buf)  # the last one frees a released buffer
