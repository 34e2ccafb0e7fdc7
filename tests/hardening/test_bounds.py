"""Every request's work is bounded before it starts, and a refused request
leaves no trace: huge shapes, manifests that would pass the per-buffer limit
or the tenant's quota, forged log lines, renew storms, and what one tenant
can learn about the others."""

from __future__ import annotations

import ast
import json
import time
from pathlib import Path

import numpy as np
import pytest
from rawwire import frame, hello

import rpcbuf
from conftest import ROOT
from rpcbuf.control.daemon.observe import logs
from rpcbuf.control.wire import protocol as P
from rpcbuf.dataplane import staging


async def test_huge_shapes_are_refused_without_freezing_the_loop(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:8MiB")
    async with d.connect("alice") as a:
        bid = await a.request_buffer(4096)
        raw = hello(d.addr, d.token("alice"))
        probe = hello(d.addr, d.token("bob"))
        one = P.pack_u64([0])
        for op, fields in [
            ("dedup_store", {"hashes": P.pack_u64([1, 2]), "checksums": P.pack_u64([3]),
                             "names": ["t"], "kind_dtypes": ["u1"]}),
            ("store_batch", {"names": ["t"], "kind_dtypes": ["u1"]}),
        ]:
            for shape in ([1 << 62] * 60_000, [3] * 40, [1 << 62, 1 << 62]):
                t0 = time.monotonic()
                raw.send(frame({"op": op, "id": 1, "buffer_id": bid, "offsets": one,
                                "sizes": P.pack_u64([8]), "kind_shapes": [shape], **fields}))
                answer = raw.recv()
                assert answer is not None and not answer["ok"]
                assert answer["error"]["code"] == "BAD_REQUEST", answer
                assert "shape" in answer["error"]["message"]
                assert probe.call("ping")["ok"]
                assert time.monotonic() - t0 < 5.0, f"{op} {len(shape)} dims froze the daemon"
        raw.close()
        probe.close()
        await a.release_buffer(bid)


async def test_overlapping_read_batch_is_bounded_by_the_buffer(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:8MiB")
    async with d.connect("alice") as a:
        bid = await a.request_buffer(1 << 20)
        raw = hello(d.addr, d.token("alice"))
        n = 20_000  # 160 KB of request asking for 20 GiB of copying
        answer = raw.call("read_batch", buffer_id=bid, offsets=P.pack_u64([0] * n),
                          sizes=P.pack_u64([1 << 20] * n))
        assert not answer["ok"] and answer["error"]["code"] == "BAD_REQUEST", answer
        assert answer["error"]["details"]["nbytes"] == n << 20
        raw.close()
        await a.release_buffer(bid)


async def test_a_refused_batch_leaves_no_manifest_entries(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:64MiB", "--quota", "bob:2MiB:-")
    n = 60_000
    async with d.connect("alice") as a, d.connect("bob") as b:
        bid = await a.request_buffer(32 << 20)
        first = {f"a{i}": np.full(2, i, np.float32) for i in range(n)}
        await a.store_tensors(bid, first)
        end = (await a.get_buffer_meta(bid, tensors=False))["tensors_end"]
        more = {f"b{i}": np.full(2, i, np.float32) for i in range(n)}
        with pytest.raises(rpcbuf.BadRequest, match="at most 100000 tensors"):
            await a.store_tensors(bid, more, offset=end)  # 120,000 > MAX_ITEMS
        meta = await a.get_buffer_meta(bid, tensors=False)
        assert meta["tensor_count"] == n, "the refused batch left entries behind"
        await a.release_buffer(bid)
        # Manifest entries are charged to the tenant's quota: 1 MiB is 2048 entries
        small = await b.request_buffer(1 << 20)  # 1 MiB of bob's 2 MiB held
        with pytest.raises(rpcbuf.QuotaExceeded):
            await b.store_tensors(small, {f"t{i}": np.zeros(1, np.uint8) for i in range(4000)})
        assert (await b.get_buffer_meta(small, tensors=False))["tensor_count"] == 0
        await b.store_tensors(small, {f"t{i}": np.zeros(1, np.uint8) for i in range(100)})
        await b.release_buffer(small)
        assert (await b.stats())["bytes"] == {"cpu:0": 0}


def test_forged_audit_lines_are_refused_and_escaped(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:8MiB", "--log-format", "text")
    raw = hello(d.addr, d.token("mallory"))
    forged = "x\n2026-12-01 00:00:00,000 INFO rpcbuf.audit op=release tenant=bob buffer=b-1"
    for op, fields in [("release", {"buffer_id": forged}),
                       ("request_buffer", {"size": 4096, "name": forged}),
                       ("open_buffer", {"name": forged}),
                       ("read", {"buffer_id": "b-\x1b[2J", "offset": 0, "nbytes": 1})]:
        answer = raw.call(op, **fields)
        assert not answer["ok"] and answer["error"]["code"] == "BAD_REQUEST", answer
    raw.send(frame({"op": "ping", "id": 9, "bogus\nfield=1 tenant=bob": 1}))
    assert not raw.recv()["ok"]  # type: ignore[index]
    assert raw.call("ping")["ok"]
    raw.close()
    time.sleep(0.3)
    lines = d.log().splitlines()
    assert not [line for line in lines if "tenant=bob" in line], lines[-20:]
    # and in the formatter itself, whatever reaches it
    entry = {"op": "read", "tenant": "t", "session": "s", "buffer": "b\nop=x", "device": None,
             "offset": 0, "bytes": 1, "code": "OK", "duration_s": 0.0, "error": "e\r\nz"}
    assert "\n" not in logs._text(entry) and "\r" not in logs._text(entry)


def test_renew_storm_writes_few_audit_records(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    audit = tmp_path / "audit.log"
    d = daemon_factory("--device", "cpu:8MiB", "--audit-log", str(audit))
    raw = hello(d.addr, d.token("alice"))
    bid = raw.call("request_buffer", size=4096, ttl=60.0)["result"]["buffer_id"]
    n = 3000
    for i in range(n):
        raw.send(frame({"op": "renew", "id": 100 + i, "buffer_id": bid, "ttl": 60.0}))
    for _ in range(n):
        answer = raw.recv()
        assert answer is not None and answer["ok"], answer
    assert raw.call("release", buffer_id=bid)["ok"]
    raw.close()
    time.sleep(0.3)
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    renews = [r for r in records if r["op"] == "renew"]
    assert 1 <= len(renews) <= 5, len(renews)
    assert [r["op"] for r in records if r["op"] != "renew"] == ["request_buffer", "release"]


async def test_a_tenant_sees_only_its_own_usage(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:8MiB")
    async with d.connect("alice") as a, d.connect("bob") as b:
        theirs = [await b.request_buffer(1 << 20) for _ in range(3)]
        await b.store_tensor(theirs[0], np.ones(1 << 20, np.uint8))
        mine = await a.request_buffer(4096)
        st = await a.stats()
        assert st["buffers"] == 1 and st["sessions"] == 1
        staged = staging.SIZE if a.same_host else 0  # a same-host session's staging area
        assert st["bytes_stored"] == 0 and st["bytes"] == {"cpu:0": 4096 + staged}
        assert st["waiters"] == {"cpu:0": 0}
        dev = st["devices"][0]
        assert set(dev) >= {"total", "free", "largest_free"} and "buffers" not in dev
        assert (await a.get_buffer_meta(mine))["base_addr"] == 0
        with pytest.raises(rpcbuf.OutOfMemory) as info:
            await a.request_buffer(8 << 20)
        assert set(info.value.details) == {"requested", "block", "free", "largest_free", "device"}
        assert (await b.stats())["buffers"] == 3
        for bid in theirs:
            await b.release_buffer(bid)
        await a.release_buffer(mine)


def test_no_async_code_looks_a_buffer_up_without_a_pin() -> None:
    """The rule 'a pin before the first await', by construction: in the
    daemon, only synchronous code may use the plain lookups; async handlers
    get buffers from ``Held.get`` (pinned until the request ends)."""
    plain = {"_get", "get", "by_name"}
    offenders = []
    paths = sorted((ROOT / "src" / "rpcbuf" / "control" / "daemon").rglob("*.py"))
    assert len(paths) > 10  # the walk sees the daemon (a test that cannot fail is a defect)
    for path in paths:
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in plain:
                    owner = ast.unparse(node.func.value)
                    if owner in ("self", "self.registry", "self._registry", "registry") and \
                            (node.func.attr != "get" or owner != "self"):
                        offenders.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, offenders


def test_unprintable_names_never_reach_the_registry() -> None:
    for bad in ["a\nb", "\x00", "x\u2028y", "\x1b[31m"]:
        with pytest.raises(P.RequestError):
            P.parse_request({"op": "request_buffer", "id": 1, "size": 1, "name": bad})
    with pytest.raises(P.RequestError):
        P.parse_request({"op": "store_batch", "id": 1, "buffer_id": "b-x", "offsets": b"",
                         "sizes": b"", "names": ["ok", "not\nok"]})
    assert P.parse_request({"op": "open_buffer", "id": 1, "name": "llama-70b/shard 1 é"})
