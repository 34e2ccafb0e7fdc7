"""The daemon's entry in the fleet registry (``--registry etcd://...``): one key
under its cluster's prefix, on an etcd lease, kept by a task of its own.

- Never blocks serving: every etcd call is bounded; while etcd is away the task
  logs once, retries with jittered capped backoff (``BACKOFF``) and registers
  anew (new lease, new key) when it answers.
- Each ``TICK``: the lease is refreshed every ``ttl / 3`` (two lost refreshes
  still keep the key); the record is rewritten when the figures changed (at most
  once a tick) and every ``refresh`` seconds; a refresh answered with TTL 0
  registers again at once.
- Every write is a transaction: only if the key is absent or on this daemon's
  own lease. A key on another lease is ``Taken``: logged once, the daemon serves
  on unregistered and retries (a restart within the TTL registers a TTL later).
- ``stop()`` deletes the key and revokes the lease, bounded; a crash leaves the
  key to the lease.
- The record holds the node's own figures only: no tenant, buffer or model name.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import random
import socket
import time
from typing import TYPE_CHECKING

from rpcbuf.control.fleet.etcd import Etcd, EtcdUnavailable
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.membership import (
    DEFAULT_TTL,
    DeviceFigures,
    NodeRecord,
    RecordError,
    node_key,
    parse_record,
)

if TYPE_CHECKING:
    from rpcbuf.control.daemon.service.server import Daemon

log = logging.getLogger("rpcbuf.daemon.announce")
TICK = 1.0  # s: how often figures are compared (and at most how often they are written)
BACKOFF = (0.5, 5.0)  # s: first and largest wait between tries while etcd is away
REFRESH = 30.0  # s: the record is rewritten this often even when nothing changed


def rpcbuf_version() -> str:
    try:
        return importlib.metadata.version("rpcbuf")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class Taken(Exception):
    """The node's key is held by another lease; the message says by whom."""


class Announcer:
    def __init__(self, owner: Daemon, etcd: Etcd, cluster: str, *,
                 advertise: str | None = None, ttl: int = DEFAULT_TTL,
                 refresh: float = REFRESH) -> None:
        self.owner = owner
        self.etcd = etcd
        self.key = node_key(cluster, owner.node_id)
        self.advertise = advertise
        self.ttl = ttl
        self.refresh = refresh
        self.registered = False
        self.writes = 0  # puts, for the metrics and the churn measurements
        self.keepalives = 0
        self.registrations = 0
        self._lease: int | None = None
        self._written: NodeRecord | None = None
        self._written_at = 0.0
        self._task: asyncio.Task[None] | None = None

    def address(self) -> str:
        """What clients dial: ``--advertise``, else the control listener's
        address (a wildcard one advertises this host's name)."""
        if self.advertise:
            return self.advertise
        host, port = self.owner.address[:2]
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return f"{host}:{port}"

    def record(self) -> NodeRecord:
        devs = tuple(DeviceFigures(str(d["key"]), int(d["total"]), int(d["free"]),
                                   int(d["largest_free"])) for d in self.owner.devices)
        return NodeRecord(self.owner.node_id, self.address(), self.owner.ucx_port,
                          rpcbuf_version(), (P.PROTOCOL_MIN, P.PROTOCOL_VERSION),
                          self.owner.started_at, time.time(), devs)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="rpcbuf-announce")

    async def stop(self) -> None:
        """Cancel the task, then delete the key and revoke the lease (bounded)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        lease, self._lease = self._lease, None
        if self.registered and lease is not None:
            try:
                await self.etcd.delete_if_held(self.key, lease)
                await self.etcd.revoke(lease)
                log.info("registry: %s deleted", self.key)
            except EtcdUnavailable as exc:
                log.warning("registry: could not delete %s (its lease expires in %d s): %s",
                            self.key, self.ttl, exc)
        self.registered = False
        await self.etcd.close()

    async def _run(self) -> None:
        wait = BACKOFF[0]
        failing: type[Exception] | None = None  # what the last try failed with
        while True:
            try:
                await self._register()
                failing = None
                wait = BACKOFF[0]
                await self._keep()
                continue  # the lease was lost, or the key taken: register again at once
            except EtcdUnavailable as exc:
                if self.registered or failing is not EtcdUnavailable:
                    log.warning("registry: %s; serving on, retrying with backoff", exc)
                self.registered = False
                failing = EtcdUnavailable
            except Taken as exc:
                if failing is not Taken:
                    log.error("registry: %s; serving on unregistered (clients of the "
                              "registry do not see this daemon), retrying with backoff",
                              exc)
                self.registered = False
                failing = Taken
            await asyncio.sleep(wait * random.uniform(0.8, 1.2))
            wait = min(wait * 2, BACKOFF[1])

    async def _register(self) -> None:
        """A new lease, and the key on it if free or on the old one (which may
        live on). Raises ``Taken`` (the new lease revoked), ``EtcdUnavailable``."""
        old, self._lease = self._lease, await self.etcd.grant(self.ttl)
        try:
            await self._put(self.record(), mine=old)
        except (Taken, EtcdUnavailable):
            # Keep the old lease: it may still hold our key, and a retry that
            # compared against the new, empty one would call our own key taken.
            lease, self._lease = self._lease, old
            with contextlib.suppress(EtcdUnavailable):
                await self.etcd.revoke(lease)
            raise
        if old is not None and old != self._lease:
            await self.etcd.revoke(old)  # its key is on the new lease now
        self.registered = True
        self.registrations += 1
        log.info("registry: registered %s at %s (lease %x, ttl %d s)", self.key,
                 self.address(), self._lease, self.ttl)

    async def _put(self, rec: NodeRecord, mine: int | None) -> None:
        """Write the record on our lease if the key is free or on ``mine``.
        Raises ``Taken``, ``EtcdUnavailable``."""
        assert self._lease is not None
        holder = await self.etcd.put_if_free(self.key, rec.encode(), self._lease, mine)
        if holder is not None:
            raise Taken(f"node id {self.owner.node_id!r} is taken: {self.key} is held by "
                        f"{_holder(holder, self.key)}; give each daemon its own --node-id "
                        "(the default, host:port, is)")
        self.writes += 1
        self._written = rec
        self._written_at = time.monotonic()

    async def _keep(self) -> None:
        """Refresh lease and record until the lease is lost (returns) or etcd
        stops answering (``EtcdUnavailable``)."""
        assert self._lease is not None
        refreshed = time.monotonic()
        while True:
            await asyncio.sleep(TICK)
            now = time.monotonic()
            if now - refreshed >= self.ttl / 3:
                left = await self.etcd.keepalive(self._lease)
                self.keepalives += 1
                refreshed = now
                if left <= 0:
                    log.warning("registry: lease of %s expired (etcd was away longer than "
                                "%d s); registering again", self.key, self.ttl)
                    self.registered = False
                    return
            rec = self.record()
            if not rec.same_figures(self._written) or now - self._written_at >= self.refresh:
                try:
                    await self._put(rec, mine=self._lease)
                except Taken as exc:  # our lease ran out and another took the key
                    log.error("registry: %s", exc)
                    self.registered = False
                    return


def _holder(value: bytes, key: str) -> str:
    """Who holds the key, for the log: only what a valid record says (others
    write the registry)."""
    if not value:
        return "another lease (the key went meanwhile)"
    try:
        rec = parse_record(value, key)
    except RecordError:
        return "another writer (its value is no valid node record)"
    return f"the daemon at {rec.address!r} (ucx port {rec.ucx_port}, up since " \
           f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(rec.started_at))})"
