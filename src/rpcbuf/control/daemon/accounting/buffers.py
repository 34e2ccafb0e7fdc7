"""What the registry keeps: a device's ``Pool``, a ``Buffer``, a tenant's ``Quota``,
and unguessable ids (``Ids``). Plain data; the registry changes it.
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
        """An OUT_OF_MEMORY's details: the device's free bytes (placement uses them), never
        who holds the rest."""
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
    # Every change to its bytes goes through a range lock and the content index,
    # so its checksums stay true. Set False before handing out a writable mapping.
    trusted: bool = True
    # Set while its kept block is still being zeroed (range-locked until done).
    zeroed: asyncio.Future[None] | None = None
    # While it gets memory of its own (it shared a clone's): writers wait for it.
    owning: asyncio.Future[None] | None = None
    # Its block's key, pending or committed: the block store's, never listed.
    block_key: str | None = None
    # A block's segment (which holds the memfd and the charges); the block
    # holds only its slot ``[offset, offset + alloc_size)`` of the same arena.
    segment: Buffer | None = None
    # One of its tenant's N buffers (not a segment).
    counted: bool = True
    # The live write grant of a session writing it in place: taken back before
    # any other op touches its bytes, ended by its release.
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
    """Unguessable ids as ``"b-" + secrets.token_urlsafe(18)`` (same CSPRNG, 144 bits),
    drawn and encoded 256 at a time."""

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
