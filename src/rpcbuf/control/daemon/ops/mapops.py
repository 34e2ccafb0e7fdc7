"""Buffers written in place by their owner (same host): ``map_buffer`` and
``unmap_buffer``, and the daemon's side of each write grant.

``map_buffer`` hands the session a writable fd of one host buffer of its
own tenant (a memfd not sealed read-only, ``HostArena.make_writable``) and a
slot of the session's grant page; the client copies in and out with no
round trip, inside the slot's lock, while the slot is LIVE.

* only the buffer's tenant can map it (else NOT_FOUND), never a KV block;
  one session holds a buffer's grant at a time; an attached one is BUSY;
  a GPU buffer only explicitly (its VMM handle: kernels take no lock);
* an implicit grant is taken back before any daemon op touches the bytes
  (REVOKED, then the client's copy in flight is waited for, ``REVOKE_WAIT``
  at most, else BUSY); an explicit one (``ctx.map``) cannot be taken back:
  other sessions' ops on the buffer are BUSY until it ends;
* a buffer ever mapped writable is never trusted by the content index; an
  attach or clone first seals it read-only again (``seal``);
* a release ends the grant at once (ENDED); the pages stay the client's,
  never reused, charged to the tenant until the session ends;
* every opening and ending is audited (``map``, ``unmap``).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from rpcbuf.control.daemon.accounting.registry import Buffer, Pool
from rpcbuf.control.daemon.data.handles import HandleChannel
from rpcbuf.control.daemon.data.pipeline import Call, Ops, Pipeline, unlock
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import (
    BadRequest,
    Busy,
    ConnectionLost,
    NotFound,
    OutOfMemory,
    QuotaExceeded,
    UnsupportedDevice,
)
from rpcbuf.dataplane.arena import host_memory
from rpcbuf.dataplane.cuda_vmm import CudaError, NoHandleSharing
from rpcbuf.dataplane.grants import ENDED, LIVE, REVOKED, SLOT, GrantPage

MAX_MAPPED = 256  # buffers one session holds grants of (slots of its page)
REVOKE_WAIT = 1.0  # seconds a take-back waits for the client's copy in flight
GRANT_PAGE_BYTES = MAX_MAPPED * SLOT  # one page of slots per session that maps
GRANT_TAG = 1 << 61  # handles' tags: above every request id, below attachops.MAP_TAG


def handle_channel(holder: Ops, what: str) -> HandleChannel:
    """The session's handle channel, which ``what`` (an op: "attach needs")
    needs; BAD_REQUEST (reason ``not_same_host``) for a session without one."""
    channel = holder.handles
    if channel is None:
        raise BadRequest(f"{what} the same-host path (a client on the daemon's host, on its "
                         "Unix socket)", {"reason": "not_same_host"})
    return channel


class WriteGrant:
    """One buffer's live grant: which session's page, which slot."""

    __slots__ = ("explicit", "grants", "slot")

    def __init__(self, grants: WriteGrants, slot: int, explicit: bool) -> None:
        self.grants, self.slot, self.explicit = grants, slot, explicit

    async def take_back(self, buf: Buffer, session_id: str) -> None:
        """Before an op of ``session_id`` touches ``buf``'s bytes (its
        range locked): an implicit grant is revoked, its copy in flight
        waited for; an explicit one is BUSY for any other session."""
        if self.explicit:
            if session_id == self.grants.session_id:
                return
            raise Busy(f"buffer {buf.buffer_id} is mapped writable by another session; "
                       "it cannot be used until that mapping ends",
                       {"buffer_id": buf.buffer_id, "reason": "mapped"})
        await self.grants.revoke(buf, self)

    def end(self, buf: Buffer) -> None:
        """The buffer is released: the client stops at its next copy."""
        page = self.grants.page
        if page is not None:
            page.set_state(self.slot, ENDED)
        self.grants.ended(buf)


class WriteGrants:
    """One session's grants (its page, a slot per buffer it mapped)."""

    def __init__(self, holder: Ops, pipeline: Pipeline) -> None:
        self._holder, self._pipe = holder, pipeline
        self.page: GrantPage | None = None
        self._page_charge: Pool | None = None  # where the page is charged
        self._slots: dict[str, tuple[Buffer, int]] = {}  # buffer id -> (buffer, slot)
        self._exported: dict[str, Buffer] = {}  # charged until the session ends
        self._tags = 0

    @property
    def session_id(self) -> str:
        return self._holder.session_id

    async def map(self, call: Call, req: P.MapBuffer) -> dict[str, Any]:
        channel = handle_channel(self._holder, "map_buffer needs")
        buf = call.held.get(req.buffer_id)  # pinned now; only the tenant's own
        host = host_memory(buf.pool.arena)
        if host is None and not req.explicit:  # a kernel's writes take no lock of ours
            raise UnsupportedDevice(f"buffer {buf.buffer_id} is device memory: the verbs "
                                    "write it over UCX (ctx.map maps it)")
        # The whole buffer, exclusively: stores in flight finish first, its
        # dedup entries go, a clone gets memory of its own, another
        # session's implicit grant is taken back (``take_back``), and an
        # attached buffer is BUSY.
        if buf.tensors and not req.explicit:
            # Its recorded tensors are the content index's: a store through
            # the daemon drops exactly the bytes it changes, a grant the lot.
            raise BadRequest(f"buffer {buf.buffer_id} holds recorded tensors: its stores go "
                             "through the daemon", {"reason": "indexed"})
        grants = await self._pipe.lock(call.held, buf, [(0, buf.alloc_size)], True,
                                       writes=False)
        try:
            if buf.released:
                raise NotFound(f"no buffer {buf.buffer_id!r}")
            zero = not buf.written  # never written since it was backed: nothing to copy
            buf.written = True
            buf.trusted = False  # written behind the pipeline from now on
            if host is None:  # a GPU buffer: its CUDA VMM handle, imported writable
                return await self._grant(buf, _device_export(buf), True, channel, 0)
            if not host.writable(buf.offset):
                try:
                    await self._pipe.in_thread(0 if zero else buf.alloc_size,
                                               host.make_writable, buf.offset,
                                               buf.alloc_size, zero)
                except OSError as exc:
                    raise OutOfMemory(f"cannot map buffer {buf.buffer_id} writable: "
                                      f"{exc.strerror or exc}", {"reason": "backing"}) from None
            answer = await self._grant(buf, host.export_writable, req.explicit, channel,
                                       req.have)
        finally:
            unlock(grants)
        return answer

    async def _grant(self, buf: Buffer, export: Any, explicit: bool,
                     channel: HandleChannel, have: int) -> dict[str, Any]:
        holder = self._holder
        arena = buf.pool.arena
        answer: dict[str, Any] = {"size": buf.size, "alloc_size": buf.alloc_size,
                                  "page": None, "handle": None,
                                  "device_type": arena.device_type, "device": arena.device}
        if self.page is None:
            # The page is the tenant's memory while the session lives, as the
            # staging area is: charged (QUOTA_EXCEEDED: nothing made) until close.
            pool = holder.registry.host_pool()
            if pool is not None:
                holder.registry.charge(holder.owner, pool, GRANT_PAGE_BYTES)
            try:
                page = GrantPage.create(MAX_MAPPED)
            except BaseException:
                if pool is not None:
                    holder.registry.uncharge(holder.owner, pool, GRANT_PAGE_BYTES)
                raise
            self.page, self._page_charge = page, pool
            answer["page"] = [await self._send(channel, page.fd, page.size), page.size]
        page = self.page
        got = self._slots.get(buf.buffer_id)
        if got is None or got[0] is not buf:
            for bid in [k for k, (b, _) in self._slots.items() if b.released]:
                del self._slots[bid]  # a released buffer's slot: free (a new generation)
            if len(self._slots) >= page.slots:
                raise QuotaExceeded(f"a session may map at most {MAX_MAPPED} buffers "
                                    "writable", {"limit": "mapped"})
            used = {s for _, s in self._slots.values()}
            slot = next(i for i in range(page.slots) if i not in used)
        else:
            slot = got[1]
        fd = export(buf.offset, buf.alloc_size)
        try:
            # Unless the client maps this very memfd already (what it says:
            # lying costs only itself), a handle; a GPU buffer's always (the
            # client closes its import with each mapping).
            if host_memory(arena) is None or have != os.fstat(fd).st_ino:
                answer["handle"] = [await self._send(channel, fd, buf.alloc_size),
                                    buf.alloc_size]
        finally:
            os.close(fd)
        self._slots[buf.buffer_id] = (buf, slot)
        if buf.buffer_id not in self._exported:
            holder.registry.export(buf)
            self._exported[buf.buffer_id] = buf
        answer["gen"] = page.grant(slot)
        buf.mapped = WriteGrant(self, slot, explicit)
        holder.audit("map", buf, 0, buf.size,
                     note=f"writable {'explicit' if explicit else 'implicit'}")
        answer["slot"] = slot
        return answer

    async def _send(self, channel: HandleChannel, fd: int, nbytes: int) -> int:
        self._tags += 1
        tag = GRANT_TAG + self._tags
        try:
            await channel.send(tag, nbytes, fd)
        except (OSError, TimeoutError) as exc:
            raise ConnectionLost(f"the handle channel failed: {exc}") from None
        return tag

    def unmap(self, req: P.UnmapBuffer) -> dict[str, Any]:
        got = self._slots.get(req.buffer_id) if isinstance(req.buffer_id, str) else None
        if got is None:
            raise NotFound(f"this session has not mapped {req.buffer_id!r}")
        buf, slot = got
        grant = buf.mapped
        if grant is not None and grant.grants is self and grant.slot == slot:
            assert self.page is not None
            self.page.set_state(slot, REVOKED)
            buf.mapped = None
            self._holder.audit("unmap", buf, 0, buf.size, note="closed")
        return {}

    async def revoke(self, buf: Buffer, grant: WriteGrant) -> None:
        """Take ``grant`` back from this session's client: REVOKED, then
        the slot's lock taken once (no copy in flight any more).  BUSY when
        the client holds it past ``REVOKE_WAIT`` (it stays REVOKED)."""
        page = self.page
        assert page is not None
        page.set_state(grant.slot, REVOKED)
        deadline = time.monotonic() + REVOKE_WAIT
        delay = 1e-5
        while not page.take(grant.slot):
            if time.monotonic() > deadline:
                raise Busy(f"buffer {buf.buffer_id} is being written in place; try again",
                           {"buffer_id": buf.buffer_id, "reason": "mapped"})
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.005)
        page.give(grant.slot)
        if buf.mapped is grant:
            buf.mapped = None
            self._holder.audit("unmap", buf, 0, buf.size, note="revoked")

    def ended(self, buf: Buffer) -> None:
        self._holder.audit("unmap", buf, 0, buf.size, note="released")

    def mapped(self) -> int:
        """How many buffers this session holds live grants of."""
        return sum(1 for b, s in self._slots.values()
                   if b.mapped is not None and b.mapped.grants is self)

    def close(self) -> None:
        """The session ends: every grant with it, and the charges."""
        for buf, slot in self._slots.values():
            grant = buf.mapped
            if grant is not None and grant.grants is self and grant.slot == slot:
                buf.mapped = None
                self._holder.audit("unmap", buf, 0, buf.size, note="session closed")
        self._slots.clear()
        exported, self._exported = self._exported, {}
        for buf in exported.values():
            self._holder.registry.unexport(buf)
        if self.page is not None:
            self.page.close()
            self.page = None
        if self._page_charge is not None:
            self._holder.registry.uncharge(self._holder.owner, self._page_charge,
                                           GRANT_PAGE_BYTES)
            self._page_charge = None


