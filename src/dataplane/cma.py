"""Same-host copies between the daemon's arena and a client process's memory.

A client on the daemon's host sends the *addresses* of its arrays instead of
their bytes; the daemon copies between those addresses and the arena slice it
has checked, pinned and locked, with ``process_vm_readv`` (a store) or
``process_vm_writev`` (a read): one copy by the kernel, no socket, no UCX
(cross-memory attach, what UCX's ``cma`` transport uses, driven by the daemon).
Every byte still passes through the daemon's own checks: it chooses where the
bytes land, it locks the range, it checksums what arrived.

Whose memory: the peer's pid comes from ``SO_PEERCRED`` on the Unix control
socket (the kernel says it; the client cannot choose it), so a client can only
make the daemon touch its *own* memory.  A ``pidfd`` taken when the session
starts is polled before every copy: once that process has exited its pid may be
reused, and we must never copy into a stranger.

Failure: a bad address (unmapped, read-only for a read's destination) is
``EFAULT``, a vanished client ``ESRCH``; both come back as ``CmaError`` with no
partial result trusted.  The kernel needs ptrace access to the peer (same user
or ``CAP_SYS_PTRACE``; Yama ``ptrace_scope`` 1 also wants the client to name
the daemon with ``PR_SET_PTRACER``): ``probe`` tells before any data op.

Big copies run in a worker thread in chunks of ``CHUNK`` bytes; ``cancelled``
is checked between chunks, so a session that closes stops within one chunk.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import select
from collections.abc import Callable, Sequence

import numpy as np

IOV_MAX = 1024  # Linux's UIO_MAXIOV: iovecs per call, per side
CHUNK = 8 << 20  # bytes per call in big copies: the cancellation granularity

_libc = ctypes.CDLL(None, use_errno=True)
_SIG = (ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
        ctypes.c_ulong)
_readv = _libc.process_vm_readv
_writev = _libc.process_vm_writev
for _fn in (_readv, _writev):
    _fn.restype = ctypes.c_ssize_t
    _fn.argtypes = _SIG
PR_SET_PTRACER = 0x59616D61


class CmaError(OSError):
    """A same-host copy failed; ``errno`` says why (EFAULT, ESRCH, EPERM)."""


class Peer:
    """One client process the daemon may copy from and to."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd: int | None = os.pidfd_open(pid)

    def alive(self) -> bool:
        fd = self._pidfd
        if fd is None:
            return False
        p = select.poll()
        p.register(fd, select.POLLIN)
        return not p.poll(0)  # readable: the process has exited

    def close(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            os.close(fd)

    def probe(self, addr: int, expected: bytes) -> str | None:
        """Read ``len(expected)`` bytes at ``addr``: None when they match,
        else why the same-host path cannot be used."""
        got = np.zeros(len(expected), dtype=np.uint8)
        try:
            self.read([got.ctypes.data], [addr], [len(expected)])
        except CmaError as exc:
            if exc.errno == errno.EPERM:
                return ("the daemon may not access this process's memory (needs the same "
                        "user or CAP_SYS_PTRACE; see docs/performance.md)")
            return f"process_vm_readv failed: {os.strerror(exc.errno or 0)}"
        if got.tobytes() != expected:
            return "probe bytes differ: not the same host after all"
        return None

    def read(self, local: Sequence[int] | np.ndarray, remote: Sequence[int] | np.ndarray,
             sizes: Sequence[int] | np.ndarray,
             cancelled: Callable[[], bool] | None = None) -> None:
        """Copy ``sizes[i]`` bytes from the peer's ``remote[i]`` to our ``local[i]``."""
        self._copy(_readv, local, remote, sizes, cancelled)

    def write(self, local: Sequence[int] | np.ndarray, remote: Sequence[int] | np.ndarray,
              sizes: Sequence[int] | np.ndarray,
              cancelled: Callable[[], bool] | None = None) -> None:
        """Copy ``sizes[i]`` bytes from our ``local[i]`` to the peer's ``remote[i]``."""
        self._copy(_writev, local, remote, sizes, cancelled)

    def _copy(self, fn: Callable[..., int], local: Sequence[int] | np.ndarray,
              remote: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray,
              cancelled: Callable[[], bool] | None) -> None:
        if not self.alive():
            raise CmaError(errno.ESRCH, "the client process has exited")
        if len(sizes) == 1 and int(sizes[0]) <= CHUNK:  # the common small op: no NumPy
            total = int(sizes[0])
            liov1 = (ctypes.c_uint64 * 2)(int(local[0]), total)
            riov1 = (ctypes.c_uint64 * 2)(int(remote[0]), total)
            n = fn(self.pid, ctypes.addressof(liov1), 1, ctypes.addressof(riov1), 1, 0)
            _check(n, total)
            return
        for lo, hi, liov, riov, total in _calls(local, remote, sizes):
            if cancelled is not None and cancelled():
                raise CmaError(errno.ECANCELED, "copy cancelled")
            _check(fn(self.pid, liov.ctypes.data, hi - lo, riov.ctypes.data, hi - lo, 0), total)


def _check(n: int, total: int) -> None:
    if n < 0:
        err = ctypes.get_errno()
        raise CmaError(err, os.strerror(err))
    if n != total:  # a partial copy: part of the range is not mapped
        raise CmaError(errno.EFAULT, f"copied {n} of {total} bytes")


def _calls(local: Sequence[int] | np.ndarray, remote: Sequence[int] | np.ndarray,
           sizes: Sequence[int] | np.ndarray
           ) -> list[tuple[int, int, np.ndarray, np.ndarray, int]]:
    """Split the pieces into syscalls: at most ``IOV_MAX`` iovecs and about
    ``CHUNK`` bytes each (a piece bigger than ``CHUNK`` is cut up)."""
    lo_a = np.asarray(local, dtype=np.uint64)
    re_a = np.asarray(remote, dtype=np.uint64)
    sz_a = np.asarray(sizes, dtype=np.uint64)
    keep = sz_a > 0
    lo_a, re_a, sz_a = lo_a[keep], re_a[keep], sz_a[keep]
    if len(sz_a) and int(sz_a.max()) > CHUNK:  # cut big pieces into CHUNK-sized ones
        parts = (sz_a + np.uint64(CHUNK - 1)) // np.uint64(CHUNK)
        idx = np.repeat(np.arange(len(sz_a)), parts.astype(np.int64))
        first = np.repeat(np.cumsum(parts) - parts, parts.astype(np.int64))
        k = (np.arange(len(idx), dtype=np.uint64) - first.astype(np.uint64))
        step = k * np.uint64(CHUNK)
        lo_a, re_a = lo_a[idx] + step, re_a[idx] + step
        sz_a = np.minimum(sz_a[idx] - step, np.uint64(CHUNK))
    n = len(sz_a)
    if not n:
        return []
    ends = np.cumsum(sz_a)
    # A call ends at every IOV_MAX-th piece and wherever the bytes cross a CHUNK line.
    cuts = set(range(IOV_MAX, n, IOV_MAX))
    lines = np.arange(CHUNK, int(ends[-1]), CHUNK, dtype=np.uint64)
    cuts.update(int(i) + 1 for i in np.searchsorted(ends, lines) if int(i) + 1 < n)
    bounds = [0, *sorted(cuts), n]
    liov = np.empty((n, 2), dtype=np.uint64)
    riov = np.empty((n, 2), dtype=np.uint64)
    liov[:, 0], liov[:, 1] = lo_a, sz_a
    riov[:, 0], riov[:, 1] = re_a, sz_a
    out = []
    for lo, hi in itertools.pairwise(bounds):
        out.append((lo, hi, liov[lo:hi], riov[lo:hi],
                    int(ends[hi - 1]) - (int(ends[lo - 1]) if lo else 0)))
    return out


def allow_tracer(pid: int) -> None:
    """Under Yama ``ptrace_scope`` 1, let process ``pid`` (the daemon) copy
    to and from this process (``PR_SET_PTRACER``); a no-op elsewhere."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = f.read().strip()
    except OSError:
        return
    if scope == "1":
        _libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)


def boot_id() -> str:
    """This kernel's boot id: two processes with the same one share a host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
