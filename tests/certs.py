"""A self-signed certificate for TLS tests, made with the openssl CLI."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def self_signed(tmp: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, in ``tmp``."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl CLI to make a test certificate")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key
