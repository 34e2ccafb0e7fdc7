"""Shared memory by handle: memfds, seals, fixed mappings, fds over Unix sockets,
and futexes in shared memory. System calls only, no policy.

- ``seal_read_only`` (``F_SEAL_SHRINK | GROW | FUTURE_WRITE | SEAL``): nobody can
  get a new writable mapping, ``write()`` or ``mprotect`` to writable, while
  mappings made before (the daemon's own) keep writing. ``seal_size`` seals only
  the size, so a shared region never shrinks under a mapping (SIGBUS).
- ``read_only_fd``: the handle that leaves the daemon is a read-only open file
  description, which cannot be truncated or written before seals are considered.
- Mappings are unmapped when their owner says so, never by the garbage collector.
- Once UCX is loaded (``use_ucm``) every map and unmap goes through UCM's
  ``ucm_mmap``/``ucm_munmap``, so UCX's registration cache learns a range changed
  before the old pages go (a ctypes libc ``mmap`` passes by UCM's ``reloc`` hooks).
- Futexes wake the other side of a staging area; nothing the daemon trusts.
"""

from __future__ import annotations

import array
import asyncio
import ctypes
import errno
import fcntl
import mmap
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

PAGE = mmap.PAGESIZE
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE = 0x1, 0x2, 0x4, 0x8
F_SEAL_FUTURE_WRITE = 0x10  # Linux 5.1+
READ_ONLY_SEALS = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL
SIZE_SEALS = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
SYS_futex = 202 if os.uname().machine == "x86_64" else 98  # x86_64; aarch64 (asm-generic)
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # not _PRIVATE: the word is shared between processes
MAP_FAILED = ctypes.c_void_p(-1).value

ucm_path: str | None = None  # the libucm that ``_mmap``/``_munmap`` go through (``use_ucm``)


def use_ucm(path: str) -> None:
    """Map and unmap through the libucm at ``path`` (the process's UCX) from now on."""
    global _mmap, _munmap, ucm_path
    lib = ctypes.CDLL(path, use_errno=True)
    mm, mu = lib.ucm_mmap, lib.ucm_munmap
    mm.restype, mm.argtypes = _mmap.restype, _mmap.argtypes
    mu.restype, mu.argtypes = _munmap.restype, _munmap.argtypes
    _mmap, _munmap, ucm_path = mm, mu, path


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def memfd(nbytes: int, name: str = "rpcbuf") -> int:
    """A sealable close-on-exec memfd of ``nbytes``; pages allocated on first touch."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def memfd_at(addr: int, nbytes: int, name: str, fill: memoryview | None = None,
             read_only: bool = True, resealable: bool = False) -> int:
    """A new memfd holding ``fill`` (else zeros), mapped read-write at ``addr``, then
    sealed read-only: this mapping keeps writing, no other ever can. ``read_only=False``
    seals only its size (writable handles possible); ``resealable`` leaves the seals
    open for a later ``seal_read_only``. On failure the memfd is closed."""
    fd = memfd(nbytes, name)
    try:
        at = 0
        while fill is not None and at < nbytes:  # the kernel copies from ``fill`` into the file
            at += os.pwrite(fd, fill[at:at + COPY_CHUNK], at)
        map_fixed(addr, nbytes, fd)
        if read_only:
            seal_read_only(fd)
        elif resealable:
            fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW)
        else:
            seal_size(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


COPY_CHUNK = 64 << 20  # ``memfd_at`` writes ``fill`` this much per system call


def seal_read_only(fd: int) -> None:
    """No new writable mapping, write, resize or seal change, ever."""
    fcntl.fcntl(fd, F_ADD_SEALS, READ_ONLY_SEALS)


def seal_size(fd: int) -> None:
    """The size can never change (no SIGBUS for those who mapped it)."""
    fcntl.fcntl(fd, F_ADD_SEALS, SIZE_SEALS)


def seals(fd: int) -> int:
    return int(fcntl.fcntl(fd, F_GET_SEALS))


def read_only_fd(fd: int) -> int:
    """A new read-only open file description of the memfd ``fd``."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def writable_fd(fd: int) -> int:
    """A new read-write open file description of a memfd not sealed read-only."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def _checked(addr: int | None, what: str) -> int:
    if addr is None or addr == MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return int(addr)


def _map_at(addr: int, nbytes: int, flags: int, fd: int, what: str) -> None:
    """``mmap`` read-write at exactly ``addr`` (``MAP_FIXED``), through UCM once loaded."""
    got = _checked(_mmap(addr, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags | MAP_FIXED,
                         fd, 0), what)
    if got != addr:  # MAP_FIXED never moves it; a libc that did would be a bug
        raise OSError(errno.EINVAL, f"mmap placed {got:#x}, not {addr:#x}")


def map_shared(fd: int, nbytes: int) -> int:
    """Map ``fd`` read-write and shared; its address. Only ``unmap`` unmaps it."""
    return _checked(_mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED,
                          fd, 0), "mmap")


def unmap(addr: int, nbytes: int) -> None:
    """Unmap what ``map_shared`` mapped: any access to it after this faults."""
    if _munmap(addr, nbytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap: {os.strerror(err)}")


def map_fixed(addr: int, nbytes: int, fd: int) -> None:
    """Map ``fd`` read-write and shared at exactly ``addr`` (inside our reserved range)."""
    _map_at(addr, nbytes, mmap.MAP_SHARED, fd, "mmap(MAP_FIXED)")


def map_private(addr: int, nbytes: int, fd: int) -> None:
    """Map ``fd`` copy-on-write at ``addr``: the one writable mapping a sealed memfd allows."""
    _map_at(addr, nbytes, mmap.MAP_PRIVATE, fd, "mmap(MAP_FIXED|MAP_PRIVATE)")


def map_anonymous(addr: int, nbytes: int) -> None:
    """Fresh unbacked anonymous memory at exactly ``addr`` (old pages dropped)."""
    _map_at(addr, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1,
            "mmap(MAP_FIXED|MAP_ANONYMOUS)")


MAP_FIXED = 0x10
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


# -- records with file descriptors over a Unix stream socket -------------------------

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_cred(sock: Any) -> tuple[int, int, int]:
    """(pid, uid, gid) of a Unix socket's peer as the kernel recorded it at connect."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


