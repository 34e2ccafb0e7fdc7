"""What this process listens on, and which interface holds an address. UCX opens
sockets no Python object knows of, so the truth comes from the kernel
(``/proc/self/fd`` against ``/proc/net/tcp``, ``tcp6``). Linux only; else empty.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column
_SIOCGIFADDR = 0x8915


def _inodes() -> set[str]:
    out = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith("socket:["):
                    out.add(target[8:-1])
    return out


def _addr(hexaddr: str) -> str:
    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # four little-endian 32-bit words
        words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
        ip = f"[{socket.inet_ntop(socket.AF_INET6, b''.join(words))}]"
    return f"{ip}:{int(port, 16)}"


def listening() -> list[str]:
    """``HOST:PORT`` of every TCP socket this process listens on, sorted (at most 64)."""
    mine, out = _inodes(), set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f, None)
            for line in f:
                cols = line.split()
                if len(cols) > 9 and cols[3] == _LISTEN and cols[9] in mine:
                    out.add(_addr(cols[1]))
    return sorted(out)[:64]


def interface_of(host: str) -> str | None:
    """The interface holding IPv4 ``host`` (``lo`` for loopback); None otherwise."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.version != 4 or ip.is_unspecified:
        return None
    if ip.is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                req = struct.pack("256s", name.encode()[:15])
                got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
                if socket.inet_ntoa(got[20:24]) == host:
                    return name
    return None
