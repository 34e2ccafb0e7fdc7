"""The README's two-node quick start, run as written: two daemons on this
machine as two nodes, one token, doctor, load with a placement, ls, unload.
Run twice in one folder (what it leaves behind must not fool the second
run, and must be ignored by git), and once with a port taken (it must stop
at once with a sentence, not wait for the daemons forever)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT


def quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- two-node-quick-start -->\n```sh\n(.*?)```", text, re.S)
    assert m, "the README lost its two-node quick start"
    return m.group(1)


def run_quick_start(folder: Path,
                    timeout: float = 240) -> tuple[subprocess.CompletedProcess[str], str]:
    if not (folder / ".venv").exists():
        (folder / ".venv").symlink_to(ROOT / ".venv")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPCBUF_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    env["COLUMNS"] = "80"
    script = "set -euo pipefail\n" + quick_start()
    # Its own session: whatever way it ends (a failed step under ``set -e``,
    # the timeout), the daemons it started in the background end with it
    # and leave its ports free (CI saw a timed-out run's daemons make the
    # next test's bind fail).
    proc = subprocess.Popen(["bash", "-c", script], cwd=folder, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    left = True
    try:
        out, err = proc.communicate(timeout=timeout)
        # What the script started, it stopped (SIGTERM: a moment to shut down).
        deadline = time.monotonic() + 30
        while left and time.monotonic() < deadline:
            left = _group_alive(proc.pid)
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert not left, "the quick start left a daemon running:\n" + out + err
    logs = "".join((folder / f).read_text() for f in ("node0.log", "node1.log")
                   if (folder / f).exists())
    return res, logs


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# Two runs of up to 240 s each on a loaded machine: longer than the suite's
# default (120 s), which killed the test before its own timeout could speak.
@pytest.mark.timeout(540)
def test_two_node_quick_start_runs_as_written_twice_in_one_folder(tmp_path: Path) -> None:
    for _ in range(2):
        res, logs = run_quick_start(tmp_path)
        out = res.stdout + res.stderr
        assert res.returncode == 0, out + logs
        assert "Traceback" not in out, out
        assert "FAIL" not in out and out.count("ok    reachable") == 2, out
        assert "tiny/slot0 " in out and "tiny/slot1 " in out, out
        assert max(len(line) for line in res.stdout.splitlines()) <= 80, res.stdout
        # The daemons took their ready files with them: a second run waits
        # for its own daemons, not for files the first one left.
        assert not list(tmp_path.glob("*.ready")), list(tmp_path.iterdir())
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != ".venv")
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *left],
                             capture_output=True, text=True).stdout.split()
    assert sorted(ignored) == left, f"the quick start leaves files git would add: {left}"


@pytest.mark.timeout(180)
def test_quick_start_with_a_port_taken_stops_at_once_with_a_sentence(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 7720))
        taken.listen()
        # Before: the wait loop waited for node1.ready forever (the test's timeout).
        res, logs = run_quick_start(tmp_path, timeout=90)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "Traceback" not in out + logs, out + logs
    assert "--listen 127.0.0.1:7720: port 7720 is already in use" in out, out
    # The daemon that did start was stopped with the one that did not: its
    # port is free again once it has shut down (SIGTERM: a moment).
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as again:
            again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                again.bind(("127.0.0.1", 7710))
                break
            except OSError:
                assert time.monotonic() < deadline, "node0 was left running"
        time.sleep(0.2)
    # Its ready file went before its listeners closed.
    assert not list(tmp_path.glob("*.ready")), list(tmp_path.iterdir())


@pytest.mark.timeout(180)
def test_quick_start_with_its_daemons_still_up_stops_and_says_so(tmp_path: Path) -> None:
    """Issue 37 item 2: run a second time while the first run's daemons still
    ran, the block saw their ready files, went on with the old daemons, and
    its own daemons' refusal stayed in node0.log (which two processes then
    wrote: NUL bytes).  Now it stops before starting anything, and says why."""
    secret = tmp_path / "secret"
    subprocess.run([str(ROOT / ".venv/bin/rpcbuf"), "token", "create", "--secret-file",
                    str(secret), "--tenant", "alice", "--create"], check=True,
                   capture_output=True, timeout=60)
    env = {**os.environ, "UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n",
           "PYTHONPATH": str(ROOT / "src")}
    with open(tmp_path / "earlier.log", "wb") as log:
        earlier = subprocess.Popen(
            [str(ROOT / ".venv/bin/rpcbufd"), "--listen", "127.0.0.1:0", "--ucx-port", "0",
             "--device", "cpu:16MiB", "--secret-file", str(secret),
             "--ready-file", "./node0.ready"], cwd=tmp_path, env=env, stdout=log,
            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "node0.ready").exists():
            assert earlier.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "earlier.log").read_text()
            time.sleep(0.1)
        res, _ = run_quick_start(tmp_path, timeout=90)
        out = res.stdout + res.stderr
        assert res.returncode != 0, out
        assert "node0.ready: a daemon of an earlier run still runs" in out, out
        assert not (tmp_path / "node0.log").exists(), "it started daemons all the same"
        assert earlier.poll() is None  # the earlier daemon is left as it was
    finally:
        earlier.terminate()
        earlier.wait(30)
