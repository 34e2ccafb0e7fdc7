"""LMCache's engine over a two-node rpcbuf cluster: the connector's
``endpoint`` is the list "A;B", chunks spread over both nodes by rendezvous
hashing (``rpcbuf.BlockCluster``); a node killed turns its chunks into misses,
never errors, and puts go on to the other.  Runs under the LMCache venv
(``make test-integrations``); skipped where LMCache is not installed."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache")

import torch
from lmcache_harness import CHUNK, kv_tensor
from test_lmcache import Engine, _extra

from conftest import DaemonProc
from rpcbuf.control.formats.keyfile import load_or_create_secret

TENANT = "lmc"


@pytest.fixture
def pair(daemon_factory: Any, tmp_path: Path) -> Iterator[list[DaemonProc]]:
    secret = tmp_path / "secret"
    load_or_create_secret(secret)
    nodes = []
    for _ in range(2):
        d = daemon_factory("--secret-file", str(secret), "--device", "cpu:256MiB")
        d.secret_file = secret  # the last --secret-file is the daemon's
        nodes.append(d)
    yield nodes


async def _held(d: DaemonProc) -> int:
    async with d.connect(TENANT) as c:
        return int((await c.stats())["blocks"]["blocks"])


def _wait_stored(nodes: list[DaemonProc], n: int) -> list[int]:
    """Each node's chunk count, once they add up to ``n`` (LMCache puts in the background)."""
    for _ in range(300):
        got = [asyncio.run(_held(d)) for d in nodes if d.proc.poll() is None]
        if sum(got) >= n:
            return got
        time.sleep(0.1)
    raise AssertionError(f"rpcbuf did not get the {n} chunks")


def test_the_engine_over_a_two_node_cluster(pair: list[DaemonProc],
                                            engines: list[Engine]) -> None:
    a, b = pair
    e = Engine(_extra(f"{a.addr};{b.addr}", a.token(TENANT)))
    engines.append(e)
    assert e.remote is not None
    tokens, kv = torch.arange(16 * CHUNK) + 5, kv_tensor(16 * CHUNK, seed=21)
    e.engine.store(tokens, kv=kv)
    held = _wait_stored(pair, 16)
    assert all(h > 0 for h in held), held  # spread over both nodes
    e.clear_local()
    hit, out = e.retrieve(tokens, kv)
    assert hit == 16 * CHUNK and torch.equal(out, kv)
    # Node b killed: its chunks are misses, the prefix up to the first one hits.
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(10)
    e.clear_local()
    hit, out = e.retrieve(tokens, kv)
    assert hit < 16 * CHUNK and hit % CHUNK == 0
    assert torch.equal(out[:, :, :hit], kv[:, :, :hit])
    # Puts go on, all to a: then everything hits again.
    e.engine.store(tokens, kv=kv)
    _wait_stored([a], 16)
    e.clear_local()
    hit, out = e.retrieve(tokens, kv)
    assert hit == 16 * CHUNK and torch.equal(out, kv)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()
