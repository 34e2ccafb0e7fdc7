"""rpcbuf as LMCache's remote backend: ``RpcbufConnector``, a ``RemoteConnector``
over the keyed block tier, loaded by LMCache's plugin route (configuration in
docs/kvcache.md).  An optional extra: only this package imports LMCache.

LMCache calls the coroutines on its RemoteBackend loop: the rpcbuf sessions
live there and nothing here blocks it.  A chunk is one block: key
``CacheEngineKey.to_string()``, bytes the memory object's ``byte_array`` (read
straight into LMCache's object), ``meta`` its ``RemoteMetadata``, so a get
allocates exactly what was stored.  A batch is one request per node (split past
``BATCH_KEYS``/``BATCH_BYTES``), to every node at once.

A daemon that is gone is a miss, never an error (a put goes to the chunk's next
live node, or is dropped with a warning); sessions reopen in the background every
``RECONNECT_EVERY`` seconds.  A refused token (``AUTH_FAILED``,
``TOKEN_EXPIRED``, ``FORBIDDEN``) raises ``RpcbufAuthError`` (LMCache's
``IrrecoverableException``) with the daemon's sentence, at start and later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

import rpcbuf
from rpcbuf.control.client.answers import MAX_BLOCK_NBYTES
from rpcbuf.control.client.blockops import LIST_MAX_CHARS, LIST_MAX_KEYS, list_all
from rpcbuf.control.wire.membership import DEFAULT_CLUSTER
from rpcbuf.control.wire.protocol import MAX_BLOCK_KEYS

__all__ = ["RpcbufAuthError", "RpcbufConnector"]

log = logging.getLogger("rpcbuf.lmcache")
PLUGIN = "rpcbuf"  # the plugin name the settings are read under, unless configured otherwise
BATCH_KEYS = 256  # chunks in one rpcbuf request
BATCH_BYTES = 256 << 20  # bytes in one rpcbuf request
RECONNECT_EVERY = 1.0  # seconds between attempts to open the session again
CONNECT_TIMEOUT = 10.0
_REFUSED = (rpcbuf.AuthFailed, rpcbuf.TokenExpired, rpcbuf.Forbidden)


class RpcbufAuthError(IrrecoverableException):
    """The daemon refused this connector's token: no retry helps."""


def _settings(config: Any) -> dict[str, Any]:
    """``remote_storage_plugin.NAME.*`` of ``extra_config`` for the plugin whose
    class_name is ours (else NAME = "rpcbuf")."""
    extra: dict[str, Any] = dict(getattr(config, "extra_config", None) or {})
    name = PLUGIN
    for k, v in extra.items():
        if k.startswith("remote_storage_plugin.") and k.endswith(".class_name") \
                and v == RpcbufConnector.__name__:
            name = k[len("remote_storage_plugin."):-len(".class_name")]
            break
    prefix = f"remote_storage_plugin.{name}."
    return {k[len(prefix):]: v for k, v in extra.items() if k.startswith(prefix)}


