"""Finding the live nodes of a cluster in the fleet registry (etcd).

``Discovery(etcd://h:2379, cluster)`` reads the records the daemons keep
under their cluster's prefix (``wire/membership.py``): ``read()`` is one
snapshot, ``{node_id: NodeRecord}``; ``watch()`` keeps a snapshot current
from etcd's watch stream and tells each subscriber what changed (``Change``:
joined, updated, left).  A record that does not parse is skipped with a
warning, never trusted: the prefix may be writable by more than the nodes.

A watch that breaks (etcd restarted, the member we watched went away) lists
the prefix again once etcd answers (backoff ``BACKOFF``), reports the
difference as changes, and watches on from that listing's revision: a
subscriber sees every node that joined or left meanwhile, once.  While etcd
is away the snapshot stays as it was last read (``stale`` says so): rpcbuf
cannot learn of a death it cannot hear about, but every data call to a dead
node still fails on its own deadline.

A record is a claim, not a proof: anyone who can write the prefix can
publish one pointing at a listener of their own.  So ``Cluster`` dials an
advertised node exactly as ``rpcbuf.connect`` dials any address
(``opening.py``): the token goes out in ``hello`` only after the peer has
proved it is a node, by a TLS certificate that the cluster's CA (``tls=``,
``$RPCBUF_CA``) signed for the address in the record; plain TCP is used
only to a loopback address, or when told ``insecure=True``.  After hello it
checks that the node id the daemon names is the record's (``check_node``):
a stale record, or a forged one pointing at another node, is refused.
The record names the address, so this holds only for a CA that signs
nothing but the cluster's nodes (with public CAs, ``tls=True``, a forger
names a host it has a certificate for).  Without TLS off loopback
(``insecure=True``) a forged record does get the token: that mode trusts
the network and whoever can write the registry.
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
    """The daemon at ``record.address`` said ``node_id`` in hello: refuse it
    unless that is the record's node (``StaleEntry``)."""
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
    """The members of one cluster; see the module docstring."""

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
        """The live members now, ``{node_id: record}`` in node-id order.
        Raises ``RegistryUnavailable``."""
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
        """A queue of every change from now on (starts the watch if needed);
        ``unsubscribe`` it when done.  Subscribed at once, unlike ``changes``
        (whose generator subscribes when first awaited): a caller that then
        reads ``members`` misses no change between the two."""
        queue: asyncio.Queue[Change] = asyncio.Queue(MAX_CHANGES)
        self._subscribers.append(queue)
        self.watch()
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Change]) -> None:
        if queue in self._subscribers:
            self._subscribers.remove(queue)

    async def changes(self) -> AsyncIterator[Change]:
        """Every change from now on (starts the watch if needed)."""
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
    """The fewest nodes, most free memory first, whose free bytes (the
    registry's figures) add up to ``need``; every node when they do not."""
    ranked = sorted(records, key=lambda r: (-r.free, r.node_id))
    out: list[NodeRecord] = []
    total = 0
    for r in ranked:
        if total >= need:
            break
        out.append(r)
        total += r.free
    return sorted(out, key=lambda r: r.node_id)
