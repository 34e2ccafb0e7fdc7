"""The release, in one place: ``rpcbuf.__version__``, and what ``rpcbuf
--version`` and ``rpcbufd --version`` print beside the protocol version (the
number a mismatch error names; ``protocol.py``)."""

from __future__ import annotations

from rpcbuf.control.wire.protocol import PROTOCOL_VERSION

VERSION = "0.1.0"  # pyproject.toml's version (tests/test_cli.py holds them together)


def describe(prog: str) -> str:
    """``rpcbuf 0.1.0 (protocol 4)``."""
    return f"{prog} {VERSION} (protocol {PROTOCOL_VERSION})"
