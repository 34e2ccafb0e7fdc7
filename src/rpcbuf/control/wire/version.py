"""The release, in one place (``rpcbuf.__version__``, ``--version``)."""

from __future__ import annotations

from rpcbuf.control.wire.protocol import PROTOCOL_VERSION

VERSION = "0.1.0"  # pyproject.toml's version (tests/test_cli.py holds them together)


def describe(prog: str) -> str:
    """``rpcbuf 0.1.0 (protocol 4)``."""
    return f"{prog} {VERSION} (protocol {PROTOCOL_VERSION})"
