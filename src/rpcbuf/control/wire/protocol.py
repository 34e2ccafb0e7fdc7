"""The control channel's messages, with no I/O (sans-I/O, like h11).

Requests are ``{"op": str, "id": int, **fields}``, one frozen dataclass per op
that validates its own fields (types, ranges, no unknown keys) in
``parse_request``; a bad request whose id could be read gets ``BAD_REQUEST`` and
the connection stays usable.  Every bound a request's work depends on is checked
here, before any work: strings printable and short (no forged log lines), buffer
ids in the daemon's alphabet, shapes of at most ``MAX_NDIM`` dims whose product
stays below 2**63, lists and packed arrays at most ``MAX_ITEMS``.  Answers are
``{"id", "ok": true, "result"}`` or ``{"id", "ok": false, "error": {code,
message, details}}``, in any order: one connection carries many requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import (
    Any,
    ClassVar,
    Literal,
)

import numpy as np

from rpcbuf.control.wire.blockproto import (
    BlockAttach as BlockAttach,
    BlockCommit as BlockCommit,
    BlockGet as BlockGet,
    BlockList as BlockList,
    BlockLocate as BlockLocate,
    BlockLookup as BlockLookup,
    BlockPlace as BlockPlace,
    BlockPut as BlockPut,
    BlockRemove as BlockRemove,
    BlockUnpin as BlockUnpin,
)
from rpcbuf.control.wire.errors import BadRequest, RpcBufError
from rpcbuf.control.wire.fields import (
    INLINE_MAX as INLINE_MAX,
    INLINE_ROOM as INLINE_ROOM,
    MAX_BLOCK_KEY as MAX_BLOCK_KEY,
    MAX_BLOCK_KEYS as MAX_BLOCK_KEYS,
    MAX_ID as MAX_ID,
    MAX_INT as MAX_INT,
    MAX_ITEMS as MAX_ITEMS,
    MAX_NDIM as MAX_NDIM,
    MAX_PATH as MAX_PATH,
    MAX_SOURCE_TYPE as MAX_SOURCE_TYPE,
    MAX_STR as MAX_STR,
    U64,
    BufferId,
    Claims,
    FilePath,
    Inline,
    PathName as PathName,
    Request,
    Shape,
    SourceType,
    U64Array,
    block_keys_ok as block_keys_ok,
    inline_max as inline_max,
    shape_ok as shape_ok,
    shown,
    source_type_ok as source_type_ok,
)
from rpcbuf.control.wire.frames import (
    DEFAULT_MAX_FRAME,
    HELLO_MAX_FRAME,
    FrameDecoder,
    FrameError,
    encode_frame,
)

# The protocol versions this code speaks, oldest to newest (see ``negotiate``).
# 1 to 3 were never released: their hellos are refused, with no fallback.
PROTOCOL_MIN = 4
PROTOCOL_VERSION = 4
@dataclass(frozen=True)
class Challenge(Request):
    """A session's first frame: the token's claims (``header.payload``) and a
    client nonce; answered with the chosen version, the daemon's nonce and proof."""

    op: ClassVar[str] = "challenge"
    claims: Claims
    nonce: bytes
    versions: list[int]


@dataclass(frozen=True)
class Hello(Request):
    op: ClassVar[str] = "hello"
    # The client's proof over the challenge's transcript (absent: refused,
    # ``no_proof``).
    proof: bytes | None = None
    # The bind nonce of this client's TCP session that this Unix socket
    # session replaces (it takes over that session's --max-sessions slot).
    replaces: bytes | None = None
    # On the daemon's Unix socket, ask for the same-host path (a handle
    # channel and a staging area; see ``BindHandles``).
    handles: bool | None = None


@dataclass(frozen=True)
class RequestBuffer(Request):
    op: ClassVar[str] = "request_buffer"
    size: int
    device_type: str = "CPU"
    device: int = 0
    timeout: float | None = None
    ttl: float | None = None
    name: str | None = None


@dataclass(frozen=True)
class GetBufferMeta(Request):
    op: ClassVar[str] = "get_buffer_meta"
    buffer_id: BufferId
    tensors: bool = True  # False: leave the manifest's entries out (version, count, end only)


