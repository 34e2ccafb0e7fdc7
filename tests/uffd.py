"""Memory whose pages never arrive: a ``userfaultfd`` range registered for
missing pages and never served.  Any access to it (ours, or the daemon's
``process_vm_readv`` on the same-host path) blocks until ``release()``
closes the userfaultfd, after which the pages fault in as zeros.  It stands
in for the hostile client's FUSE- or userfaultfd-backed memory."""

from __future__ import annotations

import ctypes
import mmap
import os
import struct

import numpy as np

_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}
_UFFD_API = 0xAA
_UFFDIO_API = 0xC018AA3F
_UFFDIO_REGISTER = 0xC020AA00
_MODE_MISSING = 1
_libc = ctypes.CDLL(None, use_errno=True)


def available() -> str | None:
    """None when the range can be made here, else why not."""
    if os.uname().machine not in _SYS_USERFAULTFD:
        return "userfaultfd syscall number unknown for this machine"
    try:
        Stalled(4096).release()
    except OSError as exc:
        return f"userfaultfd: {exc}"
    return None


class Stalled:
    """``nbytes`` of never-arriving memory; ``array`` is a uint8 view of it
    (do not touch it before ``release``: this thread would block too)."""

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self.map, dtype=np.uint8)  # no page is touched
        fd = _libc.syscall(_SYS_USERFAULTFD.get(os.uname().machine, -1),
                           os.O_CLOEXEC | os.O_NONBLOCK)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.fd: int | None = fd
        api = ctypes.create_string_buffer(struct.pack("QQQ", _UFFD_API, 0, 0), 24)
        reg = ctypes.create_string_buffer(
            struct.pack("QQQQ", self.array.ctypes.data, nbytes, _MODE_MISSING, 0), 32)
        for req, arg in ((_UFFDIO_API, api), (_UFFDIO_REGISTER, reg)):
            if _libc.ioctl(fd, ctypes.c_ulong(req), arg) != 0:
                err = ctypes.get_errno()
                self.release()
                raise OSError(err, os.strerror(err))

    def release(self) -> None:
        """Let every blocked access go on (the pages fault in as zeros)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
