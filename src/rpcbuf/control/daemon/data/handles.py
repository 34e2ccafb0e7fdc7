"""A same-host session's handle channel: a second Unix-socket connection
from the client's own process, bound by the session's nonce, on which the
daemon only writes fixed-size records carrying fds (``SCM_RIGHTS``): first
the session's staging area (a size-sealed memfd), then one per attach,
tagged with the request id, sent before the answer so a client with the
answer finds its fd queued.  A record carries a new read-only open file
description (``shm.read_only_fd``), never a memfd the daemon keeps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket

from rpcbuf.dataplane import shm, staging

log = logging.getLogger("rpcbuf.daemon")
SEND_TIMEOUT = 5.0  # seconds a record waits for a client that does not read its channel
STAGING_TAG = 0  # the first record's tag (request ids start at 1)


class HandleChannel:
    """One session's handle channel and its staging area."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        fd = shm.memfd(staging.SIZE, "rpcbuf-staging")
        try:
            shm.seal_size(fd)  # it can never shrink under our mapping: no SIGBUS here
            # Copies that still run hold the area (and so the mapping) until
            # they return: it is unmapped when the last of them lets go after
            # ``close``, never before, and never left for a collection.
            self.staging = staging.Shared(fd)
        except BaseException:
            os.close(fd)
            raise
        self._staging_fd: int | None = fd
        self.closed = False

    async def start(self) -> None:
        """Send the staging area (the first record); the daemon keeps no fd of it."""
        fd, self._staging_fd = self._staging_fd, None
        assert fd is not None
        try:
            await shm.asend_fds(self._sock, STAGING_TAG, staging.SIZE, [fd], SEND_TIMEOUT)
        finally:
            os.close(fd)

    async def send(self, tag: int, nbytes: int, fd: int) -> None:
        """A record for request ``tag``: ``fd`` (the caller closes it)."""
        if self.closed:
            raise ConnectionError("the handle channel is closed")
        await shm.asend_fds(self._sock, tag, nbytes, [fd], SEND_TIMEOUT)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
        if self._staging_fd is not None:
            os.close(self._staging_fd)
            self._staging_fd = None
        self.staging.close()


def same_process(a: socket.socket, b: socket.socket) -> bool:
    """Whether two Unix socket connections come from one process (``SO_PEERCRED``)."""
    return shm.peer_cred(a) == shm.peer_cred(b)