def _device_export(buf: Buffer) -> Any:
    """``arena.export`` of a GPU buffer, its refusals as UNSUPPORTED_DEVICE."""
    def export(offset: int, nbytes: int) -> int:
        try:
            return int(buf.pool.arena.export(offset, nbytes))
        except (NoHandleSharing, CudaError) as exc:  # a GPU without VMM handles
            raise UnsupportedDevice(f"buffers on {buf.pool.key} cannot be mapped: "
                                    f"{exc}") from None
    return export


def seal(buf: Buffer) -> None:
    """Before ``buf``'s memfd is shared read-only (attach, clone), under a lock
    that took its grants back: a memfd handed out writable is resealed
    read-only (no copy).  BUSY while an explicit grant is live.  The buffer
    stays untrusted by the content index."""
    host = host_memory(buf.pool.arena)
    if host is None or not host.writable(buf.offset):
        return
    if buf.mapped is not None:
        raise Busy(f"buffer {buf.buffer_id} is mapped writable (ctx.map); unmap it first",
                   {"buffer_id": buf.buffer_id, "reason": "mapped"})
    try:
        host.reseal(buf.offset, buf.alloc_size)
    except OSError:  # its writer added F_SEAL_SEAL itself: it cannot be handed out read-only
        raise BadRequest(f"buffer {buf.buffer_id} was sealed by the process writing it in "
                         "place; it cannot be shared read-only",
                         {"buffer_id": buf.buffer_id, "reason": "sealed"}) from None


__all__ = ["ENDED", "LIVE", "MAX_MAPPED", "WriteGrant", "WriteGrants",
           "handle_channel", "seal"]