class RpcbufConnector(RemoteConnector):
    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any,
                 config: Any = None) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        opts = _settings(config if config is not None else local_cpu_backend.config)
        endpoints = str(opts.get("endpoint") or os.environ.get("RPCBUF_ENDPOINTS")
                        or "127.0.0.1:7700").strip()
        self.endpoint = endpoints if endpoints.startswith("etcd") else ";".join(
            e.strip().removeprefix("rpcbuf://") for e in endpoints.replace(",", ";").split(";")
            if e.strip())
        self.replicas = int(opts.get("replicas") or 1)
        self.cluster = str(opts.get("cluster") or DEFAULT_CLUSTER)
        token = opts.get("token") or os.environ.get("RPCBUF_TOKEN")
        if not token:
            raise RpcbufAuthError("rpcbuf connector: no token (set extra_config "
                                  "remote_storage_plugin.rpcbuf.token or $RPCBUF_TOKEN)")
        self._token = str(token)
        self.ttl = float(opts["ttl"]) if opts.get("ttl") else None
        self.timeout = float(opts.get("timeout") or 30.0)
        same = opts.get("same_host")
        self._same_host = None if same is None else bool(same)
        self._keys: rpcbuf.BlockCluster | None = None
        self._connecting: asyncio.Lock | None = None
        self._failed_at = -1e9
        self._closed = False
        # Open the sessions now when the loop runs in another thread (LMCache's
        # RemoteBackend): a refused token is a clear error at start; a daemon
        # that is not up yet only means misses until it is.
        if loop.is_running() and not _on(loop):
            try:
                asyncio.run_coroutine_threadsafe(self._space(), loop).result(
                    CONNECT_TIMEOUT + 5)
            except RpcbufAuthError:
                raise
            except Exception as exc:
                log.warning("rpcbuf connector: %s not reachable yet (%s); misses until it is",
                            self.endpoint, exc)

    # -- the sessions -------------------------------------------------------------------

    async def _space(self) -> rpcbuf.BlockCluster | None:
        """The key space, opened if need be; None while no node answers."""
        if self._keys is not None:
            return self._keys
        if self._closed or time.monotonic() - self._failed_at < RECONNECT_EVERY:
            return None
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._keys is None:
                try:
                    self._keys = await rpcbuf.BlockCluster.connect(
                        self.endpoint, self._token, replicas=self.replicas,
                        timeout=self.timeout, cluster=self.cluster,
                        same_host=self._same_host,
                        reconnect=(RECONNECT_EVERY, RECONNECT_EVERY))
                except _REFUSED as exc:
                    raise self._refused(exc) from exc
                except (rpcbuf.RpcBufError, OSError) as exc:
                    self._failed_at = time.monotonic()
                    log.warning("rpcbuf connector: cannot reach %s: %s", self.endpoint, exc)
                    return None
                log.info("rpcbuf connector: sessions with %s", ", ".join(self._keys.live))
        return self._keys

    def _refused(self, exc: BaseException) -> RpcbufAuthError:
        return RpcbufAuthError(f"rpcbuf at {self.endpoint} refused the token: {exc}")

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """The one translation of the key space's errors: a refused token is
        ``RpcbufAuthError`` (a gone node is a miss already)."""
        try:
            yield
        except _REFUSED as exc:
            raise self._refused(exc) from exc

    # -- lookups --------------------------------------------------------------------------

    async def _lookup(self, keys: Sequence[CacheEngineKey],
                      meta: bool = False) -> list[dict[str, Any] | None]:
        space = await self._space()
        if space is None:
            return [None] * len(keys)
        out: list[dict[str, Any] | None] = []
        with self._guarded():
            for at in range(0, len(keys), MAX_BLOCK_KEYS):
                part = keys[at:at + MAX_BLOCK_KEYS]
                out += await space.lookup_blocks([k.to_string() for k in part], meta=meta)
        return out

    async def exists(self, key: CacheEngineKey) -> bool:
        return (await self._lookup([key]))[0] is not None

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return bool(self._sync(self.exists(key)))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return int(self._sync(self._prefix(keys)))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey],
                                     pin: bool = False) -> int:
        return await self._prefix(keys)

    async def _prefix(self, keys: Sequence[CacheEngineKey]) -> int:
        """How many keys from the first are there (LMCache's prefix hit)."""
        found = await self._lookup(keys)
        return next((i for i, f in enumerate(found) if f is None), len(found))

    # -- get ------------------------------------------------------------------------------

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Full chunks in one round trip straight into full-chunk objects; the
        rest (missing, or an unfull last chunk) looked up and read in a second."""
        objs = await self._get_full(keys)
        rest = [i for i, o in enumerate(objs) if o is None]
        if rest:
            more = await self._get_described([keys[i] for i in rest])
            for i, obj in zip(rest, more, strict=True):
                objs[i] = obj
        return objs

    async def _get_full(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        space = await self._space()
        objs: list[MemoryObj | None] = [None] * len(keys)
        if space is None:
            return objs
        for i in range(len(keys)):
            objs[i] = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes,
                                                      self.meta_fmt)
        want = [i for i, o in enumerate(objs) if o is not None]
        return await self._read(space, keys, objs, want)

    async def _read(self, space: rpcbuf.BlockCluster, keys: Sequence[CacheEngineKey],
                    objs: list[MemoryObj | None], want: list[int],
                    lengths: list[int] | None = None) -> list[MemoryObj | None]:
        """``get_blocks`` of ``keys[i]`` into ``objs[i]`` for i in ``want``
        (``lengths[i]`` bytes, else all); objects of keys not read are released."""
        try:
            with self._guarded():
                for part in _batches(want, lambda i: _nbytes(objs[i])):
                    hits = await space.get_blocks(
                        [keys[i].to_string() for i in part],
                        [_view(objs[i], None if lengths is None else lengths[i]) for i in part])
                    for i, hit in zip(part, hits, strict=True):
                        if not hit:
                            _release(objs[i])
                            objs[i] = None
                return objs
        except BaseException:
            _release_all(objs)
            raise

    async def _get_described(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        found = await self._lookup(keys, meta=True)
        objs: list[MemoryObj | None] = [None] * len(keys)
        lengths = [0] * len(keys)
        for i, info in enumerate(found):
            if info is not None:
                objs[i] = self._allocate(info)
                lengths[i] = int(info["nbytes"])
        want = [i for i, o in enumerate(objs) if o is not None]
        space = self._keys
        if not want or space is None:
            return _release_all(objs)
        return await self._read(space, keys, objs, want, lengths)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str,
                                       keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The objects up to the first miss (the rest released), as prefetch wants."""
        objs = await self.batched_get(keys)
        out: list[MemoryObj] = []
        for i, obj in enumerate(objs):
            if obj is None:
                _release_all(objs[i:])
                break
            out.append(obj)
        return out

    def _allocate(self, info: dict[str, Any]) -> MemoryObj | None:
        meta = info.get("meta")
        if not isinstance(meta, bytes) or len(meta) < self.remote_metadata_bytes:
            log.warning("rpcbuf connector: a block without LMCache metadata; treated as a miss")
            return None
        md = RemoteMetadata.deserialize(meta)
        if md.length != info["nbytes"]:
            log.warning("rpcbuf connector: a block of %d bytes says %d; treated as a miss",
                        info["nbytes"], md.length)
            return None
        # What we allocate is what the daemon's metadata names: bounded first.
        shaped = _shape_bytes(md.shapes, md.dtypes)
        if shaped is None or not md.length <= shaped <= MAX_BLOCK_NBYTES:
            log.warning("rpcbuf connector: a block whose shapes take %s bytes (at most %d, "
                        "at least its %d); treated as a miss", shaped, MAX_BLOCK_NBYTES,
                        md.length)
            return None
        obj = self.local_cpu_backend.allocate(md.shapes, md.dtypes, md.fmt)
        if obj is None:
            log.warning("rpcbuf connector: no local memory for a remote chunk")
            return None
        if len(_view(obj, md.length)) != md.length:
            _release(obj)
            return None
        return obj

    # -- put ------------------------------------------------------------------------------

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: Sequence[CacheEngineKey],
                          memory_objs: list[MemoryObj]) -> None:
        space = await self._space()
        if space is None:
            log.debug("rpcbuf connector: %d chunks not sent (no session)", len(keys))
            return
        metas = [RemoteMetadata(_nbytes(m), m.get_shapes(), m.get_dtypes(),
                                m.get_memory_format()).serialize() for m in memory_objs]
        with self._guarded():
            for part in _batches(list(range(len(keys))),
                                 lambda i: _nbytes(memory_objs[i])):
                await space.put_blocks([(keys[i].to_string(), _view(memory_objs[i]))
                                        for i in part], ttl=self.ttl,
                                       metas=[metas[i] for i in part])

    # -- the rest of the interface --------------------------------------------------------

    async def list(self) -> list[str]:
        """This tenant's keys, at most ``LIST_MAX_KEYS`` (and ``LIST_MAX_CHARS``)
        gathered within ``timeout``, then stopped with a warning; a malformed page
        is a miss."""
        space = await self._space()
        if space is None:
            return []

        async def page(after: str | None) -> tuple[list[str], bool]:
            return await space.list_blocks(start_after=after, limit=MAX_BLOCK_KEYS)

        with self._guarded():
            try:
                keys, whole = await list_all(page, self.timeout)
            except rpcbuf.BadRequest as exc:  # a malformed answer (reason bad_answer)
                log.warning("rpcbuf connector: listing %s: %s", self.endpoint, exc)
                return []
            if not whole:
                log.warning("rpcbuf connector: listing %s stopped at %d keys (at most %d keys, "
                            "%d characters, %gs)", self.endpoint, len(keys), LIST_MAX_KEYS,
                            LIST_MAX_CHARS, self.timeout)
            return keys

    def remove_sync(self, key: CacheEngineKey) -> bool:
        async def remove() -> bool:
            space = await self._space()
            if space is None:
                return False
            with self._guarded():
                return await space.remove_blocks([key.to_string()]) > 0
        return bool(self._sync(remove()))

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        space = await self._space()
        if space is None:
            return 1
        with self._guarded():
            return 0 if await space.ping() else 1

    async def close(self) -> None:
        """Close the sessions, within ``timeout`` (never hang a shutdown)."""
        self._closed = True
        space, self._keys = self._keys, None
        if space is None:
            return
        try:
            await asyncio.wait_for(space.close(), self.timeout)
        except (TimeoutError, rpcbuf.RpcBufError) as exc:
            log.warning("rpcbuf connector: closing the sessions: %s", exc)
            space.cluster.abort()

    def _sync(self, coro: Any) -> Any:
        if _on(self.loop):
            coro.close()
            raise RuntimeError("rpcbuf connector: a *_sync call on its own event loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout + 5)

    def __repr__(self) -> str:
        return f"<RpcbufConnector {self.endpoint}>"


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _view(obj: Any, length: int | None = None) -> memoryview:
    """A memory object's bytes as a flat memoryview (of ``length`` bytes)."""
    view = obj.byte_array
    view = view if isinstance(view, memoryview) else memoryview(view)
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    return view if length is None else view[:length]


def _shape_bytes(shapes: Any, dtypes: Any) -> int | None:
    """The bytes of tensors of ``shapes`` and ``dtypes`` (None: not shapes and dtypes)."""
    try:
        return sum(math.prod(int(d) for d in shape) * int(dtype.itemsize)
                   for shape, dtype in zip(shapes, dtypes, strict=True))
    except (TypeError, ValueError, AttributeError):
        return None


def _nbytes(obj: Any) -> int:
    return len(_view(obj))


def _release(obj: Any) -> None:
    if obj is not None:
        obj.ref_count_down()


def _release_all(objs: list[Any]) -> list[Any]:
    for i, obj in enumerate(objs):
        _release(obj)
        objs[i] = None
    return objs


def _batches(items: list[int], size: Any) -> list[list[int]]:
    """Runs of at most BATCH_KEYS items and BATCH_BYTES (at least one item)."""
    out: list[list[int]] = []
    run: list[int] = []
    nbytes = 0
    for i in items:
        n = size(i)
        if run and (len(run) >= BATCH_KEYS or nbytes + n > BATCH_BYTES):
            out.append(run)
            run, nbytes = [], 0
        run.append(i)
        nbytes += n
    if run:
        out.append(run)
    return out

