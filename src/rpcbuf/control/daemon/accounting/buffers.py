"""What the registry keeps: a device's ``Pool`` (arena, allocator, and who
owns each block), a ``Buffer`` (its slice, tenant, lease, manifest, range
locks and pins), a tenant's ``Quota``, and the unguessable ids (``Ids``).
Plain data; the rules that change them are ``registry.Registry``'s.
"""

from __future__ import annotations

import asyncio
import base64
import os
from dataclasses import dataclass, field
from typing import Any

from rpcbuf.control.daemon.accounting.locks import RangeLocks
from rpcbuf.control.wire.manifest import RESERVED
from rpcbuf.dataplane.allocator import Allocator
from rpcbuf.dataplane.allocators import make_allocator
from rpcbuf.dataplane.arena import Arena, host_memory


@dataclass
class Pool:
    """One device: its arena and the allocator that carves it."""

    key: str
    arena: Arena
    allocator: Allocator
    owners: dict[int, Buffer] = field(default_factory=dict)  # allocator offset -> its buffer
    # Each of its blocks holds a memfd, mapped into the arena (host memory):
    # charged as an fd and a mapping to the block's tenant (``Registry``).
    holds_fds: bool = False

    def __post_init__(self) -> None:
        self.holds_fds = host_memory(self.arena) is not None

    @classmethod
    def create(cls, arena: Arena, allocator: str) -> Pool:
        kind = arena.kind
        # Whole pages on host arenas (one memfd per buffer), the VMM granularity
        # on GPU arenas that back buffers one by one.
        block = max(256, arena.granularity)
        return cls(f"{kind}:{arena.device}", arena,
                   make_allocator(allocator, arena.size, block))

    def describe(self) -> dict[str, Any]:
        st = self.allocator.stats()
        return {
            **self.arena.describe(),
            "key": self.key,
            "allocator": self.allocator.name,
            "total": st.total,
            "used": st.used,
            "free": st.free,
            "largest_free": st.largest_free,
        }

    def oom_details(self, size: int) -> dict[str, Any]:
        """An OUT_OF_MEMORY's details: the device's free bytes are fine for a
        tenant to see (placement uses them); who holds the rest, and how it
        is laid out, is not said."""
        st = self.allocator.stats()
        try:
            block = self.allocator.block_size(size)
        except Exception:  # (a size no allocator takes: what was asked)
            block = size
        return {"requested": size, "block": block, "free": st.free,
                "largest_free": st.largest_free, "device": self.key}


@dataclass
class Buffer:
    buffer_id: str
    tenant: str
    pool: Pool
    offset: int
    size: int
    alloc_size: int
    name: str | None
    session_id: str | None  # set only for session-scoped buffers
    ttl: float | None
    created_at: float
    expires_at: float | None
    tensors: dict[str, Any] = field(default_factory=dict)
    manifest_version: int = 0  # bumped by every manifest change
    tensors_end: int = 0  # where new slots go: the end of the highest slot ever recorded
    locks: RangeLocks = field(default_factory=RangeLocks)
    pins: int = 0
    attached: int = 0  # open attachments (each also holds a pin): writes are BUSY
    # Live sessions that were handed an fd of its memory (attach): a reader
    # may keep a dup of it past detach and release, so its block stays
    # charged to its tenant, freed or not, until the last of them ends.
    exported_to: int = 0
    released: bool = False
    freed: bool = False  # its block went back to the allocator: never again
    entries_charged: int = 0  # manifest entries charged to the tenant (ENTRY_BYTES each)
    # Whether every change to its bytes goes through the data pipeline (range
    # lock, ``ContentIndex.forget``), so the checksums the daemon computed stay
    # true until then (content.py).  Whoever hands out a way to write it
    # behind the daemon's back (a writable mapping) must set this False first.
    trusted: bool = True
    # Set while its block, kept from an earlier buffer, is still being zeroed
    # (``backing.lock_until_zeroed``): done once it is; its range lock is
    # held until then.
    zeroed: asyncio.Future[None] | None = None
    # While it is being given memory of its own (``Pipeline.own``: it shared
    # memory with a clone): the one copy every writer waits for.
    owning: asyncio.Future[None] | None = None
    # The key of the block it holds (``blocks.py``), pending or committed:
    # such a buffer is the block store's, never listed or named as a buffer.
    block_key: str | None = None
    # A block of the KV tier lives in a slot of a segment (``segments.py``):
    # that segment, a buffer of the block store with the memfd and the
    # charges (bytes, fd, mapping); the block itself holds none of them, only
    # its slot ``[offset, offset + alloc_size)`` of the same arena.
    segment: Buffer | None = None
    # Whether it counts as one of its tenant's buffers (the quota's N): not
    # a segment, which is charged bytes, an fd and a mapping only.
    counted: bool = True
    # The live write grant of a session writing it in place (``mapops``):
    # taken back before any other op touches its bytes, ended by its release.
    mapped: Any = None
    written: bool = False  # ever locked for writing (``Pipeline.lock``) or mapped writable
    renew_logged_at: float = 0.0  # audit records of renews are coalesced (see Session)
    renews_unlogged: int = 0

    def meta(self, tensors: bool = True) -> dict[str, Any]:
        return {
            "buffer_id": self.buffer_id,
            "name": self.name,
            "size": self.size,
            "alloc_size": self.alloc_size,
            "device_type": self.pool.arena.device_type,
            "device": self.pool.arena.device,
            # Not the arena offset: that would map other tenants' memory.
            "base_addr": 0,
            "tenant": self.tenant,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "ttl": self.ttl,
            "session_scoped": self.session_id is not None,
            "attached": self.attached,  # open read-only attachments (writes are BUSY)
            "tensors": self.tensors if tensors else None,
            "tensor_count": len(self.tensors),
            # of those, the model loader's own entries (listings count them out)
            "reserved_count": sum(n in self.tensors for n in RESERVED),
            "tensors_end": self.tensors_end,
            "manifest_version": self.manifest_version,
        }


_ID_BYTES = 18  # a buffer id is "b-" + 24 base64url characters: 144 random bits
_ID_CHARS = _ID_BYTES * 4 // 3  # 18 bytes are whole base64 groups: no padding, no spill


class Ids:
    """Unguessable buffer ids, as ``"b-" + secrets.token_urlsafe(18)`` makes
    them (the same CSPRNG, the same 144 bits each), drawn from the OS and
    base64-encoded 256 at a time instead of one syscall and one encode each."""

    BATCH = 256

    def __init__(self) -> None:
        self._text = ""
        self._at = 0

    def next(self) -> str:
        at = self._at
        if at >= len(self._text):
            self._text = base64.urlsafe_b64encode(os.urandom(_ID_BYTES * self.BATCH)).decode()
            at = 0
        self._at = at + _ID_CHARS
        return "b-" + self._text[at:at + _ID_CHARS]


@dataclass(frozen=True)
class Quota:
    bytes_per_device: int | None = None
    buffers: int | None = None
