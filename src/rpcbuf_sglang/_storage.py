"""``RpcbufHiCacheStorage``: SGLang's HiCache storage tier over the cluster key
space (``rpcbuf.BlockCluster``).

SGLang calls synchronously from its prefetch and backup threads; the sessions
live on the backend's own loop thread (``_LoopThread``), each call one coroutine
bounded by ``timeout``.  ``_call`` is the one place rpcbuf's errors become
SGLang's answers: a gone node, a timeout or a refusal is a miss (a warning at
most every ``WARN_EVERY`` s); a refused token is ``TokenRefused`` at start, later
logged once then misses; no node at start: misses, reopened at most every
``RECONNECT_EVERY`` s.

A page is one block per K/V half (one for MLA).  The ``_v1`` calls use the host
pool's memory in place, the generic calls the flat tensors SGLang hands over,
split alike, so both store the same bytes under the same keys.  A set skips
pages already there; batches split at ``BATCH_KEYS``/``BATCH_BYTES``; over
``MAX_PAGES`` pages is a miss.  Caller-named strings enter logs only through a
shortened ``repr``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

import rpcbuf
from rpcbuf.control.client.blockops import LIST_MAX_KEYS
from rpcbuf.control.wire.protocol import MAX_BLOCK_KEYS

from ._config import Names, Settings
from ._pages import PAGE_LAYOUTS, PoolViews, split, tensor_bytes

__all__ = ["RpcbufHiCacheStorage", "TokenRefused"]

log = logging.getLogger("rpcbuf.sglang")
T = TypeVar("T")
BATCH_KEYS = 1024  # blocks in one rpcbuf request
BATCH_BYTES = 256 << 20  # bytes in one rpcbuf request
MAX_PAGES = 8192  # pages in one call of SGLang's (it sends 128 at most)
RECONNECT_EVERY = 1.0  # s between attempts to open the key space again
WARN_EVERY = 30.0  # s between two warnings of the same kind
_REFUSED = (rpcbuf.AuthFailed, rpcbuf.TokenExpired, rpcbuf.Forbidden)
_MISSES = (rpcbuf.RpcBufError, OSError, ValueError, TimeoutError, asyncio.TimeoutError)


class TokenRefused(RuntimeError):
    """The daemons refused this backend's token: no retry helps."""


def _say(x: object, most: int = 200) -> str:
    """Text that came from outside (an error, a key) as it may enter a log line."""
    return repr(str(x)[:most])


class _LoopThread:
    """An event loop on a daemon thread of its own; ``run`` waits for a
    coroutine on it from any other thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rpcbuf-sglang",
                                       daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[T], timeout: float) -> T:
        fut = asyncio.run_coroutine_threadsafe(_bounded(coro, timeout), self.loop)
        try:
            return fut.result(timeout + 5)  # (the loop's own bound comes first)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no answer within {timeout:g} s") from None

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


async def _bounded(coro: Awaitable[T], timeout: float) -> T:
    return await asyncio.wait_for(coro, timeout)


@dataclass
class _Stats:
    """What ``get_stats`` hands SGLang: StorageMetrics' four lists."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)

    def add(self, what: str, pages: int, seconds: float, page_bytes: int) -> None:
        if pages <= 0 or len(self.prefetch_pgs) + len(self.backup_pgs) > 100_000:
            return  # (nobody collects: keep it bounded)
        gbps = pages * page_bytes / max(seconds, 1e-9) / (1 << 30)
        if what == "get":
            self.prefetch_pgs.append(pages)
            self.prefetch_bandwidth.append(gbps)
        else:
            self.backup_pgs.append(pages)
            self.backup_bandwidth.append(gbps)


