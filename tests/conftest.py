"""Fixtures that start real rpcbufd processes on loopback (UCX over tcp).

``daemon_factory`` starts a daemon with any flags and waits until it has
written its ready file (both listeners up); every daemon is stopped with
SIGTERM at the end and must exit 0.  ``ctx`` is a client of the shared daemon;
after each test that used it, the pool's free bytes must be back at their
starting value: nothing leaks.

Loopback clients take the same-host path by default.  A test marked
``both_paths`` (``@pytest.mark.both_paths``, or ``pytestmark`` for a whole
module) runs twice, once per data path: ``[same-host]`` and ``[ucx]`` (what
clients on other hosts use), through ``RPCBUF_SAME_HOST`` set for the test
(so daemons and client processes the test starts see it too).
A marked test may take ``data_path`` as an argument to know which.
``--data-path same-host|ucx`` runs the marked tests on one path only.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import rpcbuf
from rpcbuf.control.formats.keyfile import load_or_create_secret
from rpcbuf.control.wire.auth import create_token

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class DaemonProc:
    proc: subprocess.Popen[bytes]
    addr: str
    ucx_port: int
    secret_file: Path
    log_file: Path
    tmp: Path
    tokens: dict[str, str] = field(default_factory=dict)

    def token(self, tenant: str = "alice", ttl: float | None = None) -> str:
        if ttl is not None:
            return create_token(load_or_create_secret(self.secret_file), tenant, ttl)
        if tenant not in self.tokens:
            self.tokens[tenant] = create_token(load_or_create_secret(self.secret_file), tenant)
        return self.tokens[tenant]

    def connect(self, tenant: str = "alice", **kw: object) -> rpcbuf.Connector:
        return rpcbuf.connect(self.addr, token=self.token(tenant), timeout=30,
                              **kw)  # type: ignore[arg-type]

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def fds(self) -> int:
        """How many fds the daemon holds open now."""
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                # PYTHONFAULTHANDLER (start_daemon) writes every thread's stack
                # to the log on SIGABRT: where it hung, for whoever reads this.
                self.proc.send_signal(signal.SIGABRT)
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                raise AssertionError(f"daemon did not stop within {timeout}s; its log ends:\n"
                                     + self.log()[-6000:]) from None
        return self.proc.returncode


# The daemon with the garbage collector off from its first line (``gc.freeze``
# and ``set_threshold`` in main leave it off): what proves that nothing the
# daemon releases waits for a collection (STYLE.md, "nothing rests on the
# garbage collector").
GC_DISABLED = ("-c", "import gc, sys; gc.disable(); "
                     "from rpcbuf.control.daemon.service.main import main; "
                     "sys.exit(main(sys.argv[1:]))")


def start_daemon(tmp: Path, *flags: str, wait: float = 30,
                 env: dict[str, str] | None = None, gc_disabled: bool = False,
                 launch: tuple[str, ...] | None = None) -> DaemonProc:
    """A real rpcbufd (``launch``: what follows the interpreter, instead of
    ``-m rpcbuf.control.daemon``; it must run the daemon's ``main``)."""
    tmp.mkdir(parents=True, exist_ok=True)
    secret, ready, logf = tmp / "secret", tmp / "ready", tmp / "daemon.log"
    load_or_create_secret(secret)
    launch = launch or (GC_DISABLED if gc_disabled else ("-m", "rpcbuf.control.daemon"))
    args = [sys.executable, *launch, "--listen", "127.0.0.1:0", "--ucx-port", "0",
            "--secret-file", str(secret), "--ready-file", str(ready), *flags]
    if not any(f == "--device" for f in flags):
        args += ["--device", "cpu:512MiB"]
    with open(logf, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})})
    deadline = time.monotonic() + wait
    while not (ready.exists() and ready.read_text().endswith("\n")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"rpcbufd did not start:\n{logf.read_text()}")
        time.sleep(0.05)
    addr, ucx_port = ready.read_text().split()
    return DaemonProc(proc, addr, int(ucx_port), secret, logf, tmp)


DATA_PATHS = {"same-host": None, "ucx": "0"}  # RPCBUF_SAME_HOST for each (None: unset, auto)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--data-path", choices=["both", *DATA_PATHS], default="both",
                     help="the data paths a test marked both_paths runs on (default: both)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "both_paths: run the test on the same-host and the UCX "
                                       "data path (--data-path picks one)")
    config.addinivalue_line("markers", "ucx_path: tests of the UCX library itself (which one "
                                       "loads, its memory events): .ci/run runs them again, with "
                                       "the both_paths tests, on a system UCX")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("both_paths") is None:
        return
    chosen = metafunc.config.getoption("--data-path")
    # A parameter, not a fixture: the path is set by the hooks below, before any
    # fixture of the test connects, and a function-scoped fixture would trip
    # hypothesis's health check in marked tests that use @given.
    metafunc.fixturenames.append("data_path")
    metafunc.parametrize("data_path", list(DATA_PATHS) if chosen == "both" else [chosen])


