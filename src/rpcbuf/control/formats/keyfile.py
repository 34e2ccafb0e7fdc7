"""The node's key file: ``KEY_ID SECRET`` lines, created 0600 when missing.

Parsing refuses, naming the line, anything that is not one or two words of
UTF-8 (a binary secret is written as hex), a key id outside ``KID_RE``, a key
id named twice, and a secret shorter than ``SECRET_BYTES``: a refused file
changes nothing (SIGHUP keeps the running keys)."""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from rpcbuf.control.wire.auth import DEFAULT_KID, KID_RE, SECRET_BYTES, Keyring

log = logging.getLogger("rpcbuf.auth")


def parse_keys(data: bytes, where: str = "secret file") -> Keyring:
    """Raises ValueError naming the line."""
    try:
        lines = data.decode().splitlines()
    except UnicodeDecodeError as exc:
        # Refused like any other malformed file (SIGHUP keeps the running
        # keys): taking the bytes as one key ``default`` would end every
        # session over one Latin-1 byte in a comment.
        n = data[:exc.start].count(b"\n") + 1
        raise ValueError(f"{where}:{n}: byte 0x{data[exc.start]:02x} is not UTF-8 text "
                         "(a secret file holds 'KEY_ID SECRET' lines; write a binary "
                         "secret as hex)") from None
    keys: dict[str, bytes] = {}
    for n, line in enumerate(lines, 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) == 1:
            kid, secret = DEFAULT_KID, words[0]
        elif len(words) == 2:
            kid, secret = words
        else:
            raise ValueError(f"{where}:{n}: want 'KEY_ID SECRET' or a bare SECRET")
        if not KID_RE.fullmatch(kid):
            raise ValueError(f"{where}:{n}: bad key id {kid!r}: letters, digits and _.:- "
                             "only, at most 64 characters")
        if kid in keys:
            raise ValueError(f"{where}:{n}: key id {kid!r} appears twice")
        keys[kid] = _long_enough(secret.encode(), f"{where}:{n}")
    if not keys:
        raise ValueError(f"{where} holds no key")
    return Keyring(keys)


def _long_enough(secret: bytes, where: str) -> bytes:
    if len(secret) < SECRET_BYTES:
        raise ValueError(f"{where} holds fewer than {SECRET_BYTES} bytes of secret")
    return secret


def load_keys(path: str | os.PathLike[str], create: bool = True,
              kid: str = DEFAULT_KID) -> Keyring:
    """Create the file (0600, key ``kid``, 32 random bytes as hex) when missing.
    Raises FileNotFoundError (missing, ``create=False``) or ValueError."""
    p = Path(path)
    if not p.exists():
        if not create:
            raise FileNotFoundError(f"secret file {p} does not exist")
        if not KID_RE.fullmatch(kid):
            raise ValueError(f"bad key id {kid!r}: letters, digits and _.:- only")
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("# rpcbuf node keys, one 'KEY_ID SECRET' a line; the last signs new "
                    "tokens\n")
            f.write(f"{kid} {secrets.token_hex(SECRET_BYTES)}\n")
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        log.warning("secret file %s is readable by others (mode %o); chmod 600 it", p, mode)
    return parse_keys(p.read_bytes(), str(p))


def load_or_create_secret(path: str | os.PathLike[str], create: bool = True) -> bytes:
    """The secret of a one-key file (key ``default``). Raises ValueError for a
    file with several keys: use ``load_keys``."""
    ring = load_keys(path, create)
    if ring.kids != [DEFAULT_KID]:
        raise ValueError(f"secret file {path} holds keys {', '.join(ring.kids)}: "
                         "use load_keys")
    return ring.keys[DEFAULT_KID]
