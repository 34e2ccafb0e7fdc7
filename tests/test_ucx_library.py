"""Which UCX each side really runs on (``rpcbuf.dataplane.ucx.library``), what the
node says of its own (``stats()["ucx"]``), and the sentences ``rpcbuf
doctor`` makes of them (``cli.doctor.ucx_checks``, a pure function)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from rpcbuf.cli.doctor import ucx_checks
from rpcbuf.dataplane import ucx, ucxlib

pytestmark = pytest.mark.ucx_path

WHEEL = {"path": "/venv/libucx/lib/libucp.so", "version": "1.21.0", "modules": ["cma", "cuda"],
         "verbs": False, "rdmacm": False, "cuda": True,
         "resources": ["self/memory", "tcp/lo", "sysv/memory"]}
SYSTEM = {**WHEEL, "path": "/usr/lib/x86_64-linux-gnu/libucp.so.0", "version": "1.13.1",
          "modules": ["cma", "ib", "rdmacm"], "verbs": True, "rdmacm": True, "cuda": False,
          "resources": ["tcp/lo", "rc_verbs/mlx5_0:1", "ud_verbs/mlx5_0:1"]}


def test_this_process_says_which_ucx_it_loaded() -> None:
    lib = ucx.library()
    assert lib["path"] and ".so" in lib["path"] and "libucp" in lib["path"]
    assert lib["version"] and lib["version"][0].isdigit()
    assert any(r.startswith("tcp/") for r in lib["resources"])
    assert lib["verbs"] == ("ib" in lib["modules"])


def test_which_ucx_is_found_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Doctor and stats ask often; the answer was read again each time
    (``/proc/self/maps``, a dlopen): now once, when UCX starts."""
    first = ucx.library()

    def again() -> None:
        raise AssertionError("read /proc/self/maps again")

    monkeypatch.setattr(ucxlib, "mapped", again)
    assert ucx.library() is first and first["error"] is None


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


def test_a_ucx_that_does_not_start_is_a_failure_naming_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen: UCX_NET_DEVICES=mlx5_0:1 where UCX has no such device made
    doctor itself crash with UCXXNoDeviceError; it is a FAIL with UCX's word."""
    broken = {**WHEEL, "resources": [], "error": "UCXXNoDeviceError: No such device"}
    got = _by_name(ucx_checks(broken, WHEEL, [], []))
    assert got["ucx here"].status == "fail" and "No such device" in got["ucx here"].message
    refused = {**SYSTEM, "resources": [], "error": "UnusableUCX: UCX 1.13.1 at /usr/lib is too old"}
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    got = _by_name(ucx_checks(refused, WHEEL, [], []))
    assert got["ucx here"].status == "fail" and "too old" in got["ucx here"].message
    assert "verbs yes" in got["ucx here"].message and "1.13.1" in got["ucx here"].message
    assert "check UCX_NET_DEVICES" not in got["ucx here"].message  # not the reason here
    assert "ucx devices" not in got  # a UCX that did not start sees no device: said once


def test_the_minimum_ucx_version_is_1_19_and_older_ones_are_refused_with_a_sentence() -> None:
    assert ucxlib.MIN_VERSION == (1, 19, 0)  # ucxx 0.52's __ucx_min_version__
    for fine in ("1.19.0", "1.21.0", "1.21.0-rc1", "2.0"):
        ucxlib.check_version(fine, "/x")
    for old in ("1.13.1", "1.18.9", "1.9"):
        with pytest.raises(ucxlib.UnusableUCX, match=rf"UCX {old} at /x is too old: rpcbuf "
                                                      r"needs UCX 1\.19\.0 or newer"):
            ucxlib.check_version(old, "/x")
    with pytest.raises(ucxlib.UnusableUCX, match="says its version is 'banana'"):
        ucxlib.check_version("banana", "/x")


def test_rpcbuf_ucx_is_wheel_system_or_an_absolute_directory(tmp_path: Path) -> None:
    assert ucxlib.choice({}) == ucxlib.choice({"RPCBUF_UCX": ""}) == "wheel"
    assert ucxlib.choice({"RPCBUF_UCX": " system "}) == "system"
    assert ucxlib.choice({"RPCBUF_UCX": "/opt/ucx/"}) == "/opt/ucx"
    for bad in ("opt/ucx", "System", "1.21", "/a\0b", 7):
        with pytest.raises(ucxlib.UnusableUCX, match=r"expected wheel, system, or the absolute"):
            ucxlib.choice({"RPCBUF_UCX": bad})
    with pytest.raises(ucxlib.UnusableUCX, match=r"no libucp\.so\.0 in"):
        ucxlib.lib_dir(str(tmp_path))
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / "libucp.so.0").write_bytes(b"")
    assert ucxlib.lib_dir(str(tmp_path)) == str(tmp_path / "lib64")
    assert ucxlib.lib_dir("system") is None


