"""Tokens and the node secret."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from control.auth import create_token, load_or_create_secret, verify_token
from control.errors import AuthFailed, TokenExpired

SECRET = b"s" * 64


def test_round_trip_and_expiry() -> None:
    tok = create_token(SECRET, "alice", ttl=60)
    assert verify_token(SECRET, tok) == "alice"
    with pytest.raises(TokenExpired):
        verify_token(SECRET, tok, now=time.time() + 61)
    assert verify_token(SECRET, create_token(SECRET, "bob")) == "bob"  # no ttl: no expiry


@pytest.mark.parametrize("mangle", [
    lambda t: t[:-2] + ("AA" if not t.endswith("AA") else "BB"),
    lambda t: t.replace("rpcbuf1", "rpcbuf2"),
    lambda t: "garbage",
    lambda t: "",
    lambda t: "a.b.c",
    lambda t: t.split(".")[0] + "." + create_token(SECRET, "root").split(".")[1] + "."
    + t.split(".")[2],
])
def test_tampered_tokens_fail(mangle) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(AuthFailed):
        verify_token(SECRET, mangle(create_token(SECRET, "alice")))


def test_other_nodes_secret_fails() -> None:
    with pytest.raises(AuthFailed):
        verify_token(b"x" * 64, create_token(SECRET, "alice"))


def test_bad_tenant_names() -> None:
    for bad in ["", "a b", "x" * 200, "../etc"]:
        with pytest.raises(ValueError):
            create_token(SECRET, bad)


def test_secret_file_created_private(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "secret"
    s = load_or_create_secret(path)
    assert len(s) >= 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_secret(path) == s
    short = tmp_path / "short"
    short.write_text("tooshort")
    with pytest.raises(ValueError, match="fewer"):
        load_or_create_secret(short)
    with pytest.raises(FileNotFoundError):
        load_or_create_secret(tmp_path / "missing", create=False)
