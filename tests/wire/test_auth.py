"""Tokens and the node secret."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import stat
import time
from pathlib import Path

import jwt
import msgpack
import pytest

from rpcbuf.control.formats.keyfile import load_keys, load_or_create_secret, parse_keys
from rpcbuf.control.wire.auth import (
    Keyring,
    create_token,
    verify,
    verify_token,
)
from rpcbuf.control.wire.errors import AuthFailed, TokenExpired

SECRET = b"s" * 64


def test_round_trip_and_expiry() -> None:
    tok = create_token(SECRET, "alice", ttl=60)
    assert verify_token(SECRET, tok) == "alice"
    with pytest.raises(TokenExpired):
        verify_token(SECRET, tok, now=time.time() + 61)
    assert verify_token(SECRET, create_token(SECRET, "bob")) == "bob"  # no ttl: no expiry


def _flip(t: str, i: int) -> str:  # one base64 character of the signature, not a padding bit
    return t[:i] + ("A" if t[i] != "A" else "B") + t[i + 1:]


@pytest.mark.parametrize("mangle", [
    lambda t: _flip(t, -10),
    lambda t: "rpcbuf1." + t,
    lambda t: t.replace(".", "..", 1),
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


# -- JWTs and keys --------------------------------------------

KEY2 = b"k" * 64
RING = Keyring({"default": SECRET, "k2": KEY2})


def test_tokens_are_standard_jwts() -> None:
    tok = create_token(RING, "alice", ttl=60)  # the newest key signs
    assert jwt.get_unverified_header(tok) == {"alg": "HS256", "typ": "JWT", "kid": "k2"}
    claims = jwt.decode(tok, KEY2, algorithms=["HS256"], audience="default")  # any library
    assert claims["sub"] == "alice" and claims["exp"] - time.time() <= 60
    assert claims["aud"] == ["default"]
    grant = verify(RING, tok)
    assert (grant.tenant, grant.kid, grant.expires_at) == ("alice", "k2", claims["exp"])
    assert "k2" in repr(grant) and repr(KEY2)[2:10] not in repr(grant) + repr(RING)
    named = create_token(RING, "alice", kid="default")
    assert jwt.get_unverified_header(named)["kid"] == "default"
    assert verify(RING, named).expires_at is None  # ttl=None: never, and says so
    assert jwt.decode(named, SECRET, algorithms=["HS256"],
                      audience="default")["never_expires"] is True
    with pytest.raises(ValueError, match="no key 'k3'"):
        create_token(RING, "alice", kid="k3")


def _mint(claims: dict[str, object], key: bytes = SECRET, alg: str = "HS256",
          kid: str | None = "default") -> str:
    """A token as an operator's own tool mints it (for cluster ``default``
    unless ``claims`` say another ``aud``)."""
    return jwt.encode({"aud": "default", **claims}, key, algorithm=alg,
                      headers=None if kid is None else {"kid": kid})


def test_jwts_minted_elsewhere() -> None:
    """Operators mint with their own tools: what such tokens must say."""
    exp = int(time.time()) + 60
    assert verify(RING, _mint({"sub": "alice", "exp": exp})).tenant == "alice"
    assert verify(RING, _mint({"sub": "alice", "exp": exp}, kid=None)).kid == "default"
    with pytest.raises(AuthFailed, match="no expiry"):  # no exp and no never_expires
        verify(RING, _mint({"sub": "alice"}))
    with pytest.raises(AuthFailed, match="no expiry"):
        verify(RING, _mint({"sub": "alice", "never_expires": 1}))
    with pytest.raises(AuthFailed, match="sub"):
        verify(RING, _mint({"exp": exp}))
    for bad in ["../etc", "", 7, "a b"]:
        with pytest.raises(AuthFailed):
            verify(RING, _mint({"sub": bad, "exp": exp}))
    with pytest.raises(AuthFailed, match="not a number"):
        verify(RING, _mint({"sub": "alice", "exp": exp, "never_expires": True} | {"exp": "x"}))
    with pytest.raises(TokenExpired):
        verify(RING, _mint({"sub": "alice", "exp": int(time.time()) - 1}))
    for claim in ["exp", "nbf", "iat"]:  # hostile JSON numbers: a clear refusal, no crash
        for odd in ["Infinity", "NaN", "1e400", str(10**400), "-1e300"]:
            # the last exp wins
            body = f'{{"sub": "alice", "aud": "default", "exp": {exp}, "{claim}": {odd}}}'
            try:
                verify(RING, _raw_jwt({"alg": "HS256"}, body))
            except AuthFailed:
                continue
            assert claim != "exp", odd  # an odd nbf in the past or iat (unchecked) is harmless
    with pytest.raises(AuthFailed, match="not for this node"):  # another cluster's
        verify(RING, _mint({"sub": "alice", "exp": exp, "aud": "elsewhere"}))
    with pytest.raises(AuthFailed, match="no audience"):  # says nowhere: good nowhere
        verify(RING, jwt.encode({"sub": "alice", "exp": exp}, SECRET, algorithm="HS256"))


def test_only_hs256_with_a_known_key() -> None:
    exp = int(time.time()) + 60
    claims = {"sub": "alice", "exp": exp}
    with pytest.raises(AuthFailed, match=r"'k9'.*unknown or revoked"):
        verify(RING, _mint(claims, kid="k9"))
    with pytest.raises(AuthFailed, match="bad key id"):
        verify(RING, _mint(claims, kid="x" * 300))
    with pytest.raises(AuthFailed):
        verify(RING, _raw_jwt({"alg": "HS256", "kid": 5}, claims))
    for alg in ["HS384", "HS512"]:  # the right key, another algorithm: refused
        with pytest.raises(AuthFailed):
            verify(RING, _mint(claims, alg=alg))
    # alg "none": no signature at all
    header = _b64url(json.dumps({"alg": "none", "typ": "JWT", "kid": "default"}).encode())
    with pytest.raises(AuthFailed):
        verify(RING, f"{header}.{_b64url(json.dumps(claims).encode())}.")
    # key confusion: RS256/ES256 "verified" with our secret as the public key
    good = _mint(claims).split(".")
    for alg in ["RS256", "ES256", "none"]:
        header = _b64url(json.dumps({"alg": alg, "typ": "JWT", "kid": "default"}).encode())
        with pytest.raises(AuthFailed):
            verify(RING, ".".join([header, good[1], good[2]]))
    # a forged token that is also expired says AUTH_FAILED, not TOKEN_EXPIRED
    with pytest.raises(AuthFailed):
        verify(RING, _mint({"sub": "alice", "exp": 1}, key=b"z" * 64))
    with pytest.raises(AuthFailed, match="malformed"):
        verify(RING, "x" * 5000)


def _raw_jwt(header: dict[str, object], claims: dict[str, object] | str,
             key: bytes = SECRET) -> str:
    """A correctly HS256-signed JWT with any header and claims, even as raw
    JSON text (PyJWT would refuse to make some)."""
    body = claims if isinstance(claims, str) else json.dumps(claims)
    signed = f"{_b64url(json.dumps(header).encode())}.{_b64url(body.encode())}"
    return f"{signed}.{_b64url(hmac.new(key, signed.encode(), hashlib.sha256).digest())}"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _legacy_token(secret: bytes, tenant: str, expires: int) -> str:
    """An ``rpcbuf1.`` token as the previous release made it."""
    payload = msgpack.packb([tenant, expires, b"12345678"])
    mac = hmac.new(secret, payload, hashlib.sha256).digest()
    return f"rpcbuf1.{_b64url(payload)}.{_b64url(mac)}"


def test_old_format_tokens_are_refused() -> None:
    """Issue 24, item 12: ``rpcbuf1.`` tokens skipped the tenant-name check
    and ``exp=0`` never expired.  No release shipped them: a genuine one,
    correctly signed with the default key, is refused like any garbled token."""
    for token in (_legacy_token(SECRET, "alice", 0),
                  _legacy_token(SECRET, "../etc", int(time.time()) + 60)):
        with pytest.raises(AuthFailed, match=r"old-format \(rpcbuf1\.\) token.*token create"):
            verify(RING, token)
        with pytest.raises(AuthFailed):
            verify_token(SECRET, token)


def test_secret_files_with_several_keys(tmp_path: Path) -> None:
    old = "a" * 64
    assert parse_keys(f"{old}\n".encode()).keys == {"default": old.encode()}  # old format
    ring = parse_keys(f"# keys\n\n{old}\n  2026-07 {'b' * 64}  \n".encode())
    assert ring.kids == ["default", "2026-07"] and ring.newest == "2026-07"
    for bad, says in [("", "no key"), ("# only\n", "no key"), ("k short\n", "fewer"),
                      (f"k {old}\nk {old}\n", "twice"), (f"k {old} x\n", "KEY_ID SECRET"),
                      (f"-k {old}\n", "bad key id"), (f"{old}\n{old}\n", "twice")]:
        with pytest.raises(ValueError, match=says):
            parse_keys(bad.encode(), "f")
    path = tmp_path / "s"
    path.write_text(f"{old}\nk2 {'b' * 64}\n")
    assert load_keys(path).kids == ["default", "k2"]
    with pytest.raises(ValueError, match="load_keys"):  # the one-secret API cannot pick
        load_or_create_secret(path)
    made = load_keys(tmp_path / "new", kid="2026-01")
    assert made.kids == ["2026-01"] and stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o600


@pytest.mark.parametrize(("data", "line"), [
    (b"\xff\xfe" + b"\x00" * 40, 1),  # raw bytes, no line at all
    (b"# caf\xe9 keys\nk1 " + b"a" * 64 + b"\n", 1),  # one Latin-1 byte in a comment
    (b"k1 " + b"a" * 64 + b"\nk2 " + b"b" * 63 + b"\x80\n", 2),  # in a secret
], ids=["raw", "comment", "secret"])
def test_a_secret_file_that_is_not_utf8_is_refused_naming_the_line(data: bytes,
                                                                    line: int) -> None:
    """Never silently one key ``default``: a SIGHUP would end every session
    (issue 24, item 17); the daemon keeps its keys on a ValueError."""
    with pytest.raises(ValueError, match=rf"^f:{line}: .*not UTF-8"):
        parse_keys(data, "f")


# -- audiences (issue 24, item 2) ------------------------------------------------


def test_a_token_is_for_one_cluster_unless_it_names_more() -> None:
    """A token stolen for one cluster cannot be replayed on another, even
    where both clusters' nodes share the key."""
    tok = create_token(RING, "alice", 60)  # every existing caller: cluster "default"
    assert jwt.decode(tok, KEY2, algorithms=["HS256"], audience="default")["aud"] == ["default"]
    assert verify(RING, tok).tenant == "alice"  # a node of cluster "default"
    assert verify(RING, tok, cluster="default", node="n1").tenant == "alice"
    with pytest.raises(AuthFailed, match=r"not for this node.*cluster 'prod'"):
        verify(RING, tok, cluster="prod", node="n1")
    both = create_token(RING, "alice", 60, clusters=["prod", "staging"])
    assert verify(RING, both, cluster="prod", node="n1").tenant == "alice"
    assert verify(RING, both, cluster="staging", node="n9").tenant == "alice"
    with pytest.raises(AuthFailed, match="not for this node"):
        verify(RING, both)  # cluster "default"