def test_this_process_runs_on_the_ucx_rpcbuf_ucx_chose() -> None:
    chosen = ucxlib.choice()
    ucx.ucxx()
    where = ucxlib.check_single()  # one UCX install mapped, never two
    assert where and ucx.library()["path"].startswith(where + "/")
    if chosen == "wheel":
        assert "/libucx/lib" in where
    elif chosen != "system":
        assert where == os.path.realpath(ucxlib.lib_dir(chosen) or "")


def _daemon_argv(tmp: Path) -> list[str]:
    return ["--listen", "127.0.0.1:0", "--ucx-port", "0", "--device", "cpu:16MiB",
            "--secret-file", str(tmp / "secret"), "--ready-file", str(tmp / "ready")]


def _start(tmp: Path, env: dict[str, str], prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = prelude + "import sys; from rpcbuf.control.daemon.service.main import main; " \
                     "sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *_daemon_argv(tmp)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})


def test_a_daemon_refuses_at_start_a_ucx_it_cannot_use(tmp_path: Path) -> None:
    """The real start path (main -> serve -> ucx.ucxx -> ucxlib.select):
    exit 2 and one sentence, no traceback, nothing listening."""
    for env, said in (({"RPCBUF_UCX": str(tmp_path / "none")}, "no libucp.so.0 in"),
                      ({"RPCBUF_UCX": "bogus"}, "expected wheel, system, or the absolute")):
        got = _start(tmp_path, env)
        assert got.returncode == 2, got.stderr[-3000:]
        assert got.stderr.startswith("rpcbufd: RPCBUF_UCX=") and said in got.stderr
        assert "Traceback" not in got.stderr and not (tmp_path / "ready").exists()
    # A UCX older than the minimum: the wheel's, against a minimum above it
    got = _start(tmp_path, {}, "import rpcbuf.dataplane.ucxlib as u; u.MIN_VERSION = (99, 0, 0); ")
    assert got.returncode == 2, got.stderr[-3000:]
    assert "is too old: rpcbuf needs UCX 99.0.0 or newer" in got.stderr
    assert "Traceback" not in got.stderr and not (tmp_path / "ready").exists()


def _system_ucx_version() -> str | None:
    code = "import ctypes; f = ctypes.CDLL('libucp.so.0').ucp_get_version_string; " \
           "f.restype = ctypes.c_char_p; print(f().decode())"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    return got.stdout.strip() if got.returncode == 0 else None


@pytest.mark.skipif(ucxlib.choice() != "wheel", reason="RPCBUF_UCX chose a UCX already")
def test_a_daemon_on_a_system_ucx_older_than_1_19_is_refused(tmp_path: Path) -> None:
    """Debian bookworm's libucx0 is 1.13.1 (.ci/run installs it as root)."""
    version = _system_ucx_version()
    if version is None or ucxlib.parse_version(version) >= ucxlib.MIN_VERSION:
        pytest.skip(f"no system UCX older than 1.19 here ({version or 'none'})")
    got = _start(tmp_path, {"RPCBUF_UCX": "system"})
    assert got.returncode == 2, got.stderr[-3000:]
    assert f"UCX {version} at " in got.stderr and "is too old" in got.stderr


CLIENT = textwrap.dedent("""
    import asyncio, sys
    import rpcbuf

    async def main():
        try:
            async with rpcbuf.connect(sys.argv[1], token=sys.argv[2], timeout=30,
                                      same_host=False):
                print("connected")
        except rpcbuf.UcxUnusable as exc:
            print("refused:", exc)

    asyncio.run(main())
""")


def test_a_client_refuses_at_connect_a_ucx_it_cannot_use(daemon_factory: Any,
                                                          tmp_path: Path) -> None:
    d = daemon_factory("--device", "cpu:16MiB")
    env = {**os.environ, "RPCBUF_UCX": str(tmp_path / "none")}
    got = subprocess.run([sys.executable, "-c", CLIENT, d.addr, d.token()], env=env,
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.startswith("refused: UCX_UNUSABLE: RPCBUF_UCX=") and \
        "no libucp.so.0 in" in got.stdout


def _copy_of_the_wheel(to: Path) -> Path:
    """A UCX install of its own at ``to`` (a copy of the wheel's libraries:
    a "site build" that every machine running these tests has)."""
    src = ucxlib.lib_dir("wheel")
    if src is None:
        pytest.skip("no libucx wheel to copy")
    (to / "lib" / "ucx").mkdir(parents=True)
    for name in (*ucxlib.LIBS, "libucm.so.0"):
        (to / "lib" / name).write_bytes(Path(src, name).read_bytes())
    for mod in Path(src, "ucx").glob("libuct_*.so.0"):  # the wheel's RPATH has $ORIGIN
        (to / "lib" / "ucx" / mod.name).write_bytes(mod.read_bytes())
    return to


CLIENT_ON = textwrap.dedent("""
    import asyncio, json, sys
    import numpy as np
    import rpcbuf
    from rpcbuf.dataplane import ucx

    async def main():
        async with rpcbuf.connect(sys.argv[1], token=sys.argv[2], timeout=30,
                                  same_host=False) as ctx:
            buf = await ctx.request_buffer(1 << 20)
            data = np.arange(1 << 20, dtype=np.uint8)
            await ctx.store_tensor(buf, data)
            ok = bool((await ctx.read_buffer(buf) == data).all())
            await ctx.release_buffer(buf)
            node = (await ctx.stats())["ucx"]["path"]
        print(json.dumps({"ok": ok, "here": ucx.library()["path"], "node": node}))

    asyncio.run(main())
""")


def test_rpcbuf_ucx_naming_an_install_is_what_both_sides_load_and_run_on(
        daemon_factory: Any, tmp_path: Path) -> None:
    """Seen: RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true left the wheel's libucp
    mapped; RPCBUF_UCX takes effect on the daemon and the client."""
    site = _copy_of_the_wheel(tmp_path / "site")
    env = {"RPCBUF_UCX": str(site)}
    d = daemon_factory("--device", "cpu:16MiB", env=env)
    got = subprocess.run([sys.executable, "-c", CLIENT_ON, d.addr, d.token()],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-3000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    assert out["ok"]
    assert out["here"].startswith(f"{site}/lib/libucp.so") and \
        out["node"].startswith(f"{site}/lib/libucp.so")
    assert f"at {site}/lib/libucp.so.0 (RPCBUF_UCX={site})" in d.log()


def test_two_ucx_installs_in_one_process_are_refused(tmp_path: Path) -> None:
    site = _copy_of_the_wheel(tmp_path / "site")
    code = textwrap.dedent(f"""
        import ctypes
        from rpcbuf.dataplane import ucxlib
        ctypes.CDLL({str(Path(ucxlib.lib_dir("wheel") or "", "libucs.so.0"))!r})
        try:
            ucxlib.select({{"RPCBUF_UCX": {str(site)!r}}})
        except ucxlib.UnusableUCX as exc:
            print("refused:", exc)
    """)
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.startswith("refused: two UCX installs are loaded in this process")


def test_doctor_on_a_refused_ucx_shows_that_ucx_not_a_token_failure(daemon_factory: Any,
                                                                    tmp_path: Path) -> None:
    """Seen: on the UCX path the refusal came out as `FAIL token ... [UCX_UNUSABLE]`."""
    d = daemon_factory("--device", "cpu:16MiB")
    env = {**os.environ, "RPCBUF_UCX": str(tmp_path / "none"), "RPCBUF_SAME_HOST": "0"}
    got = subprocess.run([sys.executable, "-m", "rpcbuf.cli", "doctor", "--endpoints",
                          d.addr,
                          "--token", d.token()], env=env, capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 1, got.stdout + got.stderr[-3000:]
    lines = [line.split() for line in got.stdout.splitlines() if line[:2] == "  "]
    checks = {words[1]: words[0] for words in lines if len(words) > 1 and
              words[0] in ("ok", "warn", "FAIL")}
    assert checks.get("token") is None and checks.get("transports") == "ok"
    said = " ".join(got.stdout.split())  # (its lines fold between words: a path starts one)
    assert "FAIL ucx here UCX does not start: UnusableUCX: RPCBUF_UCX=" in said, got.stdout
    assert "check UCX_NET_DEVICES" not in got.stdout and "ucx devices" not in checks


def test_ucxx_imported_on_another_ucx_before_rpcbuf_chose_is_refused(tmp_path: Path) -> None:
    site = _copy_of_the_wheel(tmp_path / "site")
    code = textwrap.dedent(f"""
        import ucxx  # the wheel's UCX, before rpcbuf could choose
        from rpcbuf.dataplane import ucxlib
        try:
            ucxlib.select({{"RPCBUF_UCX": {str(site)!r}}})
        except ucxlib.UnusableUCX as exc:
            print("refused:", exc)
        ucxlib.select({{"RPCBUF_UCX": "wheel"}})  # what it did load: fine
        print("wheel: fine")
    """)
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.startswith("refused: ucxx was imported before rpcbuf and loaded the UCX")
    assert got.stdout.rstrip().endswith("wheel: fine")
