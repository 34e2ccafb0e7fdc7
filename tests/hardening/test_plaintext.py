"""A token never travels in plaintext off this host unless asked for.

``rpcbuf.connect`` (and so ``Cluster.connect`` and every CLI command) refuses
to say hello over plain TCP to an address that is not loopback: the bearer
token would cross the network readable by anyone on the path, and sent to
whoever answers there.  The refusal comes before any connection is opened
(checked by watching the event loop's ``create_connection``), so it is a
BAD_REQUEST at once, never a timeout.  ``insecure=True`` /
``$RPCBUF_INSECURE=1`` / ``--insecure`` lifts it; TLS (``tls=``,
``$RPCBUF_CA``, ``--ca``) is the fix.  Nothing here is sent off this host:
the remote addresses are refused before any dial, and where a test lets one
through (``insecure``) the ``dials`` spy records it and refuses it itself.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import rpcbuf
from rpcbuf.control.client.opening import is_loopback

ROOT = Path(__file__).resolve().parents[2]
REMOTE = ["192.0.2.1:7700", "[2001:db8::1]:7700", "rpcbuf-test.invalid:7700", "0.0.0.0:7700"]
TOKEN = "not.a.token"


@pytest.fixture
async def dials(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[list[Any]]:
    """Every TCP connection the client opens, recorded (then opened as asked)."""
    loop = asyncio.get_running_loop()
    seen: list[Any] = []
    real = loop.create_connection

    async def spy(*args: Any, **kw: Any) -> Any:
        seen.append(args[1:3])
        if not is_loopback(str(args[1])):  # recorded, never sent: tests reach loopback only
            raise ConnectionRefusedError(111, "not dialed by the test")
        return await real(*args, **kw)

    monkeypatch.setattr(loop, "create_connection", spy)
    monkeypatch.delenv("RPCBUF_INSECURE", raising=False)
    monkeypatch.delenv("RPCBUF_CA", raising=False)
    yield seen


def _refused(exc: rpcbuf.RpcBufError) -> None:
    assert exc.code == "BAD_REQUEST", exc
    assert exc.details.get("reason") == "insecure_transport", exc
    for fix in ("tls=", "$RPCBUF_CA", "insecure=True"):
        assert fix in exc.message, exc.message


@pytest.mark.parametrize("addr", REMOTE)
async def test_plaintext_to_a_remote_address_is_refused_before_connecting(
        dials: list[Any], addr: str) -> None:
    with pytest.raises(rpcbuf.BadRequest) as err:
        await rpcbuf.connect(addr, token=TOKEN, timeout=30)
    _refused(err.value)
    assert dials == []  # nothing was dialled: no byte left this host
    with pytest.raises(rpcbuf.ClusterError) as cerr:
        await rpcbuf.Cluster.connect([addr], TOKEN, timeout=30)
    _refused(cerr.value.errors[addr])
    assert dials == []


async def test_tls_that_does_not_verify_the_node_counts_as_plaintext(dials: list[Any]) -> None:
    import ssl

    lax = ssl.create_default_context()
    lax.check_hostname = False  # any certificate from the CAs, for any name
    blind = ssl.create_default_context()
    blind.check_hostname = False
    blind.verify_mode = ssl.CERT_NONE  # any certificate at all
    for ctx in (lax, blind):
        with pytest.raises(rpcbuf.BadRequest) as err:
            await rpcbuf.connect("192.0.2.1:7700", token=TOKEN, timeout=30, tls=ctx)
        _refused(err.value)
        assert "does not verify" in err.value.message
    assert dials == []


async def test_insecure_lifts_the_refusal(dials: list[Any],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Now it dials (the spy records the dial and refuses it: no packet leaves).
    with pytest.raises((rpcbuf.Timeout, rpcbuf.ConnectionLost)):
        await rpcbuf.connect("192.0.2.1:7700", token=TOKEN, timeout=0.3, insecure=True)
    assert dials == [("192.0.2.1", 7700)]
    monkeypatch.setenv("RPCBUF_INSECURE", "1")
    with pytest.raises((rpcbuf.Timeout, rpcbuf.ConnectionLost)):
        await rpcbuf.connect("192.0.2.1:7700", token=TOKEN, timeout=0.3)
    assert len(dials) == 2
    # insecure=False wins over the environment.
    with pytest.raises(rpcbuf.BadRequest) as err:
        await rpcbuf.connect("192.0.2.1:7700", token=TOKEN, timeout=0.3, insecure=False)
    _refused(err.value)
    assert len(dials) == 2


async def test_a_ca_file_that_cannot_be_loaded_is_a_clear_error(
        dials: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "no-ca.pem"
    with pytest.raises(rpcbuf.BadRequest, match=r"no-ca\.pem"):
        await rpcbuf.connect("127.0.0.1:1", token=TOKEN, timeout=5, tls=str(missing))
    monkeypatch.setenv("RPCBUF_CA", str(missing))
    with pytest.raises(rpcbuf.BadRequest, match=r"\$RPCBUF_CA.*no-ca\.pem"):
        await rpcbuf.connect("127.0.0.1:1", token=TOKEN, timeout=5)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(rpcbuf.BadRequest, match=r"garbage\.pem"):
        await rpcbuf.connect("127.0.0.1:1", token=TOKEN, timeout=5, tls=garbage)
    assert dials == []


def test_what_counts_as_loopback() -> None:


    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("192.0.2.1", "0.0.0.0", "::", "10.0.0.1", "example.com",
                 "localhost.example.com", "127.0.0.1.example.com", "::ffff:127.0.0.1", ""):
        assert not is_loopback(host), host


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RPCBUF_TOKEN": TOKEN}
    env.pop("RPCBUF_INSECURE", None)
    env.pop("RPCBUF_CA", None)
    return subprocess.run([sys.executable, "-m", "rpcbuf.cli", *args], capture_output=True,
                          text=True, env=env, timeout=60)


def test_the_cli_refuses_and_says_how_to_fix_it() -> None:
    out = _cli("devices", "--endpoint", "192.0.2.1:7700", "--timeout", "30")
    assert out.returncode == 1, out
    assert "--insecure" in out.stderr and "--ca" in out.stderr, out.stderr
    assert "[BAD_REQUEST]" in out.stderr and "Traceback" not in out.stderr, out.stderr
    # --insecure: it dials.  0.0.0.0 is no loopback literal, yet Linux
    # connects it to this host (port 1: refused), so no packet leaves.
    out = _cli("devices", "--endpoint", "0.0.0.0:1", "--timeout", "5", "--insecure")
    assert out.returncode == 1, out
    assert "BAD_REQUEST" not in out.stderr and "Traceback" not in out.stderr, out.stderr


async def test_plaintext_localhost_is_dialed_as_the_loopback_literal(dials: list[Any]) -> None:
    """``localhost`` is exempt as loopback, but resolving it asks NSS (a
    hosts file, DNS), which could point it off the host with the token
    following in plaintext: the client dials 127.0.0.1 itself."""
    with pytest.raises(rpcbuf.ConnectionLost):
        await rpcbuf.connect("localhost:1", token=TOKEN, timeout=5)
    assert dials == [("127.0.0.1", 1)]


async def test_a_registry_with_public_cas_only_is_refused(dials: list[Any]) -> None:
    """From a registry, whoever may write it names the address: with every
    public CA trusted (tls=True), a forged entry naming a host its writer has
    a public certificate for gets the token.  The cluster's own CA is needed."""
    with pytest.raises(rpcbuf.BadRequest, match="cluster's own CA"):
        await rpcbuf.Cluster.connect("etcd://127.0.0.1:1", TOKEN, tls=True, timeout=1)
    assert dials == []
