"""Finding the live nodes of a cluster in the fleet registry (etcd).

- ``read()`` is one snapshot, ``{node_id: NodeRecord}``; ``watch()`` keeps
  it current and tells subscribers each ``Change``.  A record that does not
  parse is skipped with a warning, never trusted.
- A broken watch lists the prefix again once etcd answers (backoff
  ``BACKOFF``), reports the difference, and watches on from that revision:
  every join and leave is seen once.  While etcd is away the snapshot stays
  (``stale``).
- A record is a claim, not a proof: the dialer checks the peer as for any
  address, and ``check_node`` that its hello names the record's node id.
  This holds only for a CA that signs nothing but the cluster's nodes;
  ``insecure`` trusts the network and whoever can write the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

from rpcbuf.control.fleet.etcd import Etcd, EtcdOptions, EtcdUnavailable
from rpcbuf.control.wire.errors import BadRequest, RpcBufError
from rpcbuf.control.wire.membership import (
    DEFAULT_CLUSTER,
    NodeRecord,
    RecordError,
    RegistryAddress,
    parse_record,
    parse_registry,
    prefix,
)

log = logging.getLogger("rpcbuf.discovery")
BACKOFF = (0.2, 5.0)  # s: first and largest wait before listing again after a broken watch
MAX_CHANGES = 1024  # changes queued per subscriber; a slower one loses the oldest


class RegistryUnavailable(RpcBufError, wire=False):
    """The registry (etcd) could not be reached; the message names its address."""

    code = "REGISTRY_UNAVAILABLE"


class StaleEntry(BadRequest):
    """A registry entry whose address answers as another node."""


@dataclass(frozen=True)
class Change:
    """``kind``: "joined", "updated" or "left" (``node``: its last record)."""

    kind: str
    node: NodeRecord


def check_node(record: NodeRecord, node_id: str) -> None:
    """Refuse a hello whose ``node_id`` is not the record's (``StaleEntry``)."""
    if node_id != record.node_id:
        raise StaleEntry(f"the registry lists {record.node_id!r} at {record.address}, but the "
                         f"daemon there is {node_id!r}: a stale or forged entry, refused",
                         {"reason": "stale_registry_entry", "listed": record.node_id,
                          "answered": node_id})


def diff(old: dict[str, NodeRecord], new: dict[str, NodeRecord]) -> list[Change]:
    out = [Change("left", r) for n, r in old.items() if n not in new]
    for n, r in new.items():
        if n not in old:
            out.append(Change("joined", r))
        elif r != old[n]:
            out.append(Change("updated", r))
    return out


class Discovery:
    """The members of one cluster."""

    def __init__(self, address: str | RegistryAddress, cluster: str = DEFAULT_CLUSTER,
                 options: EtcdOptions | None = None) -> None:
        try:
            self.address = address if isinstance(address, RegistryAddress) \
                else parse_registry(address)
            self.prefix = prefix(cluster)
        except RecordError as exc:
            raise BadRequest(str(exc)) from None
        self.cluster = cluster
        self.etcd = Etcd(self.address, options)
        self.members: dict[str, NodeRecord] = {}
        self.stale = True  # True until read, and while a broken watch waits for etcd
        self._subscribers: list[asyncio.Queue[Change]] = []
        self._task: asyncio.Task[None] | None = None
        self._revision = 0

    async def read(self) -> dict[str, NodeRecord]:
        """The live members now, in node-id order.  Raises ``RegistryUnavailable``."""
        try:
            rows, revision = await self.etcd.get_prefix(self.prefix)
        except EtcdUnavailable as exc:
            raise RegistryUnavailable(str(exc), {"registry": str(self.address)}) from None
        out: dict[str, NodeRecord] = {}
        for key, value in rows:
            try:
                rec = parse_record(value, key)
            except RecordError as exc:
                log.warning("registry %s: ignoring %s: %s", self.address, key, exc)
                continue
            out[rec.node_id] = rec
        self._revision = revision
        self.members = dict(sorted(out.items()))
        self.stale = False
        return self.members

    def watch(self) -> None:
        """Keep ``members`` current (a task of its own) until ``close``."""
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name="rpcbuf-discovery")

    def subscribe(self) -> asyncio.Queue[Change]:
        """A queue of every change from now on (starts the watch).  Subscribed
        at once, unlike ``changes``: a caller that then reads ``members`` misses
        nothing."""
        queue: asyncio.Queue[Change] = asyncio.Queue(MAX_CHANGES)
        self._subscribers.append(queue)
        self.watch()
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Change]) -> None:
        if queue in self._subscribers:
            self._subscribers.remove(queue)

    async def changes(self) -> AsyncIterator[Change]:
        """Every change from now on (starts the watch)."""
        queue = self.subscribe()
        try:
            while True:
                yield await queue.get()
        finally:
            self.unsubscribe(queue)

    def _tell(self, changes: list[Change]) -> None:
        for q in self._subscribers:
            for c in changes:
                if q.full():
                    q.get_nowait()  # a subscriber that does not read loses the oldest
                q.put_nowait(c)

    async def _follow(self) -> None:
        wait = BACKOFF[0]
        while True:
            try:
                if self.stale:
                    old = self.members
                    await self.read()
                    self._tell(diff(old, self.members))
                wait = BACKOFF[0]
                async for ev in self.etcd.watch_prefix(self.prefix, self._revision + 1):
                    self._revision = max(self._revision, ev.revision)
                    self._apply(ev.kind, ev.key, ev.value)
            except (EtcdUnavailable, RegistryUnavailable) as exc:
                if not self.stale:
                    log.warning("registry %s: %s; listing again when it answers",
                                self.address, exc)
                self.stale = True
            await asyncio.sleep(wait * random.uniform(0.8, 1.2))
            wait = min(wait * 2, BACKOFF[1])

    def _apply(self, kind: str, key: str, value: bytes) -> None:
        node_id = key.rpartition("/")[2]
        if kind == "delete":
            gone = self.members.pop(node_id, None)
            if gone is not None:
                self._tell([Change("left", gone)])
            return
        try:
            rec = parse_record(value, key)
        except RecordError as exc:
            log.warning("registry %s: ignoring %s: %s", self.address, key, exc)
            return
        old = self.members.get(rec.node_id)
        self.members[rec.node_id] = rec
        self.members = dict(sorted(self.members.items()))
        if old is None:
            self._tell([Change("joined", rec)])
        elif old != rec:
            self._tell([Change("updated", rec)])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.etcd.close()


def choose_by_free(records: list[NodeRecord], need: int) -> list[NodeRecord]:
    """The fewest nodes, most free memory first, whose free bytes add up to
    ``need``; every node when they do not."""
    ranked = sorted(records, key=lambda r: (-r.free, r.node_id))
    out: list[NodeRecord] = []
    total = 0
    for r in ranked:
        if total >= need:
            break
        out.append(r)
        total += r.free
    return sorted(out, key=lambda r: r.node_id)
