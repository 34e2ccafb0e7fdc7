"""Three "hosts" on one machine: network namespaces, each joined to the root
namespace by a veth pair.

``netns_hosts`` (a pytest fixture, module scope) makes three namespaces; host
i gets a /30 of 10.77.0.0/24 on its veth pair (root end 10.77.0.(4i+1),
its own address 10.77.0.(4i+2)) and one rpcbufd (``ip netns exec NS python
-m rpcbuf.control.daemon``) with ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES`` set to its
veth.  Clients run in the root namespace, as subprocesses whose UCX uses the
three root ends (``NetnsCluster.client_env``): the test process's own UCX
context was made for loopback and cannot change.  (A bridge would read
better, but UCX's tcp transport does not list bridge devices.)  Traffic
stays inside these namespaces and this machine.

It skips, saying why, without root, without ``ip``, when ``ip netns add``
fails (a container without the capability) or when 10.77.0.0/24 is already
in use here.  Teardown always stops the daemons and deletes the namespaces,
veths, and setup first removes what a crashed earlier run left.
Every wait is bounded in time.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import ROOT
from rpcbuf.control.formats.keyfile import load_or_create_secret
from rpcbuf.control.wire.auth import create_token

SUBNET = "10.77.0"
PREFIX = "rpcbuf-"  # namespace names: rpcbuf-<pid>-<i>
PORT = 7700


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=15, check=check)


def unavailable() -> str | None:
    """Why multi-host tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root for ip netns (run as root)"
    if shutil.which("ip") is None:
        return "needs the ip command (apt-get install iproute2)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                         timeout=15)
    if res.returncode != 0:
        return f"'ip netns add' does not work here: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=15)
    used = ip("-o", "-4", "addr", "show").stdout + ip("-4", "route", "show").stdout
    if re.search(rf"(^|\s){re.escape(SUBNET)}\.", used):
        return f"{SUBNET}.0/24 is already in use on this machine"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> None:
    """Namespaces of earlier runs whose process is gone (their veths go with them)."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        m = re.match(rf"{PREFIX}(\d+)-\S+", line.split()[0] if line.split() else "")
        if m and not _alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", m.group(0)], capture_output=True, timeout=15)


@dataclass
class Host:
    index: int
    ns: str
    ip: str
    veth_root: str
    veth_ns: str
    tmp: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def addr(self) -> str:
        return f"{self.ip}:{PORT}"

    def spawn(self, secret: Path, extra: Sequence[str] = ()) -> None:
        """Start this host's rpcbufd in its namespace (``extra``: more flags);
        ``wait_ready`` waits for it."""
        ready, logf = self.tmp / "ready", self.tmp / f"daemon-{int(time.time() * 1e3)}.log"
        ready.unlink(missing_ok=True)
        env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": self.veth_ns,
               "UCX_WARN_UNUSED_ENV_VARS": "n"}
        cmd = ["ip", "netns", "exec", self.ns, sys.executable, "-m", "rpcbuf.control.daemon",
               # The UCX port is learnt in hello; a fixed one would stay in TIME_WAIT
               # after a killed daemon, so a restarted one takes any free port.
               "--listen", self.addr, "--ucx-port", "0", "--device", "cpu:64MiB",
               "--secret-file", str(secret), "--ready-file", str(ready),
               "--node-id", f"host{self.index}", "--transfer-timeout", "10s",
               "--drain-timeout", "5s", "--log-level", "WARNING", *extra]
        with open(logf, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env=env)
        self.log_file = logf

    def wait_ready(self, wait: float = 30.0) -> None:
        ready = self.tmp / "ready"
        deadline = time.monotonic() + wait
        while not (ready.exists() and ready.read_text().endswith("\n")):
            assert self.proc is not None
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"rpcbufd in {self.ns} did not start:\n"
                                   f"{self.log_file.read_text()}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return -9
        return self.proc.returncode


@dataclass
class NetnsCluster:
    hosts: list[Host]
    secret: Path
    tenant: str = "netns"
    _token: str = field(default="", repr=False)

    @property
    def endpoints(self) -> str:
        return ";".join(h.addr for h in self.hosts)

    @property
    def token(self) -> str:
        if not self._token:
            self._token = create_token(load_or_create_secret(self.secret), self.tenant,
                                       clusters=["default", "netns"])  # test_netns_fleet
        return self._token

    def client_env(self) -> dict[str, str]:
        """For client subprocesses in the root namespace: UCX over the veths,
        and plain TCP to the namespaces' addresses (a private veth, not a
        network anyone else is on: ``RPCBUF_INSECURE``)."""
        return {**os.environ, "UCX_TLS": "tcp", "RPCBUF_INSECURE": "1",
                "UCX_NET_DEVICES": ",".join(h.veth_root for h in self.hosts),
                "UCX_WARN_UNUSED_ENV_VARS": "n", "COLUMNS": "200"}


def plan(tmp: Path) -> NetnsCluster:
    """Host i: a /30 inside 10.77.0.0/24, root end .4i+1, namespace end .4i+2."""
    pid = os.getpid()
    hosts = [Host(i, f"{PREFIX}{pid}-{i}", f"{SUBNET}.{4 * i + 2}", f"rbh{pid}{i}"[-15:],
                  f"rbn{pid}{i}"[-15:], tmp / f"host{i}") for i in (1, 2, 3)]
    return NetnsCluster(hosts, tmp / "secret")


def setup(cluster: NetnsCluster) -> None:
    load_or_create_secret(cluster.secret)
    for h in cluster.hosts:
        h.tmp.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ip", "netns", "add", h.ns], check=True, capture_output=True, timeout=15)
        ip("link", "add", h.veth_root, "type", "veth", "peer", "name", h.veth_ns)
        ip("link", "set", h.veth_ns, "netns", h.ns)
        ip("addr", "add", f"{SUBNET}.{4 * h.index + 1}/30", "dev", h.veth_root)
        ip("link", "set", h.veth_root, "up")
        ip("addr", "add", f"{h.ip}/30", "dev", h.veth_ns, ns=h.ns)
        ip("link", "set", h.veth_ns, "up", ns=h.ns)
        ip("link", "set", "lo", "up", ns=h.ns)


def teardown(cluster: NetnsCluster) -> None:
    for h in cluster.hosts:
        with contextlib.suppress(Exception):
            h.stop()
    for h in cluster.hosts:
        subprocess.run(["ip", "netns", "del", h.ns], capture_output=True, timeout=15)
        ip("link", "del", h.veth_root, check=False)  # gone with the namespace, normally


@pytest.fixture(scope="module")
def netns_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    remove_leftovers()
    cluster = plan(tmp_path_factory.mktemp("netns"))
    try:
        setup(cluster)
        for h in cluster.hosts:
            h.spawn(cluster.secret)
        for h in cluster.hosts:
            h.wait_ready()
        yield cluster
    finally:
        teardown(cluster)
