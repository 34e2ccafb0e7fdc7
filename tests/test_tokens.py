"""Tokens against a real daemon: a session ends with its token, keys rotate
on SIGHUP (a removed key takes its sessions with it), and what
``rpcbuf token create`` mints."""

from __future__ import annotations

import asyncio
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import jwt
import pytest

import rpcbuf
import rpcbuf.control.wire.auth as auth
from conftest import ROOT, DaemonProc, pool_free, wait_free
from rpcbuf.control.formats import keyfile


@pytest.mark.parametrize("same_host", [None, False], ids=["default-path", "ucx-path"])
async def test_a_session_ends_with_its_token(clean_pool: DaemonProc,
                                             same_host: bool | None) -> None:
    d = clean_pool
    free = await pool_free(d)
    ends = time.time() + 3
    token = d.token("alice", ttl=3)  # expires within 3 s
    async with rpcbuf.connect(d.addr, token=token, timeout=30, same_host=same_host) as c:
        assert 0 < c.hello["token_expires_at"] - time.time() <= 3
        buf = await c.request_buffer(4096)  # session-scoped: goes when the session does
        assert await c.ping() > 0
        await asyncio.sleep(ends - time.time() + 0.5)
        with pytest.raises(rpcbuf.TokenExpired):
            await c.ping()
        with pytest.raises(rpcbuf.TokenExpired):
            await c.get_buffer_meta(buf)
    assert await wait_free(d, free) == free  # the daemon closed the session: buffer released


async def test_requests_after_expiry_are_refused_each(clean_pool: DaemonProc) -> None:
    """A burst sent at the deadline: every request is either served before
    it or refused with TOKEN_EXPIRED, none served after."""
    d = clean_pool
    ends = time.time() + 2
    async with rpcbuf.connect(d.addr, token=d.token("alice", ttl=2), timeout=30) as c:
        await asyncio.sleep(max(0.0, ends - time.time() - 0.05))
        got = await asyncio.gather(*(c.ping() for _ in range(50)), return_exceptions=True)
        assert all(isinstance(r, (float, rpcbuf.TokenExpired)) for r in got), got
        await asyncio.sleep(max(0.0, ends - time.time() + 0.2))
        with pytest.raises(rpcbuf.TokenExpired):
            await c.list_devices()


def _sighup(d: DaemonProc, seen: int, timeout: float = 10.0) -> int:
    """SIGHUP the daemon and wait until its log says it re-read the keys."""
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while (n := d.log().count("SIGHUP: re-read")) <= seen:
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    return n


