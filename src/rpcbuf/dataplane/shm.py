"""Shared memory by handle: memfds, seals, fixed mappings, fds over Unix
sockets, and futexes in shared memory.  The small set of system calls the
same-host path stands on (``docs/dataplane.md``), with no policy.

* ``memfd(nbytes, name)``: an anonymous shared-memory file of exactly that
  size, sealable.  ``seal_read_only`` adds ``F_SEAL_SHRINK | F_SEAL_GROW |
  F_SEAL_FUTURE_WRITE | F_SEAL_SEAL``: from then on no new writable mapping,
  no ``write()`` and no ``mprotect`` to writable can be had by anyone, while
  mappings made writable *before* the seal (the daemon's own) keep writing.
  ``seal_size`` seals only the size (a region both sides write: the staging
  area), so the file can never shrink under a mapping (which would turn every
  access past the new end into SIGBUS in the process that mapped it).
* ``memfd_at(addr, nbytes, name, fill)``: a memfd (holding ``fill``'s
  bytes, else zeros) mapped read-write at ``addr``, then sealed read-only:
  how every host buffer's memory is made (the arena's ``back``, a clone's
  ``copy_out``).
* ``read_only_fd(fd)``: a new, read-only open file description of the same
  memfd (``/proc/self/fd``), the handle that leaves the daemon: it cannot be
  truncated or written even before seals are considered.
* ``map_shared``/``unmap``: a file mapped read-write wherever the kernel
  puts it, unmapped when its owner says so -- not when the garbage collector
  gets to a Python ``mmap`` (which also keeps a ``dup`` of the fd open).
* ``map_fixed``/``map_anonymous``: put a file (or fresh anonymous memory)
  at an exact address inside a range this process reserved (``MAP_FIXED``).
  Once UCX is loaded (``use_ucm``, called by ``ucxlib``) every mapping and
  unmapping here goes through UCM's ``ucm_mmap``/``ucm_munmap``: they call
  the kernel and tell UCX's registration cache (``UCM_EVENT_VM_UNMAPPED``,
  before the old pages go) that the range changed, so a registration of a
  buffer's old pages is never used for its new ones.  libc's ``mmap`` alone
  is seen by UCM only in its default ``bistro`` hook mode (libc's code
  patched); in ``reloc`` mode (``UCX_MEM_MMAP_HOOK_MODE=reloc``, or a
  platform without bistro) UCM patches call sites in loaded libraries, and
  a ctypes call to libc's ``mmap`` passes by it: measured, no event.
* ``send_fds``/``recv_record``: a fixed-size record with file descriptors
  attached (``SCM_RIGHTS``) over a Unix stream socket.
* ``futex_wait``/``futex_wake``: sleep until a 32-bit word in shared memory
  changes; the word's owner wakes the other side.  Used for the staging
  area's two counters, never for anything the daemon trusts.
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
    """Map and unmap through the libucm at ``path`` (the one UCX in this
    process uses) from now on: ``ucm_mmap``/``ucm_munmap`` have libc's
    signatures, call the original functions and dispatch UCM's memory events
    (see the module docstring).  Nothing before UCX loaded can be registered."""
    global _mmap, _munmap, ucm_path
    lib = ctypes.CDLL(path, use_errno=True)
    mm, mu = lib.ucm_mmap, lib.ucm_munmap
    mm.restype, mm.argtypes = _mmap.restype, _mmap.argtypes
    mu.restype, mu.argtypes = _munmap.restype, _munmap.argtypes
    _mmap, _munmap, ucm_path = mm, mu, path


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def memfd(nbytes: int, name: str = "rpcbuf") -> int:
    """A sealable memfd of exactly ``nbytes`` (close-on-exec); its pages are
    allocated when first touched."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def memfd_at(addr: int, nbytes: int, name: str, fill: memoryview | None = None,
             read_only: bool = True, resealable: bool = False) -> int:
    """A new memfd of ``nbytes`` holding ``fill``'s bytes (else zeros),
    mapped read-write and shared at exactly ``addr`` (``map_fixed``), then
    sealed read-only (``seal_read_only``): this mapping keeps writing, no
    other ever can.  ``read_only=False``: only its size is sealed
    (``seal_size``), so a writable handle of it can still be mapped writable
    (a block segment, which its owning tenant writes in place);
    ``resealable`` too leaves the seals open, so ``seal_read_only`` can
    still close it (a buffer its owner writes in place).  On failure
    the memfd is closed and the error raised (whatever was mapped at
    ``addr`` may be replaced by then)."""
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
    """A new read-write open file description of the memfd ``fd`` (one that
    is not sealed read-only: a block segment handed to its owner)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def _checked(addr: int | None, what: str) -> int:
    if addr is None or addr == MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return int(addr)


def _map_at(addr: int, nbytes: int, flags: int, fd: int, what: str) -> None:
    """``mmap`` read-write at exactly ``addr`` (``MAP_FIXED``: whatever was
    mapped there is replaced), through UCM once UCX is loaded (``use_ucm``)."""
    got = _checked(_mmap(addr, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags | MAP_FIXED,
                         fd, 0), what)
    if got != addr:  # MAP_FIXED never moves it; a libc that did would be a bug
        raise OSError(errno.EINVAL, f"mmap placed {got:#x}, not {addr:#x}")


def map_shared(fd: int, nbytes: int) -> int:
    """Map ``fd`` read-write and shared wherever the kernel puts it; its
    address.  Nothing unmaps it but ``unmap``: the mapping keeps the file
    (and its pages) until then, whatever becomes of ``fd``."""
    return _checked(_mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED,
                          fd, 0), "mmap")


def unmap(addr: int, nbytes: int) -> None:
    """Unmap what ``map_shared`` mapped: any access to it after this faults."""
    if _munmap(addr, nbytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap: {os.strerror(err)}")


def map_fixed(addr: int, nbytes: int, fd: int) -> None:
    """Map ``fd`` read-write and shared at exactly ``addr`` (inside a range
    this process reserved; whatever was mapped there is replaced)."""
    _map_at(addr, nbytes, mmap.MAP_SHARED, fd, "mmap(MAP_FIXED)")


def map_private(addr: int, nbytes: int, fd: int) -> None:
    """Map ``fd`` private (copy-on-write) at exactly ``addr``: reads see the
    file's pages, a write would copy the page into this process only.  The
    one writable mapping a sealed memfd still allows."""
    _map_at(addr, nbytes, mmap.MAP_PRIVATE, fd, "mmap(MAP_FIXED|MAP_PRIVATE)")


def map_anonymous(addr: int, nbytes: int) -> None:
    """Fresh, unbacked anonymous memory at exactly ``addr`` (what a buffer's
    range goes back to when it is freed: its old pages are dropped here)."""
    _map_at(addr, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1,
            "mmap(MAP_FIXED|MAP_ANONYMOUS)")


MAP_FIXED = 0x10
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


# -- records with file descriptors over a Unix stream socket -------------------------

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_cred(sock: Any) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected a Unix socket, as the
    kernel recorded it at connect (``SO_PEERCRED``: not what the peer says)."""
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
    """``send_fds`` on a non-blocking socket, waiting (at most ``timeout``)
    while the peer does not read."""
    # No asyncio.timeout: the daemon runs this in a request's first step,
    # where (on Python 3.11) there is no current task (control/daemon/sessions/intake.py, start).
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
    """One record and its fds, from a non-blocking socket: None when nothing
    is there yet.  EOF or a malformed record: ConnectionError (fds that came
    with it are closed)."""
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
    """Sleep while the 32-bit word at ``addr`` holds ``expected``, at most
    ``timeout`` seconds (GIL released); returns on a wake, a change, a
    timeout or a signal alike: callers re-read the word."""
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