def test_a_token_narrowed_to_nodes_works_on_those_only() -> None:
    tok = create_token(RING, "alice", 60, clusters=["prod"], nodes=["n1", "n2"])
    assert jwt.decode(tok, KEY2, algorithms=["HS256"],
                      audience="prod/n1")["aud"] == ["prod/n1", "prod/n2"]
    for node in ("n1", "n2"):
        assert verify(RING, tok, cluster="prod", node=node).tenant == "alice"
    for cluster, node in (("prod", "n3"), ("prod", None), ("staging", "n1")):
        with pytest.raises(AuthFailed, match="not for this node"):
            verify(RING, tok, cluster=cluster, node=node)


def test_a_token_can_name_a_default_node_id() -> None:
    """A daemon's default node id is ``host:port`` (two daemons on one host
    are two nodes): a token narrowed to one must be possible to mint."""
    tok = create_token(RING, "alice", 60, nodes=["gpu7:7700"])
    assert verify(RING, tok, cluster="default", node="gpu7:7700").tenant == "alice"
    with pytest.raises(AuthFailed, match="not for this node"):
        verify(RING, tok, cluster="default", node="gpu7:7701")


def test_bad_audiences_are_refused_at_minting() -> None:
    for clusters, nodes in ((["a/b"], []), ([""], []), ([], []), (["prod"], ["n 1"]),
                            (["prod"], ["x" * 200])):
        with pytest.raises(ValueError):
            create_token(RING, "alice", 60, clusters=clusters, nodes=nodes)