_SAVED_PATH: dict[str, str | None] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """``RPCBUF_SAME_HOST`` for a ``both_paths`` test, from setup to teardown."""
    callspec = getattr(item, "callspec", None)
    path = None if callspec is None else callspec.params.get("data_path")
    if path is None:
        return
    _SAVED_PATH[item.nodeid] = os.environ.get("RPCBUF_SAME_HOST")
    _set_same_host(DATA_PATHS[path])


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if item.nodeid in _SAVED_PATH:
        _set_same_host(_SAVED_PATH.pop(item.nodeid))


def _set_same_host(value: str | None) -> None:
    if value is None:
        os.environ.pop("RPCBUF_SAME_HOST", None)
    else:
        os.environ["RPCBUF_SAME_HOST"] = value


@pytest.fixture(scope="session")
def daemon_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    started: list[DaemonProc] = []

    def factory(*flags: str, env: dict[str, str] | None = None,
                gc_disabled: bool = False) -> DaemonProc:
        d = start_daemon(tmp_path_factory.mktemp("rpcbufd"), *flags, env=env,
                         gc_disabled=gc_disabled)
        started.append(d)
        return d

    yield factory
    for d in started:
        if d.proc.poll() is None:
            assert d.stop() == 0, d.log()


@pytest.fixture(scope="session")
def daemon(daemon_factory) -> DaemonProc:  # type: ignore[no-untyped-def]
    return daemon_factory("--device", "cpu:768MiB", "--transfer-timeout", "60s")  # type: ignore[no-any-return]


def metrics_url(d: DaemonProc) -> str:
    """The ``--metrics`` address a daemon logged at start."""
    found = re.search(r"metrics at (http://[\d.]+:\d+/metrics)", d.log())
    assert found, d.log()
    return found.group(1)


def pool_gauge(url: str, name: str) -> int:
    """``rpcbuf_pool_NAME`` (or ``..._total``) of device cpu:0, read from ``url``."""
    with urllib.request.urlopen(url, timeout=10) as res:
        text = res.read().decode()
    found = re.search(rf'^rpcbuf_pool_{name}(?:_total)?\{{device="cpu:0"\}} (\S+)$', text, re.M)
    assert found, text
    return int(float(found.group(1)))


async def pool_free(d: DaemonProc) -> int:
    async with d.connect("probe") as c:
        return sum(int(dev["free"]) for dev in await c.list_devices())


async def wait_free(d: DaemonProc, expected: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        free = await pool_free(d)
        if free == expected or time.monotonic() > deadline:
            return free
        await asyncio.sleep(0.05)


@pytest.fixture
async def clean_pool(daemon: DaemonProc) -> AsyncIterator[DaemonProc]:
    """The shared daemon; asserts after the test that no memory leaked."""
    start = await pool_free(daemon)
    yield daemon
    assert await wait_free(daemon, start) == start, "pool memory leaked"


@pytest.fixture
async def ctx(clean_pool: DaemonProc) -> AsyncIterator[rpcbuf.RpcContext]:
    async with clean_pool.connect("alice") as c:
        yield c


@pytest.fixture(autouse=True, scope="session")
def _hash_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``load_model``'s client-side hash cache goes to a temporary directory,
    never the user's ``~/.cache/rpcbuf``."""
    old = os.environ.get("RPCBUF_CACHE_DIR")
    os.environ["RPCBUF_CACHE_DIR"] = str(tmp_path_factory.mktemp("hashcache"))
    yield
    if old is None:
        os.environ.pop("RPCBUF_CACHE_DIR", None)
    else:
        os.environ["RPCBUF_CACHE_DIR"] = old


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """tests/fakecupy as ``cupy`` in this process for one test (a real CuPy
    is put back after)."""
    for name in [n for n in sys.modules if n == "cupy" or n.startswith("cupy.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent / "fakecupy"))
    import cupy

    assert "fakecupy" in cupy.__file__
    yield cupy
    for name in [n for n in sys.modules if n == "cupy" or n.startswith("cupy.")]:
        del sys.modules[name]
