"""The cluster's key space: keyed blocks spread over the live nodes.

Placement is rendezvous hashing (``rendezvous.py``) over the live nodes:
every client computes the same order from the same membership, and a node
that leaves moves only its own keys.

- A put goes to each key's first ``replicas`` live nodes; a read asks each
  key's first live node, then (a miss) the next.  One request per node per
  batch, all nodes at once, each within ``timeout``.
- A node that stops answering (CONNECTION_LOST, SHUTTING_DOWN, TIMEOUT)
  leaves the live set and is dialed again in the background while listed:
  its keys are misses, never errors.  A token refusal raises, always; any
  other error raises ``ClusterError`` after the other nodes finished.
- A put is all or nothing per node, not across nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from rpcbuf.control.client.blockops import check_keys, get_targets, put_pairs
from rpcbuf.control.client.cluster import Cluster, ClusterError, parse_endpoints
from rpcbuf.control.client.context import RpcContext
from rpcbuf.control.client.opening import Opening, TlsOption
from rpcbuf.control.client.rendezvous import node_seed, ranks
from rpcbuf.control.fleet.etcd import EtcdOptions
from rpcbuf.control.wire.errors import (
    AuthFailed,
    BadRequest,
    ConnectionLost,
    Forbidden,
    RpcBufError,
    ShuttingDown,
    Timeout,
    TokenExpired,
)
from rpcbuf.control.wire.membership import DEFAULT_CLUSTER, NodeRecord

log = logging.getLogger("rpcbuf.keyspace")
T = TypeVar("T")
RECONNECT = (1.0, 5.0)  # s: first and largest wait before dialing a lost node again
GONE = (ConnectionLost, ShuttingDown, Timeout)  # a node that is gone: its keys are misses
REFUSED = (AuthFailed, TokenExpired, Forbidden)  # a token refused: an error, never a miss
MAX_REPLICAS = 16


class BlockCluster:
    """Keyed blocks over the live nodes of a cluster."""

    def __init__(self, cluster: Cluster, replicas: int = 1, timeout: float = 30.0,
                 reconnect: tuple[float, float] = RECONNECT) -> None:
        if not 1 <= replicas <= MAX_REPLICAS:
            raise BadRequest(f"replicas must be 1 to {MAX_REPLICAS}, not {replicas}")
        self.cluster = cluster
        self.replicas = replicas
        self.timeout = timeout
        self.reconnect = reconnect  # s: first and largest wait before dialing a lost node
        # The membership (address -> its registry record, None from a list): the
        # nodes dialed again while lost; the live ones are ``cluster.nodes``.
        self._wanted: dict[str, NodeRecord | None] = {}
        self._seeds: dict[str, int] = {}
        self._revivers: dict[str, asyncio.Task[None]] = {}
        self._refused: RpcBufError | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._closed = False

    # -- opening ----------------------------------------------------------------------

    @classmethod
    def connect(cls, endpoints: str | Sequence[str] | None, token: str | Mapping[str, str], *,
                replicas: int = 1, timeout: float = 30.0, cluster: str = DEFAULT_CLUSTER,
                registry: EtcdOptions | None = None, tls: TlsOption = None,
                insecure: bool | None = None, same_host: bool | None = None,
                reconnect: tuple[float, float] = RECONNECT) -> Opening[BlockCluster]:
        """The key space of ``endpoints`` ("h1:7700;h2:7700", a list, or
        "etcd://h:2379", followed while open).  A node that cannot be reached is
        dialed again in the background (``reconnect``: first wait, cap).  Raises a
        token refusal, ``ClusterError`` when no node answers, BAD_REQUEST for a
        bad list or ``replicas`` (1 to 16)."""
        if not 1 <= replicas <= MAX_REPLICAS:
            raise BadRequest(f"replicas must be 1 to {MAX_REPLICAS}, not {replicas}")
        opening = Cluster.connect(endpoints, token, timeout=timeout, partial=True,
                                  cluster=cluster, registry=registry, watch=True, tls=tls,
                                  insecure=insecure, same_host=same_host)

        async def open_() -> BlockCluster:
            try:
                nodes = await opening
            except ClusterError as exc:  # none answered: a refusal among them says so
                refused = next((e for e in exc.errors.values() if isinstance(e, REFUSED)), None)
                if refused is not None:
                    raise refused from None
                raise
            out = cls(nodes, replicas, timeout, reconnect)
            try:
                await out._start()
            except BaseException:
                await out.close()
                raise
            return out

        return Opening(open_)

    async def _start(self) -> None:
        c = self.cluster
        refused = next((e for e in c.errors.values() if isinstance(e, REFUSED)), None)
        if refused is not None:
            raise refused
        if not c.nodes:
            raise ClusterError.of("connect", c.errors)
        self._seeds = {a: node_seed(a) for a in c.nodes}
        if c.discovery is not None:
            queue = c.discovery.subscribe()
            self._reconcile({r.address: r for r in c.members().values()}, now=False)
            self._watcher = asyncio.create_task(self._follow(queue), name="rpcbuf-keyspace")
        else:
            self._reconcile({a: None for a in c.listed}, now=False)
        for addr in c.nodes:
            log.info("key space: %s live", addr)

    # -- membership -------------------------------------------------------------------

    @property
    def live(self) -> list[str]:
        return list(self._seeds)

    @property
    def members(self) -> list[str]:
        """Every node listed, live or being dialed again."""
        return list(self._wanted)

    async def set_endpoints(self, endpoints: str | Sequence[str]) -> None:
        """A new endpoint list: nodes no longer listed leave at once; new ones
        are dialed now.  Raises a token refusal."""
        if self.cluster.discovery is not None:
            raise BadRequest("this key space follows a registry: its membership is etcd's")
        await asyncio.gather(*self._reconcile({a: None for a in parse_endpoints(endpoints)}))
        self._check()

    async def refresh(self) -> None:
        """Read the registry's members now and dial each member not live, once."""
        d = self.cluster.discovery
        wanted: dict[str, NodeRecord | None]
        if d is not None:
            await d.read()
            wanted = {r.address: r for r in d.members.values()}
        else:
            wanted = dict(self._wanted)
        await asyncio.gather(*self._reconcile(wanted))
        self._check()

    def _reconcile(self, wanted: Mapping[str, NodeRecord | None],
                   now: bool = True) -> list[Awaitable[None]]:
        """Make ``wanted`` the membership; who is not live is dialed by the
        awaitables returned (``now``) or in the background."""
        for addr in [a for a in self._wanted if a not in wanted]:
            self._leave(addr)
        self._wanted = dict(wanted)
        missing = [a for a in wanted if a not in self.cluster.nodes]
        if not now:
            for a in missing:
                self._revive(a, self.reconnect[0])
            return []
        return [self._dial_now(a) for a in missing]

    def _leave(self, addr: str) -> None:
        self._wanted.pop(addr, None)
        self._seeds.pop(addr, None)
        task = self._revivers.pop(addr, None)
        if task is not None:
            task.cancel()
        self.cluster.forget_node(addr)
        log.info("key space: %s left the membership", addr)

    async def _follow(self, queue: asyncio.Queue[Any]) -> None:
        d = self.cluster.discovery
        assert d is not None
        try:
            while True:
                await queue.get()
                while not queue.empty():
                    queue.get_nowait()
                await asyncio.gather(*self._reconcile(
                    {r.address: r for r in d.members.values()}))
        finally:
            d.unsubscribe(queue)

    def _revive(self, addr: str, delay: float) -> None:
        task = self._revivers.get(addr)
        if task is None or task.done():
            self._revivers[addr] = asyncio.create_task(
                self._dial_again(addr, delay), name=f"rpcbuf-keyspace-dial {addr}")

    async def _dial_now(self, addr: str) -> None:
        """One try now; when it fails, the background dialing."""
        task = self._revivers.pop(addr, None)
        if task is not None:
            task.cancel()
        if not await self._try(addr) and not isinstance(self.cluster.errors.get(addr), REFUSED):
            self._revive(addr, self.reconnect[0])

    async def _try(self, addr: str) -> bool:
        """Dial ``addr`` once; whether it is live now (a refusal is kept)."""
        if self._closed or addr not in self._wanted:
            return False
        if addr in self.cluster.nodes:
            return True
        try:
            await self.cluster.add_node(addr, self._wanted[addr])
        except REFUSED as exc:
            log.error("key space: %s refused the token: %s", addr, exc)
            self._refused = exc
            self.cluster.errors[addr] = exc
            return False
        except RpcBufError as exc:
            log.debug("key space: %s still away: %s", addr, exc)
            self.cluster.errors[addr] = exc
            return False
        self._seeds[addr] = node_seed(addr)
        log.info("key space: %s live (joined or back)", addr)
        return True

    async def _dial_again(self, addr: str, wait: float) -> None:
        """Dial after ``wait``, doubling, until live, refused, or no member."""
        try:
            while not self._closed and addr in self._wanted and addr not in self.cluster.nodes:
                await asyncio.sleep(wait)
                wait = min(max(wait * 2, self.reconnect[0]), self.reconnect[1])
                if await self._try(addr) or isinstance(self.cluster.errors.get(addr), REFUSED):
                    return
        finally:
            if self._revivers.get(addr) is asyncio.current_task():
                del self._revivers[addr]

    def _down(self, addr: str, exc: RpcBufError) -> None:
        if addr not in self._seeds:
            return
        log.warning("key space: %s is gone (%s): its keys are misses until it is back",
                    addr, exc)
        del self._seeds[addr]
        self.cluster.drop_node(addr, exc)
        if not self._closed and addr in self._wanted:
            self._revive(addr, self.reconnect[0])

    def _check(self) -> None:
        if self._closed:
            raise ConnectionLost("this key space is closed")
        if self._refused is not None:
            raise self._refused

    # -- one request per node ---------------------------------------------------------

    async def _on(self, addr: str, fn: Callable[[RpcContext], Awaitable[T]]
                  ) -> T | RpcBufError:
        """``fn`` on ``addr``'s session within ``timeout``: its answer or error."""
        ctx = self.cluster.nodes.get(addr)
        if ctx is None:
            return ConnectionLost(f"{addr} is not live")
        try:
            async with asyncio.timeout(self.timeout):
                return await fn(ctx)
        except TimeoutError:
            exc: RpcBufError = Timeout(f"{addr} did not answer within {self.timeout}s")
        except RpcBufError as err:
            exc = err
        if isinstance(exc, GONE):
            self._down(addr, exc)
        elif isinstance(exc, REFUSED):
            self._refused = exc
        return exc

    async def _fan(self, plan: Mapping[str, list[int]],
                   fn: Callable[[RpcContext, list[int]], Awaitable[T]]
                   ) -> dict[str, T | RpcBufError]:
        def bound(idx: list[int]) -> Callable[[RpcContext], Awaitable[T]]:
            return lambda c: fn(c, idx)

        addrs = [a for a, idx in plan.items() if idx]
        if len(addrs) == 1:  # one node (a cluster of one): no task to make
            return {addrs[0]: await self._on(addrs[0], bound(plan[addrs[0]]))}
        got = await asyncio.gather(*(self._on(a, bound(plan[a])) for a in addrs))
        return dict(zip(addrs, got, strict=True))

    def _raise(self, what: str, got: Mapping[str, Any]) -> None:
        """Raise a refusal as itself, another error but a gone node's as ``ClusterError``."""
        self._check()
        errors = {a: r for a, r in got.items()
                  if isinstance(r, RpcBufError) and not isinstance(r, GONE)}
        if errors:
            raise ClusterError.of(what, errors, {a: r for a, r in got.items()
                                                 if not isinstance(r, RpcBufError)})

    # -- the block verbs --------------------------------------------------------------

    async def put_blocks(self, blocks: Mapping[str, Any] | Sequence[tuple[str, Any]],
                         ttl: float | None = None, metas: Sequence[bytes] | None = None,
                         replicas: int | None = None) -> dict[str, Any]:
        """``RpcContext.put_blocks`` over the cluster: each block on its key's
        first ``replicas`` live nodes.  Returns ``{"stored", "dropped", "nodes",
        "placed"}``.  Raises BAD_REQUEST (before anything is sent), a token
        refusal, or ``ClusterError`` naming each node that refused its part."""
        self._check()
        keys, arrays = put_pairs(blocks)
        if metas is not None and len(metas) != len(keys):
            raise BadRequest(f"{len(keys)} keys and {len(metas)} metas")
        r = self.replicas if replicas is None else replicas
        if not 1 <= r <= MAX_REPLICAS:
            raise BadRequest(f"replicas must be 1 to {MAX_REPLICAS}, not {r}")
        order = ranks(keys, self._seeds)  # each key's live nodes, best first
        nxt = [min(r, len(o)) for o in order]  # each key's next spare node
        plan: dict[str, list[int]] = {}
        for i, o in enumerate(order):
            for a in o[:r]:
                plan.setdefault(a, []).append(i)
        placed: dict[int, list[str]] = {}
        answers: dict[str, Any] = {}
        errors: dict[str, Any] = {}

        async def put(c: RpcContext, idx: list[int]) -> dict[str, Any]:
            return await c.put_blocks([(keys[i], arrays[i]) for i in idx], ttl,
                                      None if metas is None else [metas[i] for i in idx])

        while plan:
            got = await self._fan(plan, put)
            again: dict[str, list[int]] = {}
            for addr, res in got.items():
                if not isinstance(res, RpcBufError):
                    answers[addr] = res
                    for i in plan[addr]:
                        placed.setdefault(i, []).append(addr)
                    continue
                if not isinstance(res, GONE):
                    errors[addr] = res
                    continue
                for i in plan[addr]:  # the node is gone: the key's next live node
                    while nxt[i] < len(order[i]):
                        spare = order[i][nxt[i]]
                        nxt[i] += 1
                        if spare in self._seeds:
                            again.setdefault(spare, []).append(i)
                            break
            plan = again
        self._raise("put_blocks", errors)
        dropped = [keys[i] for i in range(len(keys)) if i not in placed]
        if dropped:
            log.warning("key space: %d block(s) dropped: no live node took them", len(dropped))
        return {"stored": len(placed), "dropped": dropped, "nodes": answers,
                "placed": {keys[i]: a for i, a in sorted(placed.items())}}

    async def put_block(self, key: str, array: Any, ttl: float | None = None,
                        meta: bytes | None = None, replicas: int | None = None
                        ) -> dict[str, Any]:
        """``put_blocks`` of one block."""
        return await self.put_blocks([(key, array)], ttl, None if meta is None else [meta],
                                     replicas)

    async def _walk(self, keys: list[str], ask: Callable[[RpcContext, list[int]],
                                                         Awaitable[list[T]]],
                    hit: Callable[[T], bool], what: str) -> list[T | None]:
        """Each key's first ``replicas`` live nodes in turn, one request per
        node per round, until a hit; None where every one missed."""
        order = ranks(keys, self._seeds, self.replicas)
        out: list[T | None] = [None] * len(keys)
        at = [0] * len(keys)
        todo = range(len(keys))
        while todo:
            seeds = self._seeds  # (locals: this loop runs once a key)
            plan: dict[str, list[int]] = {}
            for i in todo:
                o, a = order[i], at[i]
                while a < len(o) and o[a] not in seeds:
                    a += 1  # gone since: its next node
                at[i] = a
                if a < len(o):
                    plan.setdefault(o[a], []).append(i)
            got = await self._fan(plan, ask)
            self._raise(what, got)
            again: list[int] = []
            for addr, res in got.items():
                idx = plan[addr]
                if isinstance(res, RpcBufError):
                    again += idx
                    continue
                for i, r in zip(idx, res, strict=True):
                    if hit(r):
                        out[i] = r
                    else:
                        again.append(i)
            for i in again:
                at[i] += 1
            todo = again  # type: ignore[assignment]
        return out

    async def get_blocks(self, keys: Sequence[str], out: Sequence[Any],
                         strict: bool = False) -> list[bool]:
        """``RpcContext.get_blocks`` over the cluster: each key from its first
        live node that has it.  Raises BAD_REQUEST, a token refusal, ``ClusterError``."""
        self._check()
        keys, out = get_targets(keys, out)

        async def get(c: RpcContext, idx: list[int]) -> list[bool]:
            return await c.get_blocks([keys[i] for i in idx], [out[i] for i in idx], strict)

        got = await self._walk(keys, get, bool, "get_blocks")
        return [bool(g) for g in got]

    async def lookup_blocks(self, keys: Sequence[str], meta: bool = False
                            ) -> list[dict[str, Any] | None]:
        """``RpcContext.lookup_blocks`` over the cluster; a gone node's keys are None."""
        self._check()
        keys = check_keys(keys)

        async def look(c: RpcContext, idx: list[int]) -> list[dict[str, Any] | None]:
            return await c.lookup_blocks([keys[i] for i in idx], meta=meta)

        return await self._walk(keys, look, lambda info: info is not None, "lookup_blocks")

    async def blocks_exist(self, keys: Sequence[str]) -> list[bool]:
        return [info is not None for info in await self.lookup_blocks(keys)]

    async def remove_blocks(self, keys: Sequence[str]) -> int:
        """Remove the keys from every live node (after a join a key may sit on a
        node that no longer ranks first); return how many blocks were removed."""
        self._check()
        keys = check_keys(keys)
        every = list(range(len(keys)))
        got = await self._fan({a: every for a in self._seeds},
                              lambda c, _: c.remove_blocks(keys))
        self._raise("remove_blocks", got)
        return sum(n for n in got.values() if isinstance(n, int))

    async def list_blocks(self, prefix: str | None = None, start_after: str | None = None,
                          limit: int = 1000) -> tuple[list[str], bool]:
        """``RpcContext.list_blocks`` over the live nodes: keys merged, sorted,
        each once."""
        self._check()
        got = await self._fan({a: [0] for a in self._seeds},
                              lambda c, _: c.list_blocks(prefix, start_after, limit))
        self._raise("list_blocks", got)
        pages = [p for p in got.values() if not isinstance(p, RpcBufError)]
        merged = sorted({k for keys, _ in pages for k in keys})
        more = len(merged) > limit or any(m for _, m in pages)
        return merged[:limit], more

    async def ping(self) -> int:
        """Ping every live node; how many answered (a refusal raises)."""
        self._check()
        got = await self._fan({a: [0] for a in self._seeds}, lambda c, _: c.ping())
        self._raise("ping", got)
        return sum(1 for r in got.values() if not isinstance(r, RpcBufError))

    # -- lifecycle --------------------------------------------------------------------

    async def close(self) -> None:
        """Stop following the membership and close every session (idempotent)."""
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in [self._watcher, *self._revivers.values()] if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.cluster.close()

    aclose = close

    async def __aenter__(self) -> BlockCluster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
