"""The requests of the keyed block tier (``docs/kvcache.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rpcbuf.control.wire.fields import BlockKeys, Inline, PathName, Request, U64Array


@dataclass(frozen=True)
class BlockPut(Request):
    """Keyed blocks, written two-phase: each key gets a new block of
    ``sizes[i]`` bytes, sent as a batch's items (tag ``run_tag(id, i)``, or staging
    slot ``stage`` back to back); once all landed and match ``checksums`` (xxh3-64)
    they replace the keys' blocks at once, unseen before.  ``metas``: an opaque blob
    per block (at most MAX_STR bytes); ``ttl``: seconds (None: until evicted)."""

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
    """Blocks' bytes, each ``sizes[i]`` long.  All or nothing: a missing or
    resized key is NOT_FOUND (``details.missing``, ``details.sizes``)."""

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
    """A read-only handle of one block on the handle channel; it stays pinned
    until the last detach of the answer's buffer id."""

    op: ClassVar[str] = "block_attach"
    key: str


@dataclass(frozen=True)
class BlockList(Request):
    """At most ``limit`` keys after ``start_after`` starting with ``prefix``;
    ``more`` says whether others follow."""

    op: ClassVar[str] = "block_list"
    prefix: str | None = None
    start_after: str | None = None
    limit: int = 1000


# -- same host, in place (docs/kvcache.md "Same host, in place") ------------------------


@dataclass(frozen=True)
class BlockPlace(Request):
    """A same-host put's first half: pending slots for ``sizes``, held under the
    answer's ``lease``.  Answers ``segments`` (ids), per block ``which`` (an index
    into them) and ``offsets``, and ``maps`` ``[segment id, tag, size]`` for each
    segment handle sent (tagged) on the handle channel first."""

    op: ClassVar[str] = "block_place"
    keys: BlockKeys
    sizes: U64Array
    device_type: str = "CPU"
    device: int = 0


@dataclass(frozen=True)
class BlockCommit(Request):
    """The second half: all slots match ``checksums`` and become the keys'
    blocks at once, or VERIFY_FAILED and they go back.  ``abort``: just give them back."""

    op: ClassVar[str] = "block_commit"
    lease: int
    checksums: U64Array
    metas: list[bytes] | None = None
    ttl: float | None = None
    abort: bool | None = None


@dataclass(frozen=True)
class BlockLocate(Request):
    """A same-host get in place: where the blocks lie, pinned under ``lease``
    until ``block_unpin``.  All or nothing as ``block_get``."""

    op: ClassVar[str] = "block_locate"
    keys: BlockKeys
    sizes: U64Array


@dataclass(frozen=True)
class BlockUnpin(Request):
    """The end of a ``block_locate``'s lease: the client has copied."""

    op: ClassVar[str] = "block_unpin"
    lease: int