@dataclass(frozen=True)
class Store(Request):
    op: ClassVar[str] = "store"
    buffer_id: BufferId
    offset: int
    nbytes: int
    checksum: U64 | None = None
    verify: Literal["checksum"] | None = None
    # Which checksum ``checksum`` is (absent: xxh3); see docs/gpu.md.
    checksum_kind: Literal["xxh3", "devsum"] | None = None
    # "float16": the payload is nbytes/2 bytes of float16 that the daemon
    # widens into the float32 range [offset, offset + nbytes).
    wire_dtype: Literal["float16"] | None = None
    path: PathName = "ucx"
    # Path "staged" (same-host sessions): the payload is in the session's
    # staging area, in small slot ``stage`` or (``stage == 0xFFFF``) streamed
    # through its ring; nothing comes over UCX.  See dataplane/staging.py.
    stage: int | None = None
    # Path "inline": the payload itself, exactly ``nbytes`` (at most
    # INLINE_MAX, the hello's ``inline_max``): a small store of a network
    # session rides in its frame, one round trip with no UCX message.
    data: Inline | None = None


@dataclass(frozen=True)
class StoreBatch(Request):
    """Many ranges of one buffer in one round trip.  ``names``, when given, are
    index-aligned with the items and recorded as the buffer's manifest: item i has
    ``kind_dtypes[kinds[i]]`` and ``kind_shapes[kinds[i]]`` (no ``kinds``: one kind),
    and its kind's source type and logical shape where given."""

    op: ClassVar[str] = "store_batch"
    buffer_id: BufferId
    offsets: U64Array
    sizes: U64Array
    # xxh3-64, whatever the buffer's device: they are the manifest's
    # checksums (dedup and the disk cache key on them).
    checksums: U64Array | None = None
    verify: Literal["checksum"] | None = None
    names: list[str] | None = None
    manifest_version: int | None = None  # refuse if the manifest changed since
    path: Literal["ucx", "staged"] = "ucx"
    stage: int | None = None  # path "staged": as ``Store.stage``, the items' runs in order
    kinds: U64Array | None = None
    kind_dtypes: list[str] | None = None
    kind_shapes: list[Shape] | None = None
    kind_source_types: list[SourceType | None] | None = None
    kind_logical_shapes: list[Shape | None] | None = None


@dataclass(frozen=True)
class ReadBatch(Request):
    op: ClassVar[str] = "read_batch"
    buffer_id: BufferId
    offsets: U64Array
    sizes: U64Array
    # "inline": the answer carries the bytes (``data``), at most INLINE_MAX
    # of them; the network path's small reads.
    path: PathName = "ucx"
    stage: int | None = None  # path "staged": as ``Store.stage``


@dataclass(frozen=True)
class DedupStore(Request):
    """Place tensors by content.  Items as a ``StoreBatch`` with a manifest,
    sorted by offset and disjoint; ``hashes``: two uint64 per item (xxh3-128, low
    word first), ``checksums``: xxh3-64.  Answers the indices it ``placed`` (packed
    uint64s) from content this tenant holds; the client sends the others."""

    op: ClassVar[str] = "dedup_store"
    buffer_id: BufferId
    offsets: U64Array
    sizes: U64Array
    hashes: U64Array
    checksums: U64Array
    names: list[str]
    kind_dtypes: list[str]
    kind_shapes: list[Shape]
    # As in ``StoreBatch``.
    kinds: U64Array | None = None
    kind_source_types: list[SourceType | None] | None = None
    kind_logical_shapes: list[Shape | None] | None = None


@dataclass(frozen=True)
class LoadFile(Request):
    """Node-local load: read tensors of a file under a ``--model-dir`` into a
    buffer, verify each against ``hashes``/``checksums`` (as ``DedupStore``), then
    record them.  ``path``: relative to a model directory or absolute inside one;
    ``file_size``: what the client expects.  Item i is tensor ``names[i]``,
    ``sizes[i]`` bytes at ``file_offsets[i]`` (one whole tensor of the file's
    header), to ``offsets[i]`` (sorted, disjoint); manifest packed as ``StoreBatch``."""

    op: ClassVar[str] = "load_file"
    buffer_id: BufferId
    path: FilePath
    file_size: int
    file_offsets: U64Array
    offsets: U64Array
    sizes: U64Array
    hashes: U64Array
    checksums: U64Array
    names: list[str]
    kind_dtypes: list[str]
    kind_shapes: list[Shape]
    kinds: U64Array | None = None
    kind_source_types: list[SourceType | None] | None = None
    kind_logical_shapes: list[Shape | None] | None = None