def test_a_token_too_big_for_any_hello_is_not_minted() -> None:
    """Every --cluster x --node pair is an audience: 200 nodes made a token
    no node accepts (hello frames are 4 KiB before authentication)."""
    nodes = [f"gpu{i}.example:7700" for i in range(200)]
    with pytest.raises(ValueError, match="name fewer nodes"):
        create_token(RING, "alice", 60, nodes=nodes)
    assert len(create_token(RING, "alice", 60, nodes=nodes[:8])) <= 3072


# -- proof of possession: the token never crosses the wire (issue 34, H3) ---------------


def _proved(token: str, keys: Keyring | bytes, server_nonce: bytes = b"s" * 32,
            version: int = 4) -> tuple[str, bytes, bytes]:
    """What a client sends (claims, its proof) for ``token``, and the transcript."""
    from rpcbuf.control.wire import auth

    claims, secret = auth.split_token(token)
    said = auth.transcript(version, claims, b"c" * 32, server_nonce)
    return claims, auth.prove(secret, auth.CLIENT, said), said


def test_the_signature_is_the_shared_secret() -> None:
    from rpcbuf.control.wire import auth

    token = create_token(SECRET, "alice", 60)
    claims, secret = auth.split_token(token)
    assert claims == token.rpartition(".")[0] and len(secret) == 32
    assert auth.signature(SECRET, claims) == ("default", secret)  # the daemon recomputes it
    assert secret == hmac.new(SECRET, claims.encode(), hashlib.sha256).digest()
    for bad in ("", "a.b", "a.b.c", "rpcbuf1.x.y", token + "x", "x" * 5000):
        with pytest.raises(AuthFailed):
            auth.split_token(bad)


