"""Child processes of a benchmark: spawned, waited for, stopped, always bounded.

Every child runs in its own session (a terminal's Ctrl-C reaches only the
benchmark, which stops its children in order) and gets a signal from the
kernel should the benchmark die first, even by SIGKILL
(``PR_SET_PDEATHSIG``).  Children announce readiness by writing one line to
a *ready file* (atomically: ``write_ready``); ``wait_ready`` polls for it and
fails fast, with the log's tail, if the child exits first.  ``stop`` is
SIGCONT (it may be paused), SIGTERM, a bounded wait, then SIGKILL.

``Daemon`` is a real ``rpcbufd`` on free loopback ports (control and UCX),
with a fresh node secret and a token for one tenant, started the way tests
and people start it (``python -m rpcbuf.control.daemon ... --ready-file``); it can
be stopped and started again on the same directory (the dedup benchmark's
restart keeps its disk cache).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from benchkit import SRC

PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
# Every child spawn() started and stop() has not reaped: stop_all() ends them.
CHILDREN: list[subprocess.Popen[bytes]] = []


def _die_with_parent(sig: int) -> None:
    """In each child before exec: ``sig`` from the kernel when the parent dies."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, sig)


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: ours) with this checkout's ``src/`` first on PYTHONPATH."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), out.get("PYTHONPATH", "")) if p)
    return out


def spawn(cmd: Sequence[str], log: Path, env: dict[str, str] | None = None,
          death_signal: int = signal.SIGTERM, **kw: Any) -> subprocess.Popen[bytes]:
    """Start ``cmd`` with stdout and stderr to ``log``, in its own session,
    ``death_signal`` when we die; ``kw`` goes to ``Popen`` (stdin defaults to
    /dev/null)."""
    kw.setdefault("stdin", subprocess.DEVNULL)
    with open(log, "ab") as f:
        proc = subprocess.Popen(list(cmd), env=child_env(env), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=functools.partial(_die_with_parent, death_signal),
                                **kw)
    CHILDREN.append(proc)
    return proc


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 15.0) -> int | None:
    """SIGCONT, SIGTERM, wait up to ``timeout``, then SIGKILL (waited up to
    5 s). Returns the exit status (None: not started, or unkillable)."""
    if proc is None:
        return None
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    if proc in CHILDREN:
        CHILDREN.remove(proc)
    return proc.returncode


def stop_all(timeout: float = 3.0) -> None:
    """``stop`` every child still running (cleanup after an interruption)."""
    for proc in list(CHILDREN):
        stop(proc, timeout)


def tail(path: Path, n: int = 20, skip: Callable[[str], bool] | None = None) -> str:
    """The last ``n`` lines of ``path`` (without those ``skip`` says), '' if unreadable."""
    with contextlib.suppress(OSError):
        lines = path.read_text(errors="replace").splitlines()
        if skip is not None:
            lines = [ln for ln in lines if not skip(ln)]
        return "\n".join(lines[-n:])
    return ""


def write_ready(path: str | Path, text: str) -> None:
    """Write a ready file atomically, so the waiter never sees half a line."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def wait_ready(path: Path, proc: subprocess.Popen[bytes], log: Path, what: str,
               timeout: float = 60.0, skip: Callable[[str], bool] | None = None) -> str:
    """Poll for a ready file's line; fail fast (with the log's tail, less the
    lines ``skip`` says) if the process dies, or after ``timeout``. Returns
    the line, stripped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            text = path.read_text()
            if text.endswith("\n"):
                return text.strip()
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n"
                               f"{tail(log, skip=skip)}")
        time.sleep(0.02)
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s:\n{tail(log, skip=skip)}")


class Daemon:
    """A real ``rpcbufd`` under ``tmp``: ``--listen 127.0.0.1:0 --ucx-port 0``,
    a node secret in ``tmp/secret``, its log in ``tmp/daemon.log``.

    ``flags`` are the rest of its command line (``--device`` defaults to
    ``cpu:1GiB``); ``token`` is a token for ``tenant``; ``addr`` and
    ``ucx_port`` are what the ready file said.  Use as a context manager, or
    ``start()``/``stop()`` (again and again, on the same directory)."""

    def __init__(self, tmp: Path, *flags: str, tenant: str = "bench",
                 log_level: str = "WARNING", ready_timeout: float = 60.0,
                 stop_timeout: float = 15.0, env: dict[str, str] | None = None) -> None:
        from rpcbuf.control.formats.keyfile import load_or_create_secret
        from rpcbuf.control.wire.auth import create_token

        self.tmp, self.flags, self.env = tmp, list(flags), env
        if "--device" not in self.flags:
            self.flags += ["--device", "cpu:1GiB"]
        self.log_level, self.ready_timeout, self.stop_timeout = (
            log_level, ready_timeout, stop_timeout)
        self.secret = tmp / "secret"
        self.token = create_token(load_or_create_secret(self.secret), tenant)
        self.log = tmp / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.addr, self.ucx_port = "", 0

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the daemon is not started"
        return self.proc.pid

    def command(self, ready: Path) -> list[str]:
        return [sys.executable, "-m", "rpcbuf.control.daemon", "--listen", "127.0.0.1:0",
                "--ucx-port", "0", "--secret-file", str(self.secret),
                "--ready-file", str(ready), "--log-level", self.log_level, *self.flags]

    def start(self) -> Daemon:
        """Start it and wait for its ready file; raises RuntimeError (with the
        log's tail) if it exits or is not ready in ``ready_timeout``."""
        ready = self.tmp / "daemon.ready"
        ready.unlink(missing_ok=True)
        self.proc = spawn(self.command(ready), self.log, self.env)
        try:
            addr, ucx_port = wait_ready(ready, self.proc, self.log, "rpcbufd",
                                        self.ready_timeout).split()
        except BaseException:
            stop(self.proc, self.stop_timeout)
            raise
        self.addr, self.ucx_port = addr, int(ucx_port)
        return self

    def stop(self) -> int | None:
        """SIGTERM (the daemon finishes its work), bounded; the exit status."""
        return stop(self.proc, self.stop_timeout)

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