@dataclass(frozen=True)
class OpenBuffer(Request):
    op: ClassVar[str] = "open_buffer"
    name: str


@dataclass(frozen=True)
class ClearBuffer(Request):
    op: ClassVar[str] = "clear_buffer"
    buffer_id: BufferId
    value: int = 0
    offset: int = 0
    nbytes: int | None = None


@dataclass(frozen=True)
class CopyBuffer(Request):
    op: ClassVar[str] = "copy_buffer"
    src_id: BufferId
    src_offset: int
    dst_id: BufferId
    dst_offset: int
    nbytes: int


@dataclass(frozen=True)
class CloneBuffer(Request):
    """A new buffer with ``src_id``'s size, bytes and manifest, sharing its
    memory until either is written (host buffers)."""

    op: ClassVar[str] = "clone_buffer"
    src_id: BufferId
    name: str | None = None
    ttl: float | None = None


@dataclass(frozen=True)
class Read(Request):
    op: ClassVar[str] = "read"
    buffer_id: BufferId
    offset: int
    nbytes: int
    # "inline": the answer carries the bytes (``data``), at most INLINE_MAX
    # of them; the network path's small reads.
    path: PathName = "ucx"
    stage: int | None = None  # path "staged": as ``Store.stage``


@dataclass(frozen=True)
class BindHandles(Request):
    """The only frame of a session's handle channel (a second Unix-socket
    connection from the same process, naming the session by its bind nonce); it
    then carries only fd records, the staging area's first."""

    op: ClassVar[str] = "bind_handles"
    nonce: bytes


@dataclass(frozen=True)
class Attach(Request):
    """A read-only handle of a host buffer on the handle channel: stores,
    clears and copies into it are BUSY, and its release deferred, until detach."""

    op: ClassVar[str] = "attach"
    buffer_id: BufferId


@dataclass(frozen=True)
class Detach(Request):
    op: ClassVar[str] = "detach"
    buffer_id: BufferId


@dataclass(frozen=True)
class MapBuffer(Request):
    """Write a host buffer in place (same host): a write-grant slot and, unless
    ``have``, a writable handle on the handle channel.  ``explicit`` (``ctx.map``):
    other sessions' ops on it are BUSY until ``unmap_buffer``."""

    op: ClassVar[str] = "map_buffer"
    buffer_id: BufferId
    explicit: bool = False
    # The inode of the memfd the client maps of this buffer already (0:
    # none): the daemon sends the buffer's handle unless it is that one.
    have: int = 0


@dataclass(frozen=True)
class UnmapBuffer(Request):
    op: ClassVar[str] = "unmap_buffer"
    buffer_id: BufferId


@dataclass(frozen=True)
class Release(Request):
    op: ClassVar[str] = "release"
    buffer_id: BufferId


@dataclass(frozen=True)
class Renew(Request):
    op: ClassVar[str] = "renew"
    buffer_id: BufferId
    ttl: float | None = None


@dataclass(frozen=True)
class ListDevices(Request):
    op: ClassVar[str] = "list_devices"


@dataclass(frozen=True)
class ListBuffers(Request):
    op: ClassVar[str] = "list_buffers"


@dataclass(frozen=True)
class Stats(Request):
    op: ClassVar[str] = "stats"


@dataclass(frozen=True)
class Ping(Request):
    op: ClassVar[str] = "ping"


OPS: dict[str, type[Request]] = {
    cls.op: cls
    for cls in (
        Challenge, Hello, RequestBuffer, GetBufferMeta, Store, Read, Release, Renew,
        ListDevices, ListBuffers, Stats, Ping, StoreBatch, ReadBatch, OpenBuffer,
        ClearBuffer, CopyBuffer, CloneBuffer, DedupStore, BindHandles, Attach, Detach,
        LoadFile, BlockPut, BlockGet, BlockLookup, BlockRemove, BlockList, BlockAttach,
        BlockPlace, BlockCommit, BlockLocate, BlockUnpin, MapBuffer, UnmapBuffer,
    )
}