def test_check_proof_takes_only_a_proof_over_this_transcript() -> None:
    from rpcbuf.control.wire import auth

    token = create_token(SECRET, "alice", 60)
    claims, proof, said = _proved(token, SECRET)
    assert auth.check_proof(SECRET, claims, proof, said).tenant == "alice"
    other = auth.transcript(4, claims, b"c" * 32, b"t" * 32)  # another server nonce: a replay
    with pytest.raises(AuthFailed, match="proof does not match"):
        auth.check_proof(SECRET, claims, proof, other)
    with pytest.raises(AuthFailed, match="proof does not match"):  # the daemon's label
        auth.check_proof(SECRET, claims, auth.prove(auth.split_token(token)[1], auth.DAEMON,
                                                    said), said)
    with pytest.raises(AuthFailed, match="proof does not match"):  # another key, same kid
        auth.check_proof(b"k" * 32, claims, proof, said)
    with pytest.raises(AuthFailed, match="unknown or revoked"):
        auth.check_proof(Keyring({"k2": SECRET}), claims, proof, said)
    # Every field of the transcript counts.
    fields = [(4, claims, b"c" * 32, b"s" * 32), (5, claims, b"c" * 32, b"s" * 32),
              (4, claims + "x", b"c" * 32, b"s" * 32), (4, claims, b"d" * 32, b"s" * 32)]
    assert len({auth.transcript(*f) for f in fields}) == len(fields)
    with pytest.raises(ValueError):
        auth.transcript(4, claims, b"short", b"s" * 32)


def test_a_forged_proof_is_auth_failed_even_when_expired() -> None:
    """The proof is checked before any claim: a genuine expired token is
    TOKEN_EXPIRED, a forged one AUTH_FAILED, as ``verify`` does."""
    from rpcbuf.control.wire import auth

    old = create_token(SECRET, "alice", -10)
    claims, proof, said = _proved(old, SECRET)
    with pytest.raises(TokenExpired):
        auth.check_proof(SECRET, claims, proof, said)
    forged = create_token(b"f" * 32, "alice", -10)
    claims, proof, said = _proved(forged, SECRET)
    with pytest.raises(AuthFailed):
        auth.check_proof(SECRET, claims, proof, said)
