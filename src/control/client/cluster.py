"""Many nodes: one ``RpcContext`` per rpcbufd, addressed in endpoint order.

``Cluster.connect("h1:7700;h2:7700;h3:7700", token=...)`` opens a session with
every node at once (``await`` it, or use it with ``async with``).  The order
of the endpoint list is meaningful: slot ``i`` of a placement is the ``i``-th
device of that list (each node's devices in the order it lists them).

Failures are reported per node, never as one opaque error: an operation on
every node either returns ``{endpoint: result}`` or raises ``ClusterError``,
whose ``errors`` map each failed endpoint to its own ``RpcBufError`` (and
whose ``results`` keep what the other nodes answered).  ``each`` returns the
mixed map instead of raising, for callers that report per node (the CLI).
A node that cannot be reached makes ``connect`` fail, closing the sessions it
had opened, unless ``partial=True``: then the cluster keeps the reachable
nodes and ``cluster.errors`` says why the others are missing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from control.client.context import Opening, RpcContext
from control.client.model.placement import Slot
from control.wire.errors import BadRequest, RpcBufError

T = TypeVar("T")


class ClusterError(RpcBufError, wire=False):
    """One or more nodes failed; ``errors``: endpoint -> ``RpcBufError``.

    Raised on the client only (never sent on the wire).  ``results`` holds
    what the nodes that did not fail returned; ``details["nodes"]`` the
    failed nodes' errors in wire form."""

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
        return cls(f"{what} failed on {len(errors)} node(s): {names}", errors, results, details)


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """``"h1:7700;h2:7700"`` (or a list) -> ``["h1:7700", "h2:7700"]``, in order.
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
    """Sessions with several rpcbufd nodes; see the module docstring."""

    def __init__(self, nodes: dict[str, RpcContext],
                 errors: dict[str, RpcBufError] | None = None,
                 order: Sequence[str] | None = None) -> None:
        self.nodes = nodes  # endpoint -> context, in endpoint order
        self.errors = errors or {}  # endpoints that could not be reached (partial=True)
        self._order = list(order) if order is not None else [*nodes, *self.errors]
        self._closed = False

    @property
    def endpoints(self) -> list[str]:
        return list(self.nodes)

    def __getitem__(self, endpoint: str) -> RpcContext:
        return self.nodes[endpoint]

    def __len__(self) -> int:
        return len(self.nodes)

    @classmethod
    def connect(cls, endpoints: str | Sequence[str], token: str | Mapping[str, str], *,
                timeout: float | None = 30.0, partial: bool = False,
                max_inflight: int | None = None) -> ClusterConnector:
        """Open a session with every node (in parallel).

        ``token`` is one token for all nodes or ``{endpoint: token}`` (nodes
        with their own secrets).  Raises ``ClusterError`` naming each node
        that failed (AUTH_FAILED, CONNECTION_LOST, TIMEOUT ...), unless
        ``partial``; BAD_REQUEST for a bad endpoint list."""
        return ClusterConnector(parse_endpoints(endpoints), token, timeout, partial, max_inflight)

    @classmethod
    async def _open(cls, endpoints: list[str], token: str | Mapping[str, str],
                    timeout: float | None, partial: bool,
                    max_inflight: int | None) -> Cluster:
        def tok(addr: str) -> str:
            if isinstance(token, str):
                return token
            if addr not in token:
                raise BadRequest(f"no token for {addr}")
            return token[addr]

        async def one(addr: str) -> RpcContext | RpcBufError:
            try:
                return await RpcContext.connect(addr, tok(addr), timeout, max_inflight)
            except RpcBufError as exc:
                return exc

        got = await asyncio.gather(*(one(a) for a in endpoints))
        nodes = {a: c for a, c in zip(endpoints, got, strict=True) if isinstance(c, RpcContext)}
        errors = {a: e for a, e in zip(endpoints, got, strict=True)
                  if isinstance(e, RpcBufError)}
        if errors and not partial:
            await asyncio.gather(*(c.close() for c in nodes.values()), return_exceptions=True)
            raise ClusterError.of("connect", errors)
        return cls(nodes, errors, endpoints)

    # -- running one operation on every node -----------------------------------------

    async def each(self, fn: Callable[[RpcContext], Awaitable[T]],
                   endpoints: Sequence[str] | None = None) -> dict[str, T | RpcBufError]:
        """``fn(ctx)`` on every node at once; ``{endpoint: result or error}``.
        Nodes missing since ``connect(partial=True)`` appear with their error."""
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
        """Like ``each``, but raise ``ClusterError`` if any node failed."""
        got = await self.each(fn, endpoints)
        errors = {a: r for a, r in got.items() if isinstance(r, RpcBufError)}
        results: dict[str, T] = {a: r for a, r in got.items()
                                 if not isinstance(r, RpcBufError)}
        if errors:
            raise ClusterError.of(what, errors, results)
        return results

    # -- views ------------------------------------------------------------------------

    async def devices_by_node(self) -> dict[str, list[dict[str, Any]] | RpcBufError]:
        """``{endpoint: [device, ...] or error}``, in endpoint order; each device
        has ``slot``, ``endpoint``, ``node_id``, ``key``, ``total``, ``free``,
        ``largest_free``.  Slot numbers mean something only when every node
        answered (a failed node's devices cannot be counted): placement uses
        ``devices``, which raises instead."""
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
        """Every node's devices, in slot order (see ``devices_by_node``).
        Raises ``ClusterError`` naming each node that did not answer."""
        got = await self.devices_by_node()
        errors = {a: r for a, r in got.items() if isinstance(r, RpcBufError)}
        if errors:
            raise ClusterError.of("list_devices", errors,
                                  {a: r for a, r in got.items() if not isinstance(r, RpcBufError)})
        return [d for devs in got.values() if not isinstance(devs, RpcBufError) for d in devs]

    async def slots(self) -> list[Slot]:
        """The devices as placement slots. Raises ``ClusterError``."""
        return [Slot.from_device(d["slot"], d["endpoint"], d) for d in await self.devices()]

    async def list_buffers(self) -> dict[str, list[dict[str, Any]]]:
        """``{endpoint: this tenant's buffers}``. Raises ``ClusterError``."""
        return await self.gather(lambda c: c.list_buffers(), "list_buffers")

    # -- lifecycle ------------------------------------------------------------------------

    async def close(self) -> None:
        """Close every session (idempotent); session-scoped buffers are released,
        named ones (a loaded model's) stay."""
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(c.close() for c in self.nodes.values()), return_exceptions=True)

    aclose = close

    def abort(self) -> None:
        self._closed = True
        for c in self.nodes.values():
            c.abort()

    async def __aenter__(self) -> Cluster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class ClusterConnector(Opening["Cluster"]):
    """What ``Cluster.connect`` returns: ``await`` it, or use it with ``async with``."""

    def __init__(self, endpoints: list[str], token: str | Mapping[str, str],
                 timeout: float | None, partial: bool, max_inflight: int | None) -> None:
        super().__init__(lambda: Cluster._open(endpoints, token, timeout, partial, max_inflight))
