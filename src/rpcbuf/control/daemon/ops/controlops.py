"""The quick control ops of a session: request a buffer (and wait for memory),
metadata, open by name, renew, release, list devices and buffers, stats,
ping.  All but the wait for memory decide synchronously and answer at once,
so they may use the plain registry lookup (no await follows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

from rpcbuf.control.daemon.accounting import prefault
from rpcbuf.control.daemon.accounting.backing import zero_on_demand
from rpcbuf.control.daemon.accounting.registry import Buffer, Waiter
from rpcbuf.control.daemon.data.pipeline import Call, Ops
from rpcbuf.control.daemon.observe import logs
from rpcbuf.control.daemon.ops.node import Node
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, NotFound, RpcBufError
from rpcbuf.dataplane.arena import host_ram
from rpcbuf.dataplane.ucx import rdma_devices

RENEW_AUDIT_EVERY = 10.0  # seconds between audit records of one buffer's renews



class ControlOps:
    """The quick ops of one session (``owner``) on ``node``."""

    def __init__(self, owner: Ops, node: Node) -> None:
        self._owner, self._node, self._registry = owner, node, node.registry

    def try_request(self, req: P.RequestBuffer) -> Buffer | None:
        """The buffer, if it can be had now; None: wait (``wait_for_memory``)."""
        pool = self._registry.pool_for(req.device_type, req.device)
        if req.ttl is not None and req.ttl <= 0:
            raise BadRequest("ttl must be positive")
        return self._registry.try_allocate(self._owner.owner, pool, req.size, name=req.name,
                                          ttl=req.ttl, session_id=self._owner.session_id)

    def granted(self, buf: Buffer) -> dict[str, Any]:
        self._owner.audit("request_buffer", buf, note=f"size={buf.size}")
        if buf.expires_at is not None:
            self._node.schedule_expiry()
        return buf.meta()

    @staticmethod
    def ready_now(buf: Buffer) -> bool:
        """Whether ``buf`` can be answered at once: nothing to pre-fault or
        zero."""
        return buf.zeroed is None and not prefault.wanted(buf.pool.arena, buf.size, buf.offset)

    async def granted_ready(self, call: Call, buf: Buffer) -> dict[str, Any]:
        """``granted`` once the new buffer's pages are backed, or on a kept block
        once it is zeroed; pinned meanwhile.  Granted before the wait, so a
        request that ends first leaves it as a lost answer would."""
        if not call.held.keep(buf):
            raise NotFound(f"no buffer {buf.buffer_id!r}")  # released by name meanwhile
        try:
            if buf.zeroed is not None:  # a kept block: backed, being zeroed (registry)
                await self._zeroed(buf, buf.zeroed)
            else:  # nothing to do for a block kept backed (``prefault.wanted``)
                await prefault.populate(buf.pool.arena, buf.offset, buf.size,
                                        self._node.sweeps, buf.tenant)
        finally:
            meta = self.granted(buf)
        if buf.released:
            raise NotFound(f"no buffer {buf.buffer_id!r}")
        return meta

    async def _zeroed(self, buf: Buffer, zeroed: asyncio.Future[None]) -> None:
        """Wait, at most ``prefault.BUDGET``, until ``buf``'s kept block is zero:
        the rest of it is zeroed now on the tenant's ``sweeps`` (the zeroer would
        take it last).  Past the deadline the answer goes anyway: the buffer stays
        locked until its block is zero, so nothing ever reads the old bytes."""
        zero_on_demand(buf, self._node.sweeps)
        with contextlib.suppress(TimeoutError):  # answered now, the block still locked
            await asyncio.wait_for(asyncio.shield(zeroed), prefault.BUDGET)

    async def request(self, call: Call, req: P.RequestBuffer) -> dict[str, Any]:
        """``request_buffer``: at once when memory is there and ready, after its
        pages are backed or zeroed, or once memory comes free."""
        buf = self.try_request(req)
        if buf is None:
            return await self.wait_for_memory(call, req)
        if self.ready_now(buf):
            return self.granted(buf)
        return await self.granted_ready(call, buf)

    async def wait_for_memory(self, call: Call, req: P.RequestBuffer) -> dict[str, Any]:
        """A request_buffer that could not be granted at once: queue (first
        come, first served) for at most ``req.timeout``; OUT_OF_MEMORY."""
        pool = self._registry.pool_for(req.device_type, req.device)
        if not req.timeout:
            raise self._registry.out_of_memory(pool, req.size)
        fut: asyncio.Future[Buffer] = asyncio.get_running_loop().create_future()

        def done(buf: Buffer | None, err: RpcBufError | None) -> None:
            if fut.done():  # we gave up in the meantime: hand the memory back
                if buf is not None:
                    self._registry.release(buf)
                return
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(buf)  # type: ignore[arg-type]

        waiter = Waiter(self._owner.owner, pool, req.size,
                        {"name": req.name, "ttl": req.ttl,
                         "session_id": self._owner.session_id}, done)
        self._registry.enqueue(waiter)
        try:
            buf = await asyncio.wait_for(asyncio.shield(fut), req.timeout)
        except TimeoutError:
            self._registry.cancel(waiter)
            if fut.done() and not fut.exception():
                return self.granted(fut.result())  # granted at the last moment
            raise self._registry.out_of_memory(pool, req.size) from None
        except BaseException:
            self._registry.cancel(waiter)
            if fut.done() and not fut.cancelled() and not fut.exception():
                self._registry.release(fut.result())
            raise
        return await self.granted_ready(call, buf)

    def _get(self, buffer_id: str) -> Buffer:
        return self._registry.get(self._owner.owner, buffer_id)

    def meta(self, req: P.GetBufferMeta) -> dict[str, Any]:
        return self._get(req.buffer_id).meta(tensors=req.tensors)

    def open(self, req: P.OpenBuffer) -> dict[str, Any]:
        return self._registry.by_name(self._owner.owner, req.name).meta()

    def release(self, req: P.Release) -> dict[str, Any]:
        buf = self._get(req.buffer_id)
        self._registry.release(buf)
        self._owner.audit("release", buf, note="deferred until transfers end and readers "
                          "detach" if buf.pins else "")
        self._node.schedule_expiry()
        return {"buffer_id": buf.buffer_id}

    def renew(self, req: P.Renew) -> dict[str, Any]:
        buf = self._get(req.buffer_id)
        if req.ttl is not None and req.ttl <= 0:
            raise BadRequest("ttl must be positive")
        self._registry.renew(buf, req.ttl)
        # Renews are coalesced in the audit trail: one record per buffer per
        # RENEW_AUDIT_EVERY seconds, saying how many it stands for (a renew
        # storm must not grow the log; the last lease is always in the meta).
        now = time.monotonic()
        if now - buf.renew_logged_at >= RENEW_AUDIT_EVERY:
            also = f" (+{buf.renews_unlogged} renews since the last record)" \
                if buf.renews_unlogged else ""
            self._owner.audit("renew", buf, note=f"expires_at={buf.expires_at}{also}")
            buf.renew_logged_at, buf.renews_unlogged = now, 0
        else:
            buf.renews_unlogged += 1
            logs.quiet()
        self._node.schedule_expiry()
        return {"buffer_id": buf.buffer_id, "expires_at": buf.expires_at}

    def list_devices(self, req: P.ListDevices) -> dict[str, Any]:
        return {"node_id": self._node.node_id,
                "devices": [p.describe() for p in self._registry.pools.values()]}

    def list_buffers(self, req: P.ListBuffers) -> dict[str, Any]:
        return {"buffers": [b.meta() for b in self._registry.buffers_of(self._owner.owner)
                            if b.block_key is None]}  # blocks: block_list

    def stats(self, req: P.Stats) -> dict[str, Any]:
        """What a tenant may see: its own sessions, buffers, bytes, waiters and
        counters, each device's size and free bytes; nothing of other tenants."""
        tenant = self._owner.owner
        mine = [s for s in self._node.sessions.values() if s.tenant == tenant]
        blocks = self._node.blocks.stats(tenant)
        held = self._registry.stats(tenant)
        counters = {"bytes_stored": 0, "bytes_read": 0, "verify_failures": 0,
                    "bytes_loaded_local": 0,
                    **self._node.tenant_counters.get(tenant, {})}
        return {"node_id": self._node.node_id, "uptime": time.time() - self._node.started_at,
                "sessions": len(mine),
                "same_host_sessions": sum(1 for s in mine if s.ops.same_host is not None),
                # node-wide, but about no tenant: connections not yet authenticated
                "unauthenticated": len(self._node.unauthenticated),
                "pending_endpoints": len(self._node.pending_endpoints),
                # node-wide: UCX messages no request asked for, dropped once old
                "ucx_unexpected_dropped": self._node.janitor.dropped
                if self._node.janitor is not None else None,
                # how this node's data plane is set up (rpcbuf doctor shows it)
                "ucx_tls": os.environ.get("UCX_TLS", ""),
                "rdma_devices": rdma_devices(),
                "host_ram": host_ram(),  # (doctor: host arenas past it)
                "listening": self._node.listening,
                "ucx": self._node.ucx_library,
                **counters, "expired_total": self._registry.expired_of(tenant),
                "blocks": blocks, **held,
                # the buffers ``list_buffers`` shows; what the quota counts
                # (buffers and blocks) is ``limits["buffers"]``
                "buffers": max(0, held["buffers"] - blocks["blocks"])}

    def ping(self, req: P.Ping) -> dict[str, Any]:
        """The node's clock (``rpcbuf doctor`` compares it with the client's)."""
        return {"time": time.time()}
