"""The one module that talks to etcd, through ``aetcd`` (asyncio, v3 API over
gRPC; its only dependencies are grpcio and protobuf).

``Etcd`` keeps one client to the member it last reached.  Every call runs under
``options.timeout``; a failed call closes that client and is retried once on
each next member, then raises ``EtcdUnavailable``: at most ``len(members)``
tries, never a hang.  Callers own their backoff.  aetcd 1.0 opens plaintext
channels only, so ``_TlsClient`` opens a TLS one (CA, client certificate);
user/password goes through aetcd's ``Authenticate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aetcd
import grpc
from aetcd import rpc, transactions, utils, watcher

from rpcbuf.control.wire.membership import RegistryAddress

log = logging.getLogger("rpcbuf.etcd")
T = TypeVar("T")
# gRPC shares a connection to a target between channels, with its reconnect
# backoff (up to 120 s): an etcd back from a restart would be refused to every
# new client for that long.  Each client keeps its own, retried within 2 s.
CHANNEL_OPTIONS = {"grpc.use_local_subchannel_pool": 1,
                   "grpc.initial_reconnect_backoff_ms": 200,
                   "grpc.max_reconnect_backoff_ms": 2000}
MAX_WATCH_QUEUE = 10_000  # events buffered for a slow watcher before the watch restarts


class EtcdUnavailable(Exception):
    """No member of the registry answered in time; the message names them."""


@dataclass(frozen=True)
class EtcdOptions:
    """How to reach the registry: TLS files, etcd user, per-call deadline."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    timeout: float = 3.0

    def credentials(self) -> grpc.ChannelCredentials | None:
        """Raises OSError naming a file that cannot be read."""
        if not (self.ca or self.cert):
            return None
        if bool(self.cert) != bool(self.key):
            raise OSError("--registry-cert and --registry-key go together")

        def read(path: str | None, flag: str) -> bytes | None:
            if path is None:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as exc:
                raise OSError(f"{flag} {path}: {exc.strerror or exc}") from None

        return grpc.ssl_channel_credentials(read(self.ca, "--registry-ca"),
                                            read(self.key, "--registry-key"),
                                            read(self.cert, "--registry-cert"))


class _TlsClient(aetcd.Client):
    """``aetcd.Client`` over a TLS channel, its stubs set up as aetcd does."""

    def __init__(self, host: str, port: int, creds: grpc.ChannelCredentials,
                 **kw: Any) -> None:
        super().__init__(host, port, **kw)
        self._creds = creds

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        self.channel = rpc.secure_channel(f"{self._host}:{self._port}", self._creds,
                                          options=list(self._options.items()))
        if self._username is not None:
            self.auth_stub = rpc.AuthStub(self.channel)
            resp = await self.auth_stub.Authenticate(
                rpc.AuthenticateRequest(name=self._username, password=self._password),
                timeout=self._timeout)
            self.metadata = (("token", resp.token),)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                        metadata=self.metadata)
        self._connected.set()


@dataclass(frozen=True)
class Event:
    """A change under a watched prefix: ``kind`` "put" or "delete"."""

    kind: str
    key: str
    value: bytes
    revision: int