async def test_sighup_rotates_keys(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProc = daemon_factory("--device", "cpu:4MiB")
    old_keys = keyfile.load_keys(d.secret_file)  # the one key the daemon made: "default"
    assert old_keys.kids == ["default"]
    async with rpcbuf.connect(d.addr, token=auth.create_token(old_keys, "alice", 3600),
                              timeout=30) as on_old:
        k2 = secrets.token_hex(32)
        d.secret_file.write_text(d.secret_file.read_text() + f"k2 {k2}\n")
        both = keyfile.load_keys(d.secret_file)
        new_token = auth.create_token(both, "alice", 3600)  # the newest key signs
        assert jwt.get_unverified_header(new_token)["kid"] == "k2"
        with pytest.raises(rpcbuf.AuthFailed, match="unknown or revoked"):  # not read yet
            await rpcbuf.connect(d.addr, token=new_token, timeout=30)
        seen = _sighup(d, 0)
        async with rpcbuf.connect(d.addr, token=new_token, timeout=30) as on_new:
            assert await on_old.ping() > 0 and await on_new.ping() > 0  # both keys good
            d.secret_file.write_text(f"k2 {k2}\n")  # revoke "default"
            seen = _sighup(d, seen)
            with pytest.raises(rpcbuf.AuthFailed, match="revoked"):  # its session ended
                await on_old.ping()
            with pytest.raises(rpcbuf.AuthFailed, match="unknown or revoked"):
                await rpcbuf.connect(d.addr, token=auth.create_token(old_keys, "alice", 3600),
                                     timeout=30)
            assert await on_new.ping() > 0  # the other key's session is untouched
            d.secret_file.write_text("not a key file\n")  # broken: the running keys stay
            d.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while "SIGHUP: keeping the running keys" not in d.log():
                assert time.monotonic() < deadline, d.log()
                await asyncio.sleep(0.05)
            assert await on_new.ping() > 0
            assert sum(int(dev["free"]) for dev in await on_new.list_devices()) == 4 << 20


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rpcbuf.cli", *argv], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)


def test_token_create_defaults_and_kid(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    res = _cli("token", "create", "--secret-file", str(secret), "--tenant", "alice", "--create")
    assert res.returncode == 0, res.stderr
    keys = keyfile.load_keys(secret)
    claims = jwt.decode(res.stdout.strip(), keys.keys["default"], algorithms=["HS256"],
                        audience="default")
    assert claims["sub"] == "alice" and claims["aud"] == ["default"]  # cluster "default"
    assert abs(claims["exp"] - (time.time() + 24 * 3600)) < 60  # 24h unless said otherwise
    assert auth.verify(keys, res.stdout.strip()).expires_at == claims["exp"]

    res = _cli("token", "create", "--secret-file", str(secret), "--tenant", "bob",
               "--ttl", "never")
    assert res.returncode == 0, res.stderr
    grant = auth.verify(keys, res.stdout.strip())
    assert grant.tenant == "bob" and grant.expires_at is None

    secret.write_text(secret.read_text() + f"2027-01 {secrets.token_hex(32)}\n")
    newest = _cli("token", "create", "--secret-file", str(secret), "--tenant", "carol")
    named = _cli("token", "create", "--secret-file", str(secret), "--tenant", "carol",
                 "--kid", "default", "--ttl", "1h")
    assert jwt.get_unverified_header(newest.stdout.strip())["kid"] == "2027-01"
    assert jwt.get_unverified_header(named.stdout.strip())["kid"] == "default"
    for bad, says in [(["--kid", "nope"], "no key 'nope'"), (["--ttl", "0"], "positive"),
                      (["--ttl", "soon"], "never")]:
        res = _cli("token", "create", "--secret-file", str(secret), "--tenant", "carol", *bad)
        assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr

    fresh = tmp_path / "fresh"  # a new file made for a named key
    res = _cli("token", "create", "--secret-file", str(fresh), "--tenant", "dave",
               "--kid", "2026-12", "--create")
    assert res.returncode == 0, res.stderr
    assert keyfile.load_keys(fresh).kids == ["2026-12"]
    assert jwt.get_unverified_header(res.stdout.strip())["kid"] == "2026-12"


async def test_a_secret_file_that_is_not_utf8_keeps_the_running_keys(
        daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Issue 24, item 17: one Latin-1 byte in a comment made the whole file
    one key ``default`` on SIGHUP, ending every session.  Now it is a
    malformed file like any other: refused at start, the running keys kept
    on SIGHUP."""
    d: DaemonProc = daemon_factory("--device", "cpu:4MiB")
    text = d.secret_file.read_text()
    async with rpcbuf.connect(d.addr, token=d.token("alice", 3600), timeout=30) as c:
        d.secret_file.write_bytes(b"# caf\xe9\n" + text.encode())
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "SIGHUP: keeping the running keys" not in (log := d.log()):
            assert "SIGHUP: re-read" not in log, log  # the bug: it took the file as one key
            assert time.monotonic() < deadline, log
            await asyncio.sleep(0.05)
        assert f"{d.secret_file}:1: " in log and "not UTF-8" in log
        assert await c.ping() > 0  # the session and its key survived
    proc = subprocess.Popen([sys.executable, "-m", "rpcbuf.control.daemon", "--listen",
                             "127.0.0.1:0",
                             "--ucx-port", "0", "--device", "cpu:4MiB",
                             "--secret-file", str(d.secret_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 2 and "not UTF-8" in err and "Traceback" not in err, err


def test_token_create_makes_a_secret_only_when_asked(tmp_path: Path) -> None:
    """A mistyped --secret-file is an error, not a new key (and directory)
    whose tokens every node refuses."""
    typo = tmp_path / "typo" / "dir" / "secret"
    res = _cli("token", "create", "--secret-file", str(typo), "--tenant", "alice")
    assert res.returncode == 2 and res.stdout == "", res.stdout
    assert f"--secret-file {typo}: no such file" in res.stderr and "--create" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "typo").exists()
    # --create makes the file, but not a directory that is not there.
    res = _cli("token", "create", "--secret-file", str(typo), "--tenant", "alice", "--create")
    assert res.returncode == 2 and "no such directory" in res.stderr, res.stderr
    assert not (tmp_path / "typo").exists()
    made = tmp_path / "secret"
    res = _cli("token", "create", "--secret-file", str(made), "--tenant", "alice", "--create")
    assert res.returncode == 0 and (made.stat().st_mode & 0o777) == 0o600, res.stderr
    again = _cli("token", "create", "--secret-file", str(made), "--tenant", "bob", "--create")
    assert again.returncode == 0 and auth.verify(keyfile.load_keys(made),
                                                 again.stdout.strip()).tenant == "bob"
    assert keyfile.load_keys(made).kids == ["default"]  # --create on a file there keeps its key


def test_token_create_names_clusters_and_nodes(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    base = ["token", "create", "--secret-file", str(secret), "--tenant", "alice", "--create"]
    res = _cli(*base, "--cluster", "prod,staging")
    assert res.returncode == 0, res.stderr
    claims = jwt.decode(res.stdout.strip(), options={"verify_signature": False})
    assert claims["aud"] == ["prod", "staging"]
    res = _cli(*base, "--cluster", "prod", "--node", "n1,n2")
    assert res.returncode == 0, res.stderr
    claims = jwt.decode(res.stdout.strip(), options={"verify_signature": False})
    assert claims["aud"] == ["prod/n1", "prod/n2"]
    for bad in (["--cluster", "a/b"], ["--cluster", ""], ["--node", "n 1"]):
        res = _cli(*base, *bad)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert "letters, digits" in res.stderr or "at least one" in res.stderr, res.stderr


async def test_a_token_for_another_cluster_or_node_is_refused(
        daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 24, item 2 (the token half): a token a fake node stole for one
    cluster or node is refused on every other, AUTH_FAILED naming where it was."""
    d: DaemonProc = daemon_factory("--device", "cpu:4MiB", "--cluster", "prod",
                                   "--node-id", "n1")
    keys = keyfile.load_keys(d.secret_file)
    for good in (["prod"], ["staging", "prod"]):
        async with rpcbuf.connect(d.addr, token=auth.create_token(keys, "alice", 60,
                                                                  clusters=good),
                                  timeout=30) as c:
            assert await c.ping() > 0
    async with rpcbuf.connect(d.addr, token=auth.create_token(keys, "alice", 60,
                                                              clusters=["prod"], nodes=["n1"]),
                              timeout=30) as c:
        assert await c.ping() > 0
    for clusters, nodes in ((["default"], []), (["staging"], []), (["prod"], ["n2"]),
                            (["staging"], ["n1"])):
        token = auth.create_token(keys, "alice", 60, clusters=clusters, nodes=nodes)
        with pytest.raises(rpcbuf.AuthFailed,
                           match=r"not for this node \(cluster 'prod', node 'n1'\)"):
            await rpcbuf.connect(d.addr, token=token, timeout=30)
