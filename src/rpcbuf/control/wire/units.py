"""Parsing of human sizes ("1GiB", "512m", "4096") and durations ("24h", "90s")."""

from __future__ import annotations

import re

# Memory sweeps (copies, hashes, fills) of this many bytes or more run in a
# worker thread (NumPy, xxhash and the copy syscalls drop the GIL), so the
# event loop keeps serving; smaller ones cost less than the hand-off.
THREAD_BYTES = 4 << 20

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 10**3, "kib": 1 << 10,
    "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
    "g": 1 << 30, "gb": 10**9, "gib": 1 << 30,
    "t": 1 << 40, "tb": 10**12, "tib": 1 << 40,
}
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_size(text: str) -> int:
    """'1GiB' -> 1073741824. Raises ValueError naming the bad text."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"bad size {text!r} (examples: 4096, 512MiB, 1GiB, 2g)")
    value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def parse_duration(text: str) -> float:
    """'24h' -> 86400.0. Raises ValueError naming the bad text."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _DURATION_UNITS:
        raise ValueError(f"bad duration {text!r} (examples: 90s, 30m, 24h, 7d)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def join_host_port(host: str, port: int) -> str:
    """``HOST:PORT`` (``[V6]:PORT``), as errors and tables show an address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(text: str, default_port: int) -> tuple[str, int]:
    """``'h:p'``, ``'h'`` (default port), ``':p'`` or ``''`` (127.0.0.1).
    Raises ValueError for a port outside 0-65535 (the kernel wraps 99999)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        return text or "127.0.0.1", default_port
    return host.strip("[]") or "127.0.0.1", check_port(port)


def check_port(text: str | int) -> int:
    """A TCP port, 0 to 65535 (0: any free one); ValueError with a sentence."""
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"port {str(text)!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is not a port (0 to 65535)")
    return port