class Etcd:
    def __init__(self, address: RegistryAddress, options: EtcdOptions | None = None) -> None:
        self.address = address
        self.options = options or EtcdOptions()
        self._creds = self.options.credentials()
        self._member = 0
        self._client: aetcd.Client | None = None

    def _open(self) -> aetcd.Client:
        host, port = self.address.endpoints[self._member]
        host = f"[{host}]" if ":" in host else host  # aetcd dials f"{host}:{port}"
        kw: dict[str, Any] = {"username": self.options.user, "password": self.options.password,
                              "timeout": self.options.timeout,
                              "connect_wait_timeout": self.options.timeout,
                              "options": CHANNEL_OPTIONS}
        if self._creds is not None:
            return _TlsClient(host, port, self._creds, **kw)
        return aetcd.Client(host, port, **kw)

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception, asyncio.TimeoutError):
                async with asyncio.timeout(self.options.timeout):
                    await client.close()

    async def call(self, what: str, fn: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        """``fn(client)`` on the last member reached, else each next once.  Raises
        ``EtcdUnavailable``."""
        last: BaseException | None = None
        for _ in range(len(self.address.endpoints)):
            if self._client is None:
                self._client = self._open()
            try:
                async with asyncio.timeout(self.options.timeout):
                    await self._client.connect()
                    return await fn(self._client)
            except (aetcd.ClientError, grpc.RpcError, OSError, TimeoutError) as exc:
                last = exc
                host, port = self.address.endpoints[self._member]
                log.debug("etcd %s:%d: %s failed: %r", host, port, what, exc)
                await self._drop()
                self._member = (self._member + 1) % len(self.address.endpoints)
        raise EtcdUnavailable(f"the registry {self.address} did not answer {what} "
                              f"within {self.options.timeout:g} s: {_why(last)}")

    async def close(self) -> None:
        await self._drop()

    # -- the operations rpcbuf uses -------------------------------------------------

    async def get_prefix(self, prefix: str) -> tuple[list[tuple[str, bytes]], int]:
        """Every ``(key, value)`` under ``prefix`` and the store's revision."""
        async def get(c: aetcd.Client) -> tuple[list[tuple[str, bytes]], int]:
            got = await c.get_prefix(prefix.encode())
            rows = [(kv.key.decode(errors="replace"), bytes(kv.value)) for kv in got]
            return rows, int(got.header.revision)
        return await self.call("get", get)

    async def grant(self, ttl: int) -> int:
        async def grant(c: aetcd.Client) -> int:
            return int((await c.lease(ttl)).id)
        return await self.call("lease grant", grant)

    async def keepalive(self, lease_id: int) -> int:
        """Refresh the lease; its TTL left, 0 when etcd no longer knows it."""
        async def refresh(c: aetcd.Client) -> int:
            reply = await c.refresh_lease(lease_id)
            return int(reply.TTL) if reply is not None else 0
        return await self.call("lease keepalive", refresh)

    async def put(self, key: str, value: bytes, lease_id: int | None = None) -> None:
        async def put(c: aetcd.Client) -> None:
            await c.put(key.encode(), value, lease=lease_id)
        await self.call("put", put)

    async def put_if_free(self, key: str, value: bytes, lease_id: int,
                          mine: int | None = None) -> bytes | None:
        """Put ``key`` on ``lease_id`` only if absent or held by lease ``mine`` (a
        transaction: never a blind overwrite).  None once written, else the value there."""
        async def put(c: aetcd.Client) -> bytes | None:
            t, k = c.transactions, key.encode()
            held = await c.transaction(
                compare=[_Lease(k) == mine] if mine else [t.create(k) == 0],
                success=[t.put(k, value, lease=lease_id)], failure=[t.get(k)])
            if not held[0] and mine:
                held = await c.transaction(compare=[t.create(k) == 0],
                                           success=[t.put(k, value, lease=lease_id)],
                                           failure=[t.get(k)])
            if held[0]:
                return None
            rows = held[1][0] if held[1] else []
            return bytes(rows[0][0]) if rows else b""
        return await self.call("put", put)

    async def delete_if_held(self, key: str, lease_id: int) -> None:
        """Delete ``key`` if it is on ``lease_id`` (not a key another took)."""
        async def delete(c: aetcd.Client) -> None:
            k = key.encode()
            await c.transaction(compare=[_Lease(k) == lease_id],
                                success=[c.transactions.delete(k)], failure=[])
        await self.call("delete", delete)

    async def revoke(self, lease_id: int) -> None:
        async def revoke(c: aetcd.Client) -> None:
            await c.revoke_lease(lease_id)
        await self.call("lease revoke", revoke)

    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[Event]:
        """Changes under ``prefix`` from ``start_revision`` until the stream breaks
        (``EtcdUnavailable``) or the caller stops."""
        # One slot beyond the bound, for the error that ends a watch that fell behind.
        events: asyncio.Queue[Event | BaseException] = asyncio.Queue(MAX_WATCH_QUEUE + 1)

        async def on_response(resp: Any) -> None:
            if events.full():
                return  # the error that ends this watch is already queued
            if events.qsize() >= MAX_WATCH_QUEUE:
                events.put_nowait(EtcdUnavailable("the watch fell behind"))
            elif resp is None or isinstance(resp, BaseException):  # None: the client closed
                events.put_nowait(resp or EtcdUnavailable("the connection closed"))
            else:
                events.put_nowait(Event("put" if resp.kind == "PUT" else "delete",
                                        resp.kv.key.decode(errors="replace"),
                                        bytes(resp.kv.value), int(resp.kv.mod_revision)))

        async def create(c: aetcd.Client) -> tuple[aetcd.Client, int]:
            cb = await c._watcher.add_callback(  # the callback form: no unbounded queue
                prefix.encode(), on_response, range_end=utils.prefix_range_end(prefix.encode()),
                start_revision=start_revision)
            return c, int(cb.watch_id)

        client, watch_id = await self.call("watch", create)
        try:
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    raise EtcdUnavailable(f"the registry {self.address}: watch ended: "
                                          f"{_why(item)}")
                yield item
        finally:
            with contextlib.suppress(Exception, asyncio.TimeoutError):
                async with asyncio.timeout(self.options.timeout):
                    await client._watcher.cancel(watch_id)


class _Lease(transactions.BaseCompare):
    """Compare a key's lease (etcd has the target; aetcd 1.0 has no class for it)."""

    def build_compare(self, compare: Any) -> None:
        compare.target = rpc.Compare.LEASE
        compare.lease = self.value


def _why(exc: BaseException | None) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
