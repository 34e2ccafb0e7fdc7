"""Write grants in shared memory: a page of slots one daemon session and its client
both map, one per buffer the client writes in place.

A slot is a lock word, a generation and a state. The client copies only under
the lock, while the state is LIVE and the generation its grant's (a reused slot
never passes an old mapping). The daemon revokes by setting REVOKED (or ENDED)
and taking the lock once: then no copy is in flight and none starts. The lock is
glibc's process-shared spinlock (a CAS, a full barrier), so no system calls.

The page is the client's to write: the daemon decides nothing for another tenant
from it, so a rogue client only tears its own reads. Mismatched glibc spinlock
values fail safe: the client copies through the daemon.
"""

from __future__ import annotations

import ctypes
import os

from rpcbuf.dataplane import shm

SLOT = 64  # bytes per slot: one cache line, so two slots never share one
LIVE, REVOKED, ENDED = 0, 1, 2  # the state word
_GEN, _STATE = 4, 8  # the words' offsets in a slot (the lock word is at 0)

_libc = ctypes.CDLL(None, use_errno=True)
_trylock = _libc.pthread_spin_trylock
_unlock = _libc.pthread_spin_unlock
_init = _libc.pthread_spin_init
for _f in (_trylock, _unlock):
    _f.restype, _f.argtypes = ctypes.c_int, [ctypes.c_void_p]
_init.restype, _init.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]
PTHREAD_PROCESS_SHARED = 1


class GrantPage:
    """``slots`` slots over one mapping of a memfd (``fd``, ours to close)."""

    def __init__(self, fd: int, slots: int, addr: int) -> None:
        self.fd, self.slots, self._addr = fd, slots, addr
        self.size = slots * SLOT
        self._words = (ctypes.c_uint32 * (self.size // 4)).from_address(addr)

    @classmethod
    def create(cls, slots: int) -> GrantPage:
        """A new page (the daemon's side), sealed against resizing."""
        size = -(-slots * SLOT // shm.PAGE) * shm.PAGE
        fd = shm.memfd(size, "rpcbuf-grants")
        try:
            shm.seal_size(fd)
            addr = shm.map_shared(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, size // SLOT, addr)

    @classmethod
    def open(cls, fd: int, size: int) -> GrantPage:
        """The client's side of a page the daemon handed over (``fd`` is ours now);
        ValueError when its size is not what the daemon said."""
        if size <= 0 or size % SLOT or os.fstat(fd).st_size != size:
            raise ValueError("the grant page is not the size the daemon stated")
        return cls(fd, size // SLOT, shm.map_shared(fd, size))

    def _lock(self, slot: int) -> int:
        if self.fd < 0:
            raise ValueError("the grant page is closed")
        if not 0 <= slot < self.slots:
            raise IndexError(f"no grant slot {slot}")
        return self._addr + slot * SLOT

    def state(self, slot: int) -> int:
        """Its state word (ENDED once the page is closed: nothing is mapped)."""
        if self.fd < 0:
            return ENDED
        return int(self._words[(self._lock(slot) - self._addr + _STATE) // 4])

    def set_state(self, slot: int, state: int) -> None:
        self._words[(self._lock(slot) - self._addr + _STATE) // 4] = state

    def generation(self, slot: int) -> int:
        if self.fd < 0:
            return -1
        return int(self._words[(self._lock(slot) - self._addr + _GEN) // 4])

    def grant(self, slot: int) -> int:
        """The daemon (re)opens ``slot``: unlocked, LIVE, its next generation (returned)."""
        at = self._lock(slot)
        if _init(at, PTHREAD_PROCESS_SHARED) != 0:
            raise OSError(ctypes.get_errno(), "pthread_spin_init failed")
        gen = (self.generation(slot) + 1) & 0xFFFFFFFF
        self._words[(at - self._addr + _GEN) // 4] = gen
        self.set_state(slot, LIVE)
        return gen

    def take(self, slot: int) -> bool:
        """Take ``slot``'s lock if it is free (never waits; never on a closed page)."""
        return self.fd >= 0 and _trylock(self._lock(slot)) == 0

    def give(self, slot: int) -> None:
        if self.fd >= 0:
            _unlock(self._lock(slot))

    def live(self, slot: int, gen: int) -> bool:
        return self.state(slot) == LIVE and self.generation(slot) == gen

    def words(self, slot: int) -> tuple[int, int, int]:
        """``slot``'s lock address and its generation's and state's indices, for ``fast_enter``."""
        at = self._lock(slot)
        first = (at - self._addr) // 4
        return at, first + _GEN // 4, first + _STATE // 4

    def fast_enter(self, lock: int, gen_at: int, state_at: int, gen: int) -> bool:
        """``enter`` over ``words``' answer (the page must be open)."""
        if _trylock(lock) != 0:
            return False
        w = self._words
        if w[state_at] != LIVE or w[gen_at] != gen:
            _unlock(lock)
            return False
        return True

    def fast_give(self, lock: int) -> None:
        _unlock(lock)

    def enter(self, slot: int, gen: int) -> bool:
        """The client, before a copy: the lock taken and generation ``gen`` LIVE (``give``
        after), else False with nothing held."""
        return self.fd >= 0 and self.fast_enter(*self.words(slot), gen)

    def close(self) -> None:
        if self.fd >= 0:
            shm.unmap(self._addr, self.size)
            os.close(self.fd)
            self.fd = -1
