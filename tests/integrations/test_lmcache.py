"""rpcbuf as LMCache's remote backend, driven as LMCache drives it: LMCache's
own engine on the CPU (``lmcache_harness``: its StorageManager,
LocalCPUBackend, RemoteBackend, serde and plugin launcher, with a dense CPU
"GPU connector" as the one stand-in) stores KV chunks through
``rpcbuf_lmcache.RpcbufConnector`` into a real rpcbufd, the local tier is
cleared, and the same tensors come back from rpcbuf.

Runs under the LMCache venv (``make test-integrations``); skipped where
LMCache is not installed (``make test``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache")

import torch
from lmcache_harness import CHUNK, destroy, kv_tensor, make_engine

import rpcbuf
from conftest import DaemonProc, start_daemon

CHUNK_BYTES = 4 << 20  # a chunk of the harness's default shape


def _extra(d: DaemonProc | str, token: str, **more: Any) -> dict[str, Any]:
    addr = d if isinstance(d, str) else d.addr
    return {"remote_storage_plugin.rpcbuf.module_path": "rpcbuf_lmcache",
            "remote_storage_plugin.rpcbuf.class_name": "RpcbufConnector",
            "remote_storage_plugin.rpcbuf.endpoint": addr,
            "remote_storage_plugin.rpcbuf.token": token,
            **{f"remote_storage_plugin.rpcbuf.{k}": v for k, v in more.items()}}


class Engine:
    """An LMCache engine with rpcbuf as its remote tier; ``store``,
    ``clear_local`` and ``retrieve`` as a serving engine uses them."""

    def __init__(self, extra: dict[str, Any], node: DaemonProc | None = None,
                 tenant: str = "", **kw: Any) -> None:
        self.engine, self.instance = make_engine(remote_storage_plugins=["rpcbuf"],
                                                 extra_config=extra, **kw)
        self.node, self.tenant = node, tenant
        self.unfull = bool(kw.get("save_unfull_chunk"))

    @property
    def remote(self) -> Any:
        return self.engine.storage_manager.storage_backends.get("RemoteBackend-rpcbuf")

    def store(self, tokens: torch.Tensor, kv: torch.Tensor, node: bool = True) -> None:
        """Store, and wait (at most 30 s) until rpcbuf committed every chunk
        (LMCache puts to its remote tier in the background)."""
        before = asyncio.run(_blocks(self.node, self.tenant))["puts"] \
            if node and self.node else 0
        self.engine.store(tokens, kv=kv)
        if not node or self.node is None:
            time.sleep(0.5)
            return
        want = before + -(-len(tokens) // CHUNK) if self.unfull else before + len(tokens) // CHUNK
        for _ in range(300):
            if asyncio.run(_blocks(self.node, self.tenant))["puts"] >= want:
                return
            time.sleep(0.1)
        raise AssertionError(f"rpcbuf did not get the {len(tokens) // CHUNK} chunks")

    def clear_local(self) -> None:
        self.engine.clear(locations=["LocalCPUBackend"])

    def retrieve(self, tokens: torch.Tensor, like: torch.Tensor) -> tuple[int, torch.Tensor]:
        out = torch.zeros_like(like)
        mask = self.engine.retrieve(tokens, kv=out)
        return int(mask.sum()), out

    def close(self) -> None:
        destroy(self.instance)


@pytest.fixture(scope="module")
def node(daemon_factory) -> DaemonProc:  # type: ignore[no-untyped-def]
    return daemon_factory("--device", "cpu:512MiB", "--quota", "small:24MiB:1000")  # type: ignore[no-any-return]


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


async def _blocks(d: DaemonProc | None, tenant: str) -> dict[str, Any]:
    assert d is not None
    async with d.connect(tenant) as c:
        return dict((await c.stats())["blocks"])


def test_chunks_come_back_from_rpcbuf(node: DaemonProc, engines: list[Engine]) -> None:
    e = Engine(_extra(node, node.token("lm1")), node, "lm1")
    engines.append(e)
    assert e.remote is not None
    tokens, kv = torch.arange(4 * CHUNK), kv_tensor(4 * CHUNK, seed=1)
    e.store(tokens, kv)
    st = asyncio.run(_blocks(node, "lm1"))
    assert st["blocks"] == 4 and st["bytes"] == 4 * CHUNK_BYTES, st
    e.clear_local()
    hit, out = e.retrieve(tokens, kv)
    assert hit == 4 * CHUNK
    assert torch.equal(out, kv)  # byte for byte, from rpcbuf
    assert asyncio.run(_blocks(node, "lm1"))["hits"] >= 4
    # The connector's own list and batched contains, as LMCache calls them.
    conn = e.remote.connection
    keys = asyncio.run_coroutine_threadsafe(conn.list(), e.remote.loop).result(30)
    assert len(keys) == 4


def test_an_unfull_last_chunk_comes_back_too(node: DaemonProc, engines: list[Engine]) -> None:
    """A full chunk is read in one round trip; the unfull last one (another
    size) by its metadata, in a second."""
    e = Engine(_extra(node, node.token("lm7")), node, "lm7", save_unfull_chunk=True)
    engines.append(e)
    tokens, kv = torch.arange(CHUNK + CHUNK // 2) + 11, kv_tensor(CHUNK + CHUNK // 2, seed=8)
    e.store(tokens, kv)
    e.clear_local()
    hit, out = e.retrieve(tokens, kv)
    assert hit == len(tokens) and torch.equal(out, kv)


def test_eviction_under_a_small_quota(node: DaemonProc, engines: list[Engine]) -> None:
    e = Engine(_extra(node, node.token("small")), node, "small")
    engines.append(e)
    a_tokens, a_kv = torch.arange(4 * CHUNK), kv_tensor(4 * CHUNK, seed=2)
    b_tokens, b_kv = torch.arange(4 * CHUNK) + 100_000, kv_tensor(4 * CHUNK, seed=3)
    e.store(a_tokens, a_kv)
    e.store(b_tokens, b_kv)  # 32 MiB of chunks into 24 MiB: a's go
    st = asyncio.run(_blocks(node, "small"))
    assert st["evictions"] >= 2 and st["bytes"] <= 24 << 20, st  # a's oldest went first
    e.clear_local()
    hit, out = e.retrieve(b_tokens, b_kv)
    assert hit == 4 * CHUNK and torch.equal(out, b_kv)
    hit, _ = e.retrieve(a_tokens, a_kv)
    assert hit == 0  # evicted: a miss, not an error


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_daemon_restart_is_a_miss_not_an_error(tmp_path: Path,
                                                 engines: list[Engine]) -> None:
    port = _free_port()
    flags = ("--listen", f"127.0.0.1:{port}", "--device", "cpu:256MiB")
    d = start_daemon(tmp_path, *flags)
    try:
        e = Engine(_extra(d, d.token("lm3")), d, "lm3")
        engines.append(e)
        tokens, kv = torch.arange(2 * CHUNK), kv_tensor(2 * CHUNK, seed=4)
        e.store(tokens, kv)
        e.clear_local()
        assert d.stop() == 0
        hit, _ = e.retrieve(tokens, kv)  # the daemon is gone: a miss
        assert hit == 0
        e.store(tokens, kv, node=False)  # dropped, with a warning: no exception
        e.clear_local()
        # (the daemon removed its ready file when it stopped: the new one waits for its own)
        d = start_daemon(tmp_path, *flags)  # the same address and secret, empty
        e.node = d
        time.sleep(1.5)  # the connector tries again at most once a second
        hit, _ = e.retrieve(tokens, kv)
        assert hit == 0  # a restarted daemon starts empty
        e.store(tokens, kv)
        e.clear_local()
        hit, out = e.retrieve(tokens, kv)
        assert hit == 2 * CHUNK and torch.equal(out, kv)
    finally:
        d.stop()


class _Loop:
    """An event loop on its own thread, as LMCache's RemoteBackend runs one."""

    def __enter__(self) -> asyncio.AbstractEventLoop:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        return self.loop

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_a_wrong_token_is_a_clear_error(node: DaemonProc, engines: list[Engine]) -> None:
    from rpcbuf_lmcache import RpcbufAuthError, RpcbufConnector

    good = Engine(_extra(node, node.token("lm4")))  # for a local CPU backend to hand over
    engines.append(good)
    backend = good.engine.storage_manager.local_cpu_backend
    bad_token = node.token("lm4")[:-4] + "AAAA"
    with _Loop() as loop:
        backend.config.extra_config = _extra(node, bad_token)
        with pytest.raises(RpcbufAuthError, match="AUTH_FAILED"):
            RpcbufConnector(loop=loop, local_cpu_backend=backend, config=backend.config)
        backend.config.extra_config = {k: v for k, v in _extra(node, "").items()
                                       if not k.endswith(".token")}
        env = os.environ.pop("RPCBUF_TOKEN", None)
        try:
            with pytest.raises(RpcbufAuthError, match="no token"):
                RpcbufConnector(loop=loop, local_cpu_backend=backend, config=backend.config)
        finally:
            if env is not None:
                os.environ["RPCBUF_TOKEN"] = env
    # Through LMCache's plugin route: the engine comes up without the remote
    # tier (LMCache logs our sentence) rather than with one that fails later.
    bad = Engine(_extra(node, bad_token))
    engines.append(bad)
    assert bad.remote is None


