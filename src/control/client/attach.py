"""Zero-copy, read-only views of buffers on this host (``ctx.attach``).

``attach`` asks the daemon for a read-only handle of one host buffer (its
own memfd; ``control/daemon/attachops.py``), which arrives on the session's
handle channel, and maps it here read-only: ``view.array()`` and
``view.tensors()`` are NumPy arrays over the daemon's pages, no copy, not
writeable (the mapping is ``PROT_READ`` and the memfd is sealed, so nothing
can make them writable).  While the attachment is open the daemon refuses
every store, clear and copy into the buffer (BUSY) and defers its release.

Closing: ``await view.close()`` (or leaving ``async with``) ends the
attachment at once when no array of it is alive; otherwise the arrays keep
the mapping *and* the attachment (so their bytes never change under them)
until the last of them is gone, and the detach goes then.  A closed view
hands out no new arrays.  When the session ends (the context closes, the
process dies) the daemon ends its attachments; arrays still alive in this
process keep the old pages mapped (the daemon no longer counts them).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import mmap
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from control.wire.errors import BadRequest, ConnectionLost
from control.wire.manifest import np_dtype


class Attachment:
    """One open attachment: the buffer's bytes, mapped read-only."""

    def __init__(self, buffer_id: str, meta: Mapping[str, Any], fd: int, nbytes: int,
                 detach: Callable[[str], asyncio.Future[Any] | None]) -> None:
        self.buffer_id = buffer_id
        self.size: int = meta["size"]
        self.tensors_meta: dict[str, dict[str, Any]] = dict(meta.get("tensors") or {})
        self.manifest_version: int = int(meta.get("manifest_version") or 0)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        base: np.ndarray | None = np.frombuffer(mm, dtype=np.uint8, count=self.size)
        self._base = base
        self.closed = False
        # When the last array over the mapping is gone: unmap, then detach
        # (the detach request lands in ``_sent``, for ``close`` to wait on).
        self._sent: list[asyncio.Future[Any]] = []
        self._done = weakref.finalize(base, _release, mm, detach, buffer_id, self._sent)

    @property
    def address(self) -> int:
        """Where the mapping starts in this process (for tests and tools)."""
        return int(self._live().ctypes.data)

    def _live(self) -> np.ndarray:
        if self._base is None:
            raise BadRequest(f"the attachment of {self.buffer_id} is closed")
        return self._base

    def array(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """``nbytes`` (default: to the end) from ``offset``, as a read-only uint8 array."""
        base = self._live()
        if nbytes is None:
            nbytes = self.size - offset
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0 \
                or offset + nbytes > self.size:
            raise BadRequest(f"[{offset}, +{nbytes}) is outside the buffer of {self.size} bytes")
        return base[offset:offset + nbytes]

    def tensors(self) -> dict[str, np.ndarray]:
        """The manifest's tensors (as of attach), by name, with their dtypes
        and shapes, read-only, over the buffer's pages."""
        base = self._live()
        out: dict[str, np.ndarray] = {}
        for name, e in self.tensors_meta.items():
            out[name] = tensor_view(base, e, self.size)
        return out

    async def close(self) -> None:
        """End the attachment (see the module: deferred while arrays live)."""
        self.closed = True
        self._base = None  # the finalizer runs now if no array is left
        if self._sent:  # it did: the detach is on its way; let it land
            await asyncio.wait(self._sent)

    async def __aenter__(self) -> Attachment:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def tensor_view(base: np.ndarray, entry: Mapping[str, Any], size: int) -> np.ndarray:
    """One manifest entry over ``base``; a malformed entry (the daemon may
    be hostile) is CONNECTION_LOST, never an array past the mapping."""
    try:
        dtype = np_dtype(entry["dtype"])
        shape = tuple(map(int, entry["shape"]))
        offset, nbytes = int(entry["offset"]), int(entry["nbytes"])
    except (KeyError, TypeError, ValueError, BadRequest) as exc:
        raise ConnectionLost(f"the daemon sent a malformed manifest entry: {exc}") from None
    if offset < 0 or nbytes < 0 or offset + nbytes > size \
            or math.prod(shape) * dtype.itemsize != nbytes or min(shape, default=0) < 0:
        raise ConnectionLost("the daemon sent a manifest entry outside its buffer")
    return base[offset:offset + nbytes].view(dtype).reshape(shape)


def _release(mm: mmap.mmap, detach: Callable[[str], asyncio.Future[Any] | None],
             buffer_id: str, sent: list[asyncio.Future[Any]]) -> None:
    with contextlib.suppress(BufferError, ValueError):
        mm.close()
    task = detach(buffer_id)
    if task is not None:
        sent.append(task)


def detacher(loop: asyncio.AbstractEventLoop,
             send: Callable[[str], Any]) -> Callable[[str], asyncio.Future[Any] | None]:
    """A detach that may be called from any thread (a finalizer): the
    request goes from ``loop``; on the loop's own thread the task is
    returned (``close`` waits for it), else nobody waits."""
    def go(buffer_id: str) -> asyncio.Future[Any]:
        task = loop.create_task(send(buffer_id))
        task.add_done_callback(_swallow)
        return task

    def detach(buffer_id: str) -> asyncio.Future[Any] | None:
        try:
            if asyncio.get_running_loop() is loop:
                return go(buffer_id)
        except RuntimeError:
            pass
        with contextlib.suppress(RuntimeError):  # the loop is closed: the session went too
            loop.call_soon_threadsafe(go, buffer_id)
        return None
    return detach


def _swallow(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # the session may be gone: it detached everything then
