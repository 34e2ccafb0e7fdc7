"""Many nodes: one ``RpcContext`` per rpcbufd, addressed in endpoint order.

- The endpoint list's order is meaningful: slot ``i`` of a placement is the
  ``i``-th device of that list (each node's devices in its own order).
- Failures are per node: an op on every node returns ``{endpoint: result}``
  or raises ``ClusterError`` (``errors`` per failed node, ``results`` of
  the others); ``each`` returns the mixed map.  ``connect`` fails (closing
  what it opened) unless ``partial``, which keeps the reachable nodes.
- From the fleet registry ("etcd://..."), an entry proves nothing (anyone
  who can write the prefix can list an address): each node is dialed as
  ``rpcbuf.connect`` dials it, gets the token only once it proved it is a
  node, and is left out when its hello names another node id than its entry
  (``StaleEntry``).  ``need`` picks the nodes with the most free memory by
  the registry's figures; ``watch`` keeps the membership current.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from rpcbuf.control.client.context import Opening, RpcContext
from rpcbuf.control.client.discovery import (
    Change,
    Discovery,
    RegistryUnavailable,
    check_node,
    choose_by_free,
)
from rpcbuf.control.client.opening import TlsOption
from rpcbuf.control.fleet.etcd import EtcdOptions
from rpcbuf.control.wire.errors import BadRequest, RpcBufError
from rpcbuf.control.wire.membership import DEFAULT_CLUSTER, NodeRecord, is_registry

log = logging.getLogger("rpcbuf.cluster")

T = TypeVar("T")
Dial = Callable[[str, str], Awaitable[RpcContext]]  # (address, token) -> a session


class ClusterError(RpcBufError, wire=False):
    """One or more nodes failed (client only, never on the wire): ``errors``
    maps endpoint -> ``RpcBufError``, ``results`` what the others returned."""

    code = "CLUSTER_ERROR"

    def __init__(self, message: str, errors: Mapping[str, RpcBufError],
                 results: Mapping[str, Any] | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message, {**(details or {}),
                                   "nodes": {a: e.to_wire() for a, e in errors.items()}})
        self.errors = dict(errors)
        self.results = dict(results or {})

    @classmethod
    def of(cls, what: str, errors: Mapping[str, RpcBufError],
           results: Mapping[str, Any] | None = None, **details: Any) -> ClusterError:
        names = "; ".join(f"{a}: {e}" for a, e in errors.items())
        return cls(f"{what} failed on {len(errors)} node(s): {names}", errors, results,
                   {"what": what, **details})


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """``"h1:7700;h2:7700"`` (or a list) -> the endpoints in order.
    Raises BAD_REQUEST when empty or when an endpoint repeats."""
    items = endpoints.replace(",", ";").split(";") if isinstance(endpoints, str) \
        else list(endpoints)
    out = [e.strip() for e in items if e and e.strip()]
    if not out:
        raise BadRequest("no endpoints given (want 'host:port;host:port')")
    dupes = sorted({e for e in out if out.count(e) > 1})
    if dupes:
        raise BadRequest(f"endpoint(s) listed twice: {dupes}", {"duplicates": dupes})
    return out


class Cluster:
    """Sessions with several rpcbufd nodes."""

    def __init__(self, nodes: dict[str, RpcContext],
                 errors: dict[str, RpcBufError] | None = None,
                 order: Sequence[str] | None = None) -> None:
        self.nodes = nodes  # endpoint -> context, in endpoint order
        self.errors = errors or {}  # endpoints that could not be reached (partial=True)
        self._order = list(order) if order is not None else [*nodes, *self.errors]
        self._closed = False
        self.discovery: Discovery | None = None  # from a registry: its members
        self.records: dict[str, NodeRecord] = {}  # endpoint -> its registry entry
        self.warnings: list[str] = []  # e.g. the registry was away, the fallback list used
        # How connect dialed and with what token: ``add_node`` dials a later join alike.
        self._dial: Dial | None = None
        self._token: str | Mapping[str, str] = ""

    @property
    def endpoints(self) -> list[str]:
        return list(self.nodes)

    @property
    def listed(self) -> list[str]:
        """Every endpoint in order, connected or not, joined since included."""
        return list(self._order)

    def __getitem__(self, endpoint: str) -> RpcContext:
        return self.nodes[endpoint]

    def __len__(self) -> int:
        return len(self.nodes)

    @classmethod
    def connect(cls, endpoints: str | Sequence[str] | None, token: str | Mapping[str, str], *,
                timeout: float | None = 30.0, partial: bool = False,
                max_inflight: int | None = None, cluster: str = DEFAULT_CLUSTER,
                registry: EtcdOptions | None = None,
                fallback: str | Sequence[str] | None = None, need: int | None = None,
                watch: bool = False, tls: TlsOption = None,
                insecure: bool | None = None,
                same_host: bool | None = None) -> ClusterConnector:
        """Open a session with every node, in parallel.  ``token``: one for all,
        or ``{endpoint or node id: token}``.  ``endpoints`` "etcd://..." (or None
        and ``$RPCBUF_REGISTRY``): the registry's live members of ``cluster``;
        ``fallback``: a list for an unreachable registry.  ``tls``, ``insecure``,
        ``same_host``: ``rpcbuf.connect``'s, for every node (from a registry
        ``tls=True`` is BAD_REQUEST: a forged entry could name a host with a
        public certificate).  Raises ``ClusterError`` naming each failed node
        (unless ``partial``), BAD_REQUEST, ``RegistryUnavailable``."""
        if endpoints is None:
            endpoints = os.environ.get("RPCBUF_REGISTRY") or ""
            if not endpoints:
                raise BadRequest("no endpoints given and $RPCBUF_REGISTRY is not set")
        dial = functools.partial(RpcContext.connect, timeout=timeout,
                                 max_inflight=max_inflight, tls=tls, insecure=insecure,
                                 same_host=same_host)
        if isinstance(endpoints, str) and is_registry(endpoints):
            if tls is True:
                # Whoever may write the registry names the address: with every
                # public CA trusted, a certificate for a name of theirs passes.
                raise BadRequest("a registry's nodes must prove themselves with the "
                                 "cluster's own CA: pass tls='ca.pem' (or $RPCBUF_CA, an "
                                 "ssl.SSLContext), not tls=True (every public CA)",
                                 {"reason": "insecure_transport"})
            url = endpoints.strip()
            return ClusterConnector(lambda: cls._open_registry(
                url, token, dial, cluster, registry, fallback, need, watch))
        addrs = parse_endpoints(endpoints)
        return ClusterConnector(lambda: cls._open(addrs, token, dial, partial))

    @classmethod
    async def _open_registry(cls, url: str, token: str | Mapping[str, str], dial: Dial,
                             cluster: str, options: EtcdOptions | None,
                             fallback: str | Sequence[str] | None, need: int | None,
                             watch: bool) -> Cluster:
        discovery = Discovery(url, cluster, options)
        try:
            members = await discovery.read()
        except RegistryUnavailable as exc:
            await discovery.close()
            if fallback is None:
                raise
            why = f"{exc.message}; using the fallback list {fallback!r}"
            log.warning("%s", why)
            listed = await cls._open(parse_endpoints(fallback), token, dial, False)
            listed.warnings.append(why)
            return listed
        records = list(members.values())
        if need is not None:
            records = choose_by_free(records, need)
        if not records:
            await discovery.close()
            raise BadRequest(f"the registry {discovery.address} lists no live node in "
                             f"cluster {cluster!r}", {"registry": str(discovery.address)})

        def tok(rec: NodeRecord) -> str:
            if isinstance(token, str):
                return token
            got = token.get(rec.address) or token.get(rec.node_id)
            if got is None:
                raise BadRequest(f"no token for {rec.address} ({rec.node_id})")
            return got

        # Entries that name one address are one daemon: connect once, and keep
        # the entry whose node id its hello names (the others are refused).
        by_addr: dict[str, list[NodeRecord]] = {}
        for r in records:
            by_addr.setdefault(r.address, []).append(r)

        async def one(recs: list[NodeRecord]) -> tuple[RpcContext, NodeRecord] | RpcBufError:
            try:
                ctx = await dial(recs[0].address, tok(recs[0]))
            except RpcBufError as exc:
                return exc
            match = next((r for r in recs if r.node_id == ctx.node_id), None)
            for r in recs:
                if r is not match:
                    try:
                        check_node(r, ctx.node_id)
                    except RpcBufError as exc:
                        log.warning("registry entry refused: %s", exc)
                        if match is None:
                            await ctx.close()
                            return exc
            assert match is not None
            return ctx, match

        addrs = list(by_addr)
        got = dict(zip(addrs, await asyncio.gather(*(one(by_addr[a]) for a in addrs)),
                       strict=True))
        nodes = {a: g[0] for a, g in got.items() if isinstance(g, tuple)}
        errors = {a: g for a, g in got.items() if isinstance(g, RpcBufError)}
        for addr, err in errors.items():
            log.info("registry node %s left out: %s", addr, err)  # in cluster.errors
        if not nodes:
            await discovery.close()
            raise ClusterError.of("connect", errors, registry=str(discovery.address))
        out = cls(nodes, errors, list(nodes))
        out._dial, out._token = dial, token
        out.discovery = discovery
        out.records = {a: g[1] for a, g in got.items() if isinstance(g, tuple)}
        if watch:
            discovery.watch()
        return out

    # -- membership (from a registry) ------------------------------------------------

    def members(self) -> dict[str, NodeRecord]:
        """``{node_id: record}``: the registry's live members; empty without one."""
        return dict(self.discovery.members) if self.discovery is not None else {}

    async def changes(self) -> AsyncIterator[Change]:
        """Each node that joins, changes or leaves from now on."""
        if self.discovery is None:
            raise BadRequest("this cluster was not opened from a registry (etcd://...)")
        async for change in self.discovery.changes():
            yield change

    @classmethod
    async def _open(cls, endpoints: list[str], token: str | Mapping[str, str], dial: Dial,
                    partial: bool) -> Cluster:
        def tok(addr: str) -> str:
            if isinstance(token, str):
                return token
            if addr not in token:
                raise BadRequest(f"no token for {addr}")
            return token[addr]

        async def one(addr: str) -> RpcContext | RpcBufError:
            try:
                return await dial(addr, tok(addr))
            except RpcBufError as exc:
                return exc

        got = await asyncio.gather(*(one(a) for a in endpoints))
        nodes = {a: c for a, c in zip(endpoints, got, strict=True) if isinstance(c, RpcContext)}
        errors = {a: e for a, e in zip(endpoints, got, strict=True)
                  if isinstance(e, RpcBufError)}
        if errors and not partial:
            await asyncio.gather(*(c.close() for c in nodes.values()), return_exceptions=True)
            raise ClusterError.of("connect", errors)
        out = cls(nodes, errors, endpoints)
        out._dial, out._token = dial, token
        return out

    # -- nodes that join and leave (the key space, keyspace.py) ----------------------

    async def add_node(self, address: str, record: NodeRecord | None = None) -> RpcContext:
        """Open a session with one more node, dialed as ``connect`` dials;
        ``record`` must name the node id the daemon answers (``StaleEntry``).
        Raises what dialing raises."""
        if self._closed:
            raise BadRequest("this cluster is closed")
        if address in self.nodes:
            return self.nodes[address]
        if self._dial is None:
            raise BadRequest("this cluster was not opened by Cluster.connect")
        token = self._token
        if not isinstance(token, str):
            got = token.get(address) or (token.get(record.node_id) if record else None)
            if got is None:
                raise BadRequest(f"no token for {address}")
            token = got
        ctx = await self._dial(address, token)
        if record is not None:
            try:
                check_node(record, ctx.node_id)
            except RpcBufError:
                await ctx.close()
                raise
            self.records[address] = record
        if self._closed:  # closed while dialing
            ctx.abort()
            raise BadRequest("this cluster is closed")
        self.nodes[address] = ctx
        self.errors.pop(address, None)
        if address not in self._order:
            self._order.append(address)
        return ctx

    def drop_node(self, address: str, error: RpcBufError) -> None:
        """Take a node out of ``nodes`` (session aborted) until ``add_node``."""
        ctx = self.nodes.pop(address, None)
        if ctx is not None:
            ctx.abort()
        self.errors[address] = error

    def forget_node(self, address: str) -> None:
        """A node that left the membership: out of ``nodes``, ``errors`` and the order."""
        ctx = self.nodes.pop(address, None)
        if ctx is not None:
            ctx.abort()
        self.errors.pop(address, None)
        self.records.pop(address, None)
        if address in self._order:
            self._order.remove(address)

    # -- running one operation on every node -----------------------------------------

    async def each(self, fn: Callable[[RpcContext], Awaitable[T]],
                   endpoints: Sequence[str] | None = None) -> dict[str, T | RpcBufError]:
        """``fn(ctx)`` on every node at once; ``{endpoint: result or error}``."""
        addrs = self._order if endpoints is None else list(endpoints)

        async def one(addr: str) -> T | RpcBufError:
            if addr not in self.nodes:
                return self.errors.get(addr) or BadRequest(f"{addr} is not in this cluster")
            try:
                return await fn(self.nodes[addr])
            except RpcBufError as exc:
                return exc

        got = await asyncio.gather(*(one(a) for a in addrs))
        return dict(zip(addrs, got, strict=True))

    async def gather(self, fn: Callable[[RpcContext], Awaitable[T]], what: str = "operation",
                     endpoints: Sequence[str] | None = None) -> dict[str, T]:
        """``each``, raising ``ClusterError`` if any node failed."""
        got = await self.each(fn, endpoints)
        errors = {a: r for a, r in got.items() if isinstance(r, RpcBufError)}
        results: dict[str, T] = {a: r for a, r in got.items()
                                 if not isinstance(r, RpcBufError)}
        if errors:
            raise ClusterError.of(what, errors, results)
        return results

    # -- views ------------------------------------------------------------------------

    async def devices_by_node(self) -> dict[str, list[dict[str, Any]] | RpcBufError]:
        """``{endpoint: [device, ...] or error}``, in endpoint order (slot
        numbers hold only when every node answered: placement uses ``devices``)."""
        got = await self.each(lambda c: c.list_devices())
        slot = 0
        out: dict[str, list[dict[str, Any]] | RpcBufError] = {}
        for addr, devs in got.items():
            if isinstance(devs, RpcBufError):
                out[addr] = devs
                continue
            node = self.nodes[addr].node_id
            rows = []
            for d in devs:
                rows.append({**d, "slot": slot, "endpoint": addr, "node_id": node})
                slot += 1
            out[addr] = rows
        return out

    async def devices(self) -> list[dict[str, Any]]:
        """Every node's devices, in slot order.  Raises ``ClusterError``."""
        got = await self.devices_by_node()
        errors = {a: r for a, r in got.items() if isinstance(r, RpcBufError)}
        if errors:
            raise ClusterError.of("list_devices", errors,
                                  {a: r for a, r in got.items() if not isinstance(r, RpcBufError)})
        return [d for devs in got.values() if not isinstance(devs, RpcBufError) for d in devs]

    async def list_buffers(self) -> dict[str, list[dict[str, Any]]]:
        """``{endpoint: this tenant's buffers}``.  Raises ``ClusterError``."""
        return await self.gather(lambda c: c.list_buffers(), "list_buffers")

    # -- lifecycle ------------------------------------------------------------------------

    async def close(self) -> None:
        """Close every session (idempotent); named buffers stay."""
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(c.close() for c in self.nodes.values()), return_exceptions=True)
        if self.discovery is not None:
            await self.discovery.close()

    aclose = close

    def abort(self) -> None:
        """Close at once, waiting for nothing (idempotent)."""
        self._closed = True
        if self.discovery is not None and self.discovery._task is not None:
            self.discovery._task.cancel()
        for c in self.nodes.values():
            c.abort()

    async def __aenter__(self) -> Cluster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class ClusterConnector(Opening["Cluster"]):
    """What ``Cluster.connect`` returns: awaited or used with ``async with``."""
