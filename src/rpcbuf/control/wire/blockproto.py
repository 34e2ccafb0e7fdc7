"""The requests of the keyed block tier (``docs/kvcache.md``; the daemon's
side is ``daemon/ops/blockops.py``), re-exported by ``protocol.py``, whose
``OPS`` lists them with the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rpcbuf.control.wire.fields import BlockKeys, Inline, PathName, Request, U64Array


@dataclass(frozen=True)
class BlockPut(Request):
    """Keyed blocks, written two-phase (``daemon/ops/blockops.py``): each key gets
    a new block of ``sizes[i]`` bytes, its bytes follow as a batch does (one
    UCX message per block, tag ``run_tag(id, i)``; or the staging slot
    ``stage``, back to back in key order), and once all landed and match
    ``checksums`` (xxh3-64, required) the blocks replace what the keys named,
    all at once.  Until then no reader sees them.  ``metas``: a small opaque
    blob per block (at most MAX_STR bytes), given back by ``block_lookup``;
    ``ttl``: seconds each block lives (None: until evicted or removed)."""

    op: ClassVar[str] = "block_put"
    keys: BlockKeys
    sizes: U64Array
    checksums: U64Array
    metas: list[bytes] | None = None
    ttl: float | None = None
    device_type: str = "CPU"
    device: int = 0
    path: PathName = "ucx"  # as ``Store.path``
    stage: int | None = None
    # Path "inline": the blocks' bytes themselves, back to back in key order
    # (at most the hello's ``inline_max``; a daemon whose hello says
    # ``block_inline``): a small put of a network session in its frame.
    data: Inline | None = None


@dataclass(frozen=True)
class BlockGet(Request):
    """The bytes of blocks, each ``sizes[i]`` long as the reader expects
    (one UCX message per block, or the staging slot ``stage`` back to back).
    All or nothing: a key that is missing (or of another size) is NOT_FOUND
    naming them (``details.missing``, ``details.sizes``), and nothing moves."""

    op: ClassVar[str] = "block_get"
    keys: BlockKeys
    sizes: U64Array
    # "inline": the blocks' bytes come in the answer (``data``, back to back,
    # at most ``inline_max``; a daemon whose hello says ``block_inline``).
    path: PathName = "ucx"
    stage: int | None = None


@dataclass(frozen=True)
class BlockLookup(Request):
    """Which keys name a block, with their sizes (and ``metas`` when asked)."""

    op: ClassVar[str] = "block_lookup"
    keys: BlockKeys
    meta: bool | None = None


@dataclass(frozen=True)
class BlockRemove(Request):
    op: ClassVar[str] = "block_remove"
    keys: BlockKeys


@dataclass(frozen=True)
class BlockAttach(Request):
    """A read-only handle of one block, sent on the handle channel (as
    ``attach``); the answer names the buffer id ``detach`` takes.  The block
    is pinned (never evicted, freed only at the last detach) meanwhile."""

    op: ClassVar[str] = "block_attach"
    key: str


@dataclass(frozen=True)
class BlockList(Request):
    """The tenant's keys in order, at most ``limit`` (<= MAX_BLOCK_KEYS) after
    ``start_after``, those starting with ``prefix``; ``more`` says whether
    others follow."""

    op: ClassVar[str] = "block_list"
    prefix: str | None = None
    start_after: str | None = None
    limit: int = 1000


# -- same host, in place (docs/kvcache.md "Same host, in place") ------------------------


@dataclass(frozen=True)
class BlockPlace(Request):
    """A same-host put's first half: pending slots for blocks of ``sizes``
    in the tenant's segments (as ``block_put`` takes them), held for this
    session under the answer's ``lease``.  The answer says where each slot
    lies (``segments``: the distinct segment ids; ``which``: per block an
    index into them; ``offsets``: per block its offset in its segment) and
    ``maps``: ``[segment id, tag, size]`` for each segment whose writable
    handle this session had not been sent yet, sent on the handle channel
    tagged ``tag`` before the answer.  The client copies the bytes in and
    sends ``block_commit``; nothing is any key's until then."""

    op: ClassVar[str] = "block_place"
    keys: BlockKeys
    sizes: U64Array
    device_type: str = "CPU"
    device: int = 0


@dataclass(frozen=True)
class BlockCommit(Request):
    """The second half: the daemon hashes the lease's slots (xxh3-64) and,
    when all match ``checksums``, makes them the keys' blocks at once;
    otherwise VERIFY_FAILED and the slots go back.  ``abort``: hand them
    back without committing."""

    op: ClassVar[str] = "block_commit"
    lease: int
    checksums: U64Array
    metas: list[bytes] | None = None
    ttl: float | None = None
    abort: bool | None = None


@dataclass(frozen=True)
class BlockLocate(Request):
    """A same-host get in place: where the blocks lie (as ``block_place``
    answers), each pinned for this session under ``lease`` until
    ``block_unpin`` (or the session's end).  All or nothing as
    ``block_get``: NOT_FOUND naming the missing ones, nothing pinned."""

    op: ClassVar[str] = "block_locate"
    keys: BlockKeys
    sizes: U64Array


@dataclass(frozen=True)
class BlockUnpin(Request):
    """The end of a ``block_locate``'s lease: the client has copied."""

    op: ClassVar[str] = "block_unpin"
    lease: int