def test_two_tenants_never_see_each_others_chunks(node: DaemonProc,
                                                  engines: list[Engine]) -> None:
    alice = Engine(_extra(node, node.token("lm-alice")), node, "lm-alice")
    bob = Engine(_extra(node, node.token("lm-bob")), node, "lm-bob")
    engines += [alice, bob]
    tokens, kv = torch.arange(2 * CHUNK) + 7, kv_tensor(2 * CHUNK, seed=5)
    alice.store(tokens, kv)
    bob.clear_local()
    hit, _ = bob.retrieve(tokens, kv)  # the same model and tokens: the same keys
    assert hit == 0
    assert asyncio.run(_blocks(node, "lm-bob"))["blocks"] == 0
    alice.clear_local()
    hit, out = alice.retrieve(tokens, kv)
    assert hit == 2 * CHUNK and torch.equal(out, kv)


def test_the_client_api_sees_what_lmcache_stored(node: DaemonProc,
                                                 engines: list[Engine]) -> None:
    e = Engine(_extra(node, node.token("lm6"), ttl=3600), node, "lm6")
    engines.append(e)
    e.store(torch.arange(CHUNK) + 3, kv_tensor(CHUNK, seed=6))

    async def look() -> list[Any]:
        async with node.connect("lm6") as c:
            keys, _ = await c.list_blocks()
            return await c.lookup_blocks(keys, meta=True)

    (info,) = asyncio.run(look())
    assert info["nbytes"] == CHUNK_BYTES and info["expires_at"] is not None
    assert len(info["meta"]) == 28  # LMCache's RemoteMetadata: length, format, dtype, shape
    assert isinstance(rpcbuf.RpcContext, type)


def test_a_token_that_expires_mid_session_is_a_clear_error_on_every_call(
        node: DaemonProc, engines: list[Engine]) -> None:
    """Once the daemon ends the session because the token expired, every
    call says so as ``RpcbufAuthError``: ``list``, ``ping`` and
    ``remove_sync`` as much as get and put (they let the raw TOKEN_EXPIRED
    out before)."""
    from rpcbuf_lmcache import RpcbufAuthError, RpcbufConnector

    good = Engine(_extra(node, node.token("lm6")))  # for a local CPU backend to hand over
    engines.append(good)
    backend = good.engine.storage_manager.local_cpu_backend
    with _Loop() as loop:
        backend.config.extra_config = _extra(node, node.token("lm6", ttl=2.0))
        conn = RpcbufConnector(loop=loop, local_cpu_backend=backend, config=backend.config)

        def run(coro: Any) -> Any:
            return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

        try:
            assert run(conn.ping()) == 0
            time.sleep(3.0)  # the token runs out; the daemon ends the session
            for call in (conn.list, conn.ping):
                with pytest.raises(RpcbufAuthError, match="TOKEN_EXPIRED"):
                    run(call())
        finally:
            with contextlib.suppress(Exception):
                run(conn.close())