RECORD = struct.Struct("<QQ")  # (tag, value): what a record says besides its fds


def send_fds(sock: socket.socket, tag: int, value: int, fds: Sequence[int]) -> None:
    """One record (blocking or not: BlockingIOError when the socket is full)."""
    data = RECORD.pack(tag, value)
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([data], ancillary)
    if sent != len(data):  # 16 bytes into an empty-enough socket: never seen short
        raise OSError(errno.EMSGSIZE, "short write of a handle record")


async def asend_fds(sock: socket.socket, tag: int, value: int, fds: Sequence[int],
                    timeout: float) -> None:
    """``send_fds`` on a non-blocking socket, waiting at most ``timeout`` for the reader."""
    # No asyncio.timeout: the daemon runs this in a request's first step,
    # where (on Python 3.11) there is no current task (control/daemon/sessions/inflight.py, start).
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            send_fds(sock, tag, value, fds)
            return
        except BlockingIOError:
            fut = loop.create_future()
            loop.add_writer(sock.fileno(), fut.set_result, None)
            try:
                await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
            finally:
                loop.remove_writer(sock.fileno())


def recv_record(sock: socket.socket, max_fds: int = 1) -> tuple[int, int, list[int]] | None:
    """One record and its fds, or None when nothing is there yet. EOF or a malformed
    record: ConnectionError (its fds closed)."""
    try:
        data, fds, flags, _ = socket.recv_fds(sock, RECORD.size, max_fds,
                                              socket.MSG_CMSG_CLOEXEC)
    except BlockingIOError:
        return None
    if flags & socket.MSG_CTRUNC or len(data) != RECORD.size:
        for fd in fds:
            os.close(fd)
        if not data:
            raise ConnectionError("the handle channel was closed")
        raise ConnectionError("a malformed handle record")
    tag, value = RECORD.unpack(data)
    return tag, value, list(fds)


# -- futexes in shared memory ----------------------------------------------------------


def futex_wait(addr: int, expected: int, timeout: float) -> None:
    """Sleep while the word at ``addr`` holds ``expected``, at most ``timeout`` (GIL
    released); any wake-up alike: callers re-read the word."""
    ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
    _syscall(SYS_futex, ctypes.c_void_p(addr), FUTEX_WAIT, ctypes.c_uint32(expected),
             ctypes.byref(ts), None, 0)


def futex_wake(addr: int) -> None:
    _syscall(SYS_futex, ctypes.c_void_p(addr), FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def boot_id() -> str:
    """This kernel's boot id: two processes with the same one share a host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