def pack_u64(values: Any) -> U64Array:
    return U64Array(np.asarray(values, dtype="<u8").tobytes())


def unpack_u64(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<u8")


class RequestError(Exception):
    """A request that could not be parsed; ``req_id`` is None when unknown."""

    def __init__(self, req_id: int | None, error: RpcBufError) -> None:
        super().__init__(str(error))
        self.req_id = req_id
        self.error = error


def parse_request(msg: dict[str, Any]) -> tuple[int, Request]:
    """Validate one decoded frame as a request; raise ``RequestError``."""
    req_id = msg.get("id")
    if not isinstance(req_id, int) or isinstance(req_id, bool) or not 0 <= req_id <= MAX_INT:
        raise RequestError(None, BadRequest("request has no valid 'id'"))
    op = msg.get("op")
    cls = OPS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise RequestError(req_id, BadRequest(f"unknown op {shown(op)}", {"ops": sorted(OPS)}))
    fields = {k: v for k, v in msg.items() if k not in ("op", "id")}
    try:
        return req_id, cls.from_fields(fields)
    except BadRequest as exc:
        raise RequestError(req_id, exc) from None
    except (RecursionError, ValueError, OverflowError) as exc:  # a value no check foresaw
        raise RequestError(req_id, BadRequest(
            f"{op}: malformed request ({type(exc).__name__})")) from None


# The requests whose bytes take a data path (their ``path`` says which).
DataRequest = Store | StoreBatch | Read | ReadBatch | BlockPut | BlockGet


def sends_over_ucx(req: Request) -> bool:
    """Whether the client sends ``req``'s bytes as UCX messages beside it: the
    daemon's janitor spares unexpected messages until its receives are posted."""
    return isinstance(req, (Store, StoreBatch, BlockPut)) and req.path == "ucx"


def speaks(lo: int, hi: int) -> str:
    """A version range as a sentence says it: "2", or "1..3"."""
    return str(lo) if lo == hi else f"{lo}..{hi}"


def version_mismatch(node: tuple[int, int], client: tuple[int, int]) -> BadRequest:
    """The refusal both sides give when their versions do not meet."""
    return BadRequest(f"the node speaks protocol {speaks(*node)}, this client speaks "
                      f"{speaks(*client)}: upgrade the older side",
                      {"reason": "protocol_version", "node": list(node),
                       "client": list(client)})


def challenge_versions(req: Challenge) -> tuple[int, int]:
    """The [oldest, newest] versions a challenge says its client speaks.
    Raises BAD_REQUEST for a malformed range."""
    if len(req.versions) != 2 or not 0 < req.versions[0] <= req.versions[1]:
        raise BadRequest(f"challenge: versions must be [oldest, newest], got "
                         f"{shown(req.versions)}")
    return req.versions[0], req.versions[1]


def negotiate(client: tuple[int, int],
              node: tuple[int, int] = (PROTOCOL_MIN, PROTOCOL_VERSION)) -> int:
    """The newest version both ranges hold.  Raises BAD_REQUEST
    (``reason: protocol_version``) naming both ranges."""
    best = min(client[1], node[1])
    if best < max(client[0], node[0]):
        raise version_mismatch(node, client)
    return best


def ok_response(req_id: int, result: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": req_id, "ok": True, "result": result or {}}


def error_response(req_id: int | None, error: RpcBufError) -> dict[str, Any]:
    return {"id": req_id, "ok": False, "error": error.to_wire()}


__all__ = [
    "DEFAULT_MAX_FRAME", "HELLO_MAX_FRAME", "OPS", "PROTOCOL_MIN", "PROTOCOL_VERSION",
    "FrameDecoder",
    "FrameError", "Request", "RequestError", "encode_frame", "error_response",
    "challenge_versions", "negotiate", "ok_response", "pack_u64", "parse_request",
    "sends_over_ucx", "source_type_ok", "speaks", "unpack_u64", "version_mismatch",
    *[c.__name__ for c in OPS.values()],
]