class RpcbufHiCacheStorage(HiCacheStorage):
    """Made by SGLang as ``cls(storage_config, kwargs)`` (the ``dynamic``
    backend) or ``cls(storage_config, mem_pool_host)``."""

    def __init__(self, storage_config: Any, mem_pool_host: Any = None) -> None:
        self.settings = Settings.read(getattr(storage_config, "extra_config", None))
        self.names = Names.of(storage_config, self.settings.tag)
        self.storage_config = storage_config
        extra = getattr(storage_config, "extra_config", None) or {}
        self.interface_v1 = bool(extra.get("interface_v1", False))
        self.mem_pool_host: Any = None
        self._views: PoolViews | None = None
        self._keys: rpcbuf.BlockCluster | None = None
        self._opening: asyncio.Lock | None = None
        self._failed_at = -1e9
        self._refused: str | None = None
        self._warned: dict[str, float] = {}
        self._stats = _Stats()
        self._closed = False
        self._lt = _LoopThread()
        # Open the sessions now: a refused token is a clear error at start; a
        # daemon that is not up yet only means misses until it is.
        try:
            self._lt.run(self._space(), self.settings.timeout + 5)
        except _REFUSED as exc:
            self._lt.close()
            raise TokenRefused(f"rpcbuf at {self.settings.endpoints} refused the "
                               f"token: {exc}") from None
        except _MISSES as exc:
            log.warning("rpcbuf_sglang: %s not reachable yet (%s); misses until it is",
                        _say(self.settings.endpoints), _say(exc))
        if mem_pool_host is not None and hasattr(mem_pool_host, "get_page_buffer_meta"):
            self.register_mem_pool_host(mem_pool_host)

    # -- the key space ----------------------------------------------------------------

    async def _space(self) -> rpcbuf.BlockCluster | None:
        """The key space, opened if need be; None while no node answers.  Raises a
        token refusal."""
        if self._keys is not None or self._closed:
            return self._keys
        if time.monotonic() - self._failed_at < RECONNECT_EVERY:
            return None
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._keys is None:
                s = self.settings
                try:
                    self._keys = await rpcbuf.BlockCluster.connect(
                        s.endpoints, s.token, replicas=s.replicas, timeout=s.timeout,
                        cluster=s.cluster, same_host=s.same_host,
                        reconnect=(RECONNECT_EVERY, 5.0))
                except _REFUSED:
                    raise
                except (rpcbuf.RpcBufError, OSError):
                    self._failed_at = time.monotonic()
                    raise
                log.info("rpcbuf_sglang: sessions with %s", _say(", ".join(self._keys.live)))
        return self._keys

    def _call(self, what: str, fn: Callable[[rpcbuf.BlockCluster], Awaitable[T]],
              miss: T) -> T:
        """``fn`` of the key space on the loop within ``timeout``; ``miss`` for
        every failure."""
        if self._closed or self._refused is not None:
            return miss

        async def run() -> T:
            space = await self._space()
            return miss if space is None else await fn(space)

        try:
            return self._lt.run(run(), self.settings.timeout)
        except _REFUSED as exc:
            self._refused = str(exc)
            log.error("rpcbuf_sglang: rpcbuf refused the token (%s): every page is a miss "
                      "from now on", _say(exc))
        except _MISSES as exc:
            self._warn(what, f"rpcbuf_sglang: {what} missed: %s", _say(exc))
        return miss

    def _warn(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._warned.get(kind, -1e9) >= WARN_EVERY:
            self._warned[kind] = now
            log.warning(msg, *args)

    # -- the pool ---------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Raises ValueError for a pool whose pages are not contiguous per K/V half
        (``layer_first``) when ``interface_v1`` is on."""
        super().register_mem_pool_host(mem_pool_host)
        views = PoolViews(mem_pool_host)
        if self.interface_v1 and views.layout not in PAGE_LAYOUTS:
            raise ValueError(f"rpcbuf_sglang: interface_v1 needs a host layout whose pages "
                             f"are contiguous ({', '.join(PAGE_LAYOUTS)}), not "
                             f"{views.layout!r}")
        self._views = views
        self.names = Names.of(self.storage_config, self.settings.tag, mem_pool_host)

    # -- the one read and the one write -----------------------------------------------

    def _plan(self, keys: Sequence[Any]) -> list[list[str] | None]:
        if len(keys) > MAX_PAGES:
            self._warn("batch", "rpcbuf_sglang: a call of %d pages refused (at most %d)",
                       len(keys), MAX_PAGES)
            return [None] * len(keys)
        out = [self.names.keys(k) for k in keys]
        bad = next((k for k, b in zip(keys, out, strict=True) if b is None), None)
        if bad is not None:
            self._warn("key", "rpcbuf_sglang: a page hash that cannot be a key: %s", _say(bad))
        return out

    def _read(self, what: str, blocks: list[list[str] | None],
              spans: list[list[np.ndarray] | None]) -> list[bool]:
        """Read each page's blocks into its spans: which pages were read whole."""
        want = [i for i, (b, s) in enumerate(zip(blocks, spans, strict=True))
                if b is not None and s is not None]
        if not want:
            return [False] * len(blocks)
        keys = [k for i in want for k in blocks[i]]  # type: ignore[union-attr]
        outs = [a for i in want for a in spans[i]]  # type: ignore[union-attr]

        async def get(space: rpcbuf.BlockCluster) -> list[bool]:
            hits: list[bool] = []
            for lo, hi in _runs([a.nbytes for a in outs]):
                hits += await space.get_blocks(keys[lo:hi], outs[lo:hi])
            return hits

        t0 = time.perf_counter()
        hits = self._call(what, get, [False] * len(keys))
        n = len(self.names.parts)
        ok = [False] * len(blocks)
        for j, i in enumerate(want):
            ok[i] = all(hits[j * n:(j + 1) * n])
        self._stats.add("get", sum(ok), time.perf_counter() - t0, self._page_bytes())
        return ok

    def _write(self, what: str, blocks: list[list[str] | None],
               spans: list[list[np.ndarray] | None]) -> list[bool]:
        """Put each page's spans but for pages already there; which are stored."""
        want = [i for i, (b, s) in enumerate(zip(blocks, spans, strict=True))
                if b is not None and s is not None]
        if not want:
            return [False] * len(blocks)
        n = len(self.names.parts)
        ttl = self.settings.ttl

        async def put(space: rpcbuf.BlockCluster) -> list[bool]:
            keys = [k for i in want for k in blocks[i]]  # type: ignore[union-attr]
            there = await _exist(space, keys)
            stored = [all(there[j * n:(j + 1) * n]) for j in range(len(want))]
            todo = [j for j, s in enumerate(stored) if not s]
            pairs = [(k, a) for j in todo
                     for k, a in zip(blocks[want[j]], spans[want[j]], strict=True)]  # type: ignore[arg-type]
            dropped: set[str] = set()
            for lo, hi in _runs([a.nbytes for _, a in pairs]):
                got = await space.put_blocks(pairs[lo:hi], ttl=ttl)
                dropped.update(got["dropped"])
            for j in todo:
                stored[j] = not any(k in dropped for k in blocks[want[j]])  # type: ignore[union-attr]
            return stored

        t0 = time.perf_counter()
        stored = self._call(what, put, [False] * len(want))
        ok = [False] * len(blocks)
        for j, i in enumerate(want):
            ok[i] = stored[j]
        self._stats.add("set", sum(ok), time.perf_counter() - t0, self._page_bytes())
        return ok

    def _page_bytes(self) -> int:
        return 0 if self._views is None else self._views.page_bytes()

    def _flat(self, target: Any, size: Any = None) -> list[np.ndarray] | None:
        """A generic call's page (a flat tensor, or an address and size in the
        host pool) as its spans."""
        view: np.ndarray | None
        if isinstance(target, int) and not isinstance(target, bool):
            if self._views is None or not isinstance(size, int):
                return None
            try:
                view = self._views.view(target, size)
            except ValueError:
                return None
        else:
            view = tensor_bytes(target) if target is not None else None
        return None if view is None else split(view, len(self.names.parts))

    # -- SGLang's interface: zero copy --------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: Any,
                     extra_info: Any = None) -> list[bool]:
        """Read pages straight into the host pool's slots ``host_indices``."""
        return self._read("batch_get_v1", self._plan(keys), self._pool_spans(keys, host_indices))

    def batch_set_v1(self, keys: list[str], host_indices: Any,
                     extra_info: Any = None) -> list[bool]:
        """Store pages straight from the host pool's slots ``host_indices``."""
        return self._write("batch_set_v1", self._plan(keys), self._pool_spans(keys, host_indices))

    def _pool_spans(self, keys: Sequence[str], host_indices: Any
                    ) -> list[list[np.ndarray] | None]:
        if self._views is None or not keys or len(keys) > MAX_PAGES:
            if self._views is None:
                self._warn("pool", "rpcbuf_sglang: a _v1 call before register_mem_pool_host")
            return [None] * len(keys)
        try:
            return list(self._views.pages(host_indices, len(keys), len(self.names.parts)))
        except (ValueError, TypeError, AssertionError) as exc:
            self._warn("pool", "rpcbuf_sglang: the pool's spans: %s", _say(exc))
            return [None] * len(keys)

    # -- SGLang's interface: generic ----------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Read a page into ``target_location``; it, or None (a miss)."""
        return self.batch_get([key], [target_location], [target_sizes])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        """Read pages into ``target_locations``; each, or None (a miss)."""
        targets = list(target_locations or [None] * len(keys))
        sizes = list(target_sizes or [None] * len(keys))
        if not len(targets) == len(sizes) == len(keys):
            return [None] * len(keys)
        spans = [self._flat(t, s) for t, s in zip(targets, sizes, strict=True)]
        ok = self._read("batch_get", self._plan(keys), spans)
        return [t if hit else None for t, hit in zip(targets, ok, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Store a page (``value``, or ``target_location``/``target_sizes``)."""
        return self.batch_set([key], [value], [target_location], [target_sizes])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store pages; True when every one is stored."""
        if not keys:
            return False
        vals = list(values or [None] * len(keys))
        locs = list(target_locations or [None] * len(keys))
        sizes = list(target_sizes or [None] * len(keys))
        if not len(vals) == len(locs) == len(sizes) == len(keys):
            return False
        spans = [self._flat(v, None) if v is not None else self._flat(loc, s)
                 for v, loc, s in zip(vals, locs, sizes, strict=True)]
        return all(self._write("batch_set", self._plan(keys), spans))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many pages from the first are stored whole (SGLang's prefix hit)."""
        blocks = self._plan(keys)
        head = next((i for i, b in enumerate(blocks) if b is None), len(blocks))
        if head == 0:
            return 0
        flat = [k for b in blocks[:head] for k in b]  # type: ignore[union-attr]
        there = self._call("batch_exists", lambda s: _exist(s, flat), [False] * len(flat))
        n = len(self.names.parts)
        return next((i for i in range(head) if not all(there[i * n:(i + 1) * n])), head)

    # -- the rest ---------------------------------------------------------------------

    def clear(self) -> bool:
        """Remove this model's and shard's pages, at most ``LIST_MAX_KEYS`` per
        call; True when none is left."""
        prefix = self.names.prefix

        async def clear(space: rpcbuf.BlockCluster) -> bool:
            removed = 0
            while removed < LIST_MAX_KEYS:
                keys, _ = await space.list_blocks(prefix=prefix, limit=MAX_BLOCK_KEYS)
                if not keys:
                    return True
                await space.remove_blocks(keys)
                removed += len(keys)
            return False

        return bool(self._call("clear", clear, False))

    def get_stats(self) -> Any:
        """``StorageMetrics`` of the calls since the last ``get_stats``."""
        stats, self._stats = self._stats, _Stats()
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:  # (where SGLang's metrics do not import: the same fields)
            return stats
        out = StorageMetrics()
        for name in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"):
            getattr(out, name).extend(getattr(stats, name))
        return out

    def close(self) -> None:
        """Close the sessions (within ``timeout``) and the loop's thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        space, self._keys = self._keys, None
        if space is not None:
            try:
                self._lt.run(space.close(), self.settings.timeout)
            except (*_MISSES, concurrent.futures.CancelledError) as exc:
                log.warning("rpcbuf_sglang: closing the sessions: %s", _say(exc))
                space.cluster.abort()
        self._lt.close()

    def __repr__(self) -> str:
        return f"<RpcbufHiCacheStorage {self.settings.endpoints} {self.names.prefix!r}>"


async def _exist(space: rpcbuf.BlockCluster, keys: list[str]) -> list[bool]:
    out: list[bool] = []
    for at in range(0, len(keys), MAX_BLOCK_KEYS):
        out += await space.blocks_exist(keys[at:at + MAX_BLOCK_KEYS])
    return out


def _runs(sizes: list[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of at most BATCH_KEYS items and BATCH_BYTES (at least one)."""
    out: list[tuple[int, int]] = []
    lo, nbytes = 0, 0
    for i, n in enumerate(sizes):
        if i > lo and (i - lo >= BATCH_KEYS or nbytes + n > BATCH_BYTES):
            out.append((lo, i))
            lo, nbytes = i, 0
        nbytes += n
    if lo < len(sizes):
        out.append((lo, len(sizes)))
    return out
