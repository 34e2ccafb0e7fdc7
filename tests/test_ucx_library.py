"""Which UCX each side really runs on (``dataplane.ucx.library``), what the
node says of its own (``stats()["ucx"]``), and the sentences ``rpcbuf
doctor`` makes of them (``cli.doctor.ucx_checks``, a pure function)."""

from __future__ import annotations

from typing import Any

import pytest

from control.cli.doctor import ucx_checks
from dataplane import ucx

WHEEL = {"path": "/venv/libucx/lib/libucp.so", "version": "1.21.0", "modules": ["cma", "cuda"],
         "verbs": False, "rdmacm": False, "cuda": True,
         "resources": ["self/memory", "tcp/lo", "sysv/memory"]}
SYSTEM = {**WHEEL, "path": "/usr/lib/x86_64-linux-gnu/libucp.so.0", "version": "1.13.1",
          "modules": ["cma", "ib", "rdmacm"], "verbs": True, "rdmacm": True, "cuda": False,
          "resources": ["tcp/lo", "rc_verbs/mlx5_0:1", "ud_verbs/mlx5_0:1"]}


def test_this_process_says_which_ucx_it_loaded() -> None:
    lib = ucx.library()
    assert lib["path"] and lib["path"].endswith((".so", ".so.0")) and "libucp" in lib["path"]
    assert lib["version"] and lib["version"][0].isdigit()
    assert any(r.startswith("tcp/") for r in lib["resources"])
    assert lib["verbs"] == ("ib" in lib["modules"])


def _by_name(checks: list[Any]) -> dict[str, Any]:
    return {c.check: c for c in checks}


def test_rdma_devices_with_a_ucx_built_without_verbs_is_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.delenv("UCX_TLS", raising=False)
    got = _by_name(ucx_checks(WHEEL, WHEEL, ["mlx5_0"], ["mlx5_0"]))
    for side in ("ucx here", "ucx node"):
        assert got[side].status == "warn" and "built without verbs" in got[side].message
        assert "1.21.0" in got[side].message and "verbs no" in got[side].message
    fine = _by_name(ucx_checks(WHEEL, WHEEL, [], []))
    assert fine["ucx here"].status == "ok" and fine["ucx node"].status == "ok"
    rdma = _by_name(ucx_checks(SYSTEM, SYSTEM, ["mlx5_0"], ["mlx5_0"]))
    assert rdma["ucx here"].status == "ok" and "verbs yes" in rdma["ucx here"].message


def test_a_net_device_ucx_does_not_see_and_tcp_only_beside_rdma_are_warnings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")
    monkeypatch.setenv("UCX_TLS", "tcp")
    got = _by_name(ucx_checks(WHEEL, WHEEL, ["mlx5_0"], []))
    assert "mlx5_0:1" in got["ucx devices"].message and got["ucx devices"].status == "warn"
    assert got["ucx transports"].status == "warn"
    monkeypatch.setenv("UCX_TLS", "rc,tcp")
    ok = _by_name(ucx_checks(SYSTEM, SYSTEM, ["mlx5_0"], ["mlx5_0"]))
    assert "ucx devices" not in ok and "ucx transports" not in ok


def test_a_node_that_says_nothing_of_its_ucx_is_a_warning_not_a_crash() -> None:
    got = _by_name(ucx_checks(WHEEL, None, [], []))
    assert got["ucx node"].status == "warn"


async def test_the_node_says_which_ucx_it_runs(daemon_factory: Any) -> None:
    d = daemon_factory("--device", "cpu:16MiB")
    async with d.connect("alice", same_host=False) as ctx:
        lib = (await ctx.stats())["ucx"]
    assert lib["path"] and lib["version"] and isinstance(lib["resources"], list)
    assert sorted(lib["features"]) == sorted(ucx.FEATURES)  # the daemon: no RMA, AM, AMO
    assert f"UCX {lib['version']} at {lib['path']}" in d.log()


def test_a_ucx_that_does_not_start_is_a_failure_naming_why() -> None:
    """Seen: UCX_NET_DEVICES=mlx5_0:1 where UCX has no such device made
    doctor itself crash with UCXXNoDeviceError; it is a FAIL with UCX's word."""
    broken = {**WHEEL, "resources": [], "error": "UCXXNoDeviceError: No such device"}
    got = _by_name(ucx_checks(broken, WHEEL, [], []))
    assert got["ucx here"].status == "fail" and "No such device" in got["ucx here"].message
