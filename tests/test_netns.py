"""Many hosts on one machine: three rpcbufd in their own network namespaces,
reached from the root namespace over veth pairs, UCX over tcp.

Clients are subprocesses (the CLI, or ``netns_client.py``) whose UCX uses the
veths; see ``netns.py`` for the fixture and why.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from models import gguf_tensors, llama_tensors, write_gguf, write_safetensors
from netns import NetnsCluster, netns_hosts

__all__ = ["netns_hosts"]  # the fixture, imported so pytest finds it


def run(c: NetnsCluster, *args: str, script: str | None = None,
        timeout: float = 90) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, script] if script else [sys.executable, "-m", "rpcbuf.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=ROOT,
                          env=c.client_env(), timeout=timeout)


def cli(c: NetnsCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return run(c, *args, "--endpoints", c.endpoints, "--token", c.token)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("netns-models")
    return {"st": write_safetensors(d / "llama.safetensors", llama_tensors(9, hidden=128)),
            "gguf": write_gguf(d / "llama.gguf", gguf_tensors(6))}


async def test_devices_load_ls_unload_across_hosts(netns_hosts: NetnsCluster,
                                                   models: dict[str, Path]) -> None:
    c = netns_hosts
    res = await asyncio.to_thread(cli, c, "devices", "--json")
    assert res.returncode == 0, res.stderr
    devs = json.loads(res.stdout)
    assert [d[0]["node_id"] for d in devs.values()] == ["host1", "host2", "host3"]
    assert [d[0]["slot"] for d in devs.values()] == [0, 1, 2]
    res = await asyncio.to_thread(cli, c, "devices")
    assert res.returncode == 0 and c.hosts[2].addr in res.stdout and "host2" in res.stdout
    res = await asyncio.to_thread(cli, c, "load", str(models["st"]), "--placement",
                                  "0:prolog,epilog;1:4;2:all", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    h1, h2, h3 = (h.addr for h in c.hosts)
    assert out["nodes"][h1]["tensors"] == 3 and out["nodes"][h2]["tensors"] == 4 * 9
    assert out["nodes"][h3]["tensors"] == 5 * 9
    assert out["bytes_sent"] == out["bytes_total"]
    res = await asyncio.to_thread(cli, c, "load", str(models["st"]), "--placement",
                                  "0:prolog,epilog;1:4;2:all", "--json")  # again: nothing moves
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["bytes_sent"] == 0
    res = await asyncio.to_thread(cli, c, "load", str(models["gguf"]), "--json")  # by free memory
    assert res.returncode == 0, res.stderr
    auto = json.loads(res.stdout)
    assert sum(n["tensors"] for n in auto["nodes"].values()) == len(gguf_tensors(6)) + 1
    res = await asyncio.to_thread(cli, c, "ls", "--json")
    listed = {a: sorted(b["name"] for b in bufs) for a, bufs in json.loads(res.stdout).items()}
    assert "llama/slot0" in listed[h1] and "llama/slot2" in listed[h3]
    res = await asyncio.to_thread(cli, c, "unload", "llama", "--json")
    assert res.returncode == 0, res.stderr
    res = await asyncio.to_thread(cli, c, "ls", "--json")
    assert not any(json.loads(res.stdout).values())


async def test_node_dies_mid_upload_then_retry_succeeds(netns_hosts: NetnsCluster,
                                                        models: dict[str, Path]) -> None:
    c = netns_hosts
    victim = c.hosts[2]
    assert victim.proc is not None
    spec = "0:prolog,epilog;1:4;2:all"
    res = await asyncio.to_thread(run, c, c.endpoints, c.token, str(models["st"]), spec,
                                  victim.addr, str(victim.proc.pid),
                                  script=str(Path(__file__).with_name("netns_client.py")))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["failed"] == {victim.addr: "CONNECTION_LOST"}  # which node failed
    assert set(out["cleaned"]) == {c.hosts[0].addr, c.hosts[1].addr}
    assert out["left"] == {c.hosts[0].addr: [], c.hosts[1].addr: []}  # cleaned up
    victim.proc.wait(10)
    victim.spawn(c.secret)  # the node comes back at the same address
    victim.wait_ready()
    res = await asyncio.to_thread(cli, c, "load", str(models["st"]), "--placement", spec,
                                  "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["nodes"][victim.addr]["tensors"] == 5 * 9
    res = await asyncio.to_thread(cli, c, "unload", "llama")
    assert res.returncode == 0, res.stderr
