"""Our end of a same-host session's handle channel.

A second connection to the daemon's Unix socket, checked to reach the same
daemon process, bound with the hello's nonce.  Then only the daemon writes
records with fds: the staging area first, then one per attach, tagged with
its request id.  Every record is checked as a hostile peer's: the staging
fd a memfd of exactly the staging size, sealed against shrinking (no
SIGBUS); an attach fd read-only, write-sealed and of the size answered.
Records nobody waits for are closed; at most ``INBOX_MAX`` wait.  ``close``
unmaps the staging area at once, or when the ring thread lets go.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import stat

from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import ConnectionLost, Timeout
from rpcbuf.dataplane import shm, staging

INBOX_MAX = 64  # records received before anyone asked for them (then the oldest is closed)


class Handles:
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._inbox: dict[int, tuple[int, int]] = {}  # tag -> (value, fd)
        self.staging: staging.Shared | None = None  # our mapping of the staging area
        self.closed = False

    @property
    def area(self) -> staging.Area | None:
        return None if self.staging is None else self.staging.area

    @classmethod
    async def bind(cls, sock: socket.socket, nonce: bytes, timeout: float) -> Handles:
        """Bind ``sock`` as the channel of the session whose hello gave ``nonce``,
        and map its staging area.  Raises CONNECTION_LOST, TIMEOUT."""
        self = cls(sock)
        try:
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(sock, P.encode_frame(P.BindHandles(nonce=nonce).to_wire(1)))
            size, fd = await self.fd_for(0, timeout)
            try:
                self._map_staging(fd, size)
            finally:
                os.close(fd)
        except BaseException:
            self.close()
            raise
        return self

    def _map_staging(self, fd: int, size: int) -> None:
        st = os.fstat(fd)
        if size != staging.SIZE or st.st_size != staging.SIZE or not stat.S_ISREG(st.st_mode):
            raise ConnectionLost(f"the daemon's staging area is {st.st_size} bytes, "
                                 f"not {staging.SIZE}")
        try:
            sealed = shm.seals(fd)
        except OSError:
            sealed = 0
        if not sealed & shm.F_SEAL_SHRINK:
            raise ConnectionLost("the daemon's staging area can shrink (no F_SEAL_SHRINK)")
        # Not Python's mmap: it keeps a dup of the memfd and cannot be closed
        # while a NumPy view of it lives, so it went only when collected.
        self.staging = staging.Shared(fd)

    async def fd_for(self, tag: int, timeout: float | None) -> tuple[int, int]:
        """The record tagged ``tag``: (value, fd; ours to close).  Raises
        CONNECTION_LOST, TIMEOUT."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                while tag not in self._inbox:
                    if self.closed:
                        raise ConnectionLost("the handle channel is closed")
                    if not self._pull():
                        fut = loop.create_future()
                        loop.add_reader(self._sock.fileno(), _ready, fut)
                        try:
                            await fut
                        finally:
                            loop.remove_reader(self._sock.fileno())
        except TimeoutError:
            raise Timeout(f"the daemon sent no handle for request {tag} in time") from None
        return self._inbox.pop(tag)

    def _pull(self) -> bool:
        got = False
        while True:
            try:
                record = shm.recv_record(self._sock)
            except (ConnectionError, OSError) as exc:
                self.close()
                raise ConnectionLost(f"the handle channel broke: {exc}") from None
            if record is None:
                return got
            tag, value, fds = record
            got = True
            if len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                self.close()
                raise ConnectionLost("the daemon sent a handle record without exactly one fd")
            old = self._inbox.pop(tag, None)
            if old is not None:
                os.close(old[1])
            if len(self._inbox) >= INBOX_MAX:
                os.close(self._inbox.pop(next(iter(self._inbox)))[1])
            self._inbox[tag] = (value, fds[0])

    def close(self) -> None:
        """Close the channel and unmap the staging area (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.staging is not None:
            self.staging.close()
        with contextlib.suppress(OSError):
            self._sock.close()
        for _, fd in self._inbox.values():
            os.close(fd)
        self._inbox.clear()


def check_read_only(fd: int, nbytes: int) -> None:
    """An attach handle: exactly ``nbytes``, read-only, write-sealed.  Raises
    CONNECTION_LOST."""
    st = os.fstat(fd)
    if st.st_size != nbytes:
        raise ConnectionLost(f"the daemon's handle is {st.st_size} bytes, not {nbytes}")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
        raise ConnectionLost("the daemon's handle is not read-only")
    try:
        sealed = shm.seals(fd)
    except OSError:
        sealed = 0
    if not sealed & shm.F_SEAL_FUTURE_WRITE or not sealed & shm.F_SEAL_SHRINK:
        raise ConnectionLost("the daemon's handle is not sealed read-only")


def _ready(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
