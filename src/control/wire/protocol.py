"""The control channel's wire protocol, with no I/O (sans-I/O, like h11).

Messages travel in frames (``frames.py``: length-prefixed msgpack, whose
names this module re-exports for its users).  Requests are
``{"op": str, "id": int, **fields}``.  Each op is a small frozen
dataclass that validates its own fields (types, ranges, no unknown keys) in
``parse_request``; a bad request whose id could be read gets a
``BAD_REQUEST`` answer and the connection stays usable.  Every bound a
request's work depends on is checked here, before any work starts: strings
are printable and short (nothing a client sends can forge a log line), buffer
ids have the daemon's id alphabet, shapes have at most ``MAX_NDIM``
dimensions whose product stays below 2**63 (so no size computation ever sees
a huge integer), lists and packed arrays at most ``MAX_ITEMS`` entries.
Answers are
``{"id": int, "ok": true, "result": {...}}`` or
``{"id": int, "ok": false, "error": {code, message, details}}``; they may come
back in any order, so one connection carries many requests at once.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import (
    Annotated,
    Any,
    ClassVar,
    Literal,
    NewType,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

import numpy as np

from control.wire.errors import BadRequest, RpcBufError
from control.wire.frames import (
    DEFAULT_MAX_FRAME,
    HELLO_MAX_FRAME,
    FrameDecoder,
    FrameError,
    encode_frame,
)

# The protocol versions this code speaks, oldest to newest (see ``negotiate``).
# 3: hello carries ``versions`` both ways and the daemon's ``checksum_kinds``;
# the same-host path shares memory by handle (``handles``, ``bind_handles``,
# ``stage``, ``attach``/``detach``, the BUSY code); ``store_batch`` and
# ``dedup_store`` may give each tensor's source type and logical shape.
# Versions 1 and 2 (development builds, never released) are refused by both
# sides with ``version_mismatch``: there is no fallback to them.
PROTOCOL_MIN = 3
PROTOCOL_VERSION = 3
MAX_ITEMS = 100_000  # tensors in one batch, and in one buffer's manifest
MAX_INT = (1 << 63) - 1
MAX_STR = 1024
MAX_NDIM = 32  # dimensions of one tensor's shape (NumPy allows 64; no model needs 32)
MAX_ID = 64  # characters of a buffer id (the daemon makes 26)
MAX_SOURCE_TYPE = 32  # characters of a source type name ("Q4_K", "BF16", "F8_E4M3FNUZ")
MAX_PATH = 1024  # characters of a file path in a request (load_file), no NUL, printable
_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
_SOURCE_CHARS = _ID_CHARS - {"-"}
U64 = NewType("U64", int)  # checksums: the whole unsigned 64-bit range
U64Array = NewType("U64Array", bytes)  # packed little-endian uint64s (offsets, sizes, checksums)
# A small op's payload carried in its frame (``Store.data``, a ``Read``'s
# answer): at most INLINE_MAX bytes.
Inline = NewType("Inline", bytes)
INLINE_MAX = 64 << 10
INLINE_ROOM = 1 << 10  # a frame's bytes besides its payload, at most (the fields)


def inline_max(max_frame: int) -> int:
    """The most bytes a store or read may carry in its frame under a frame
    limit of ``max_frame`` (0: none)."""
    return max(0, min(INLINE_MAX, max_frame - INLINE_ROOM))
# Checked forms of plain types (to type checkers they are the plain type):
BufferId = Annotated[str, "buffer_id"]  # [A-Za-z0-9_-]{1,64}: what the daemon hands out
Shape = Annotated[list[int], "shape"]  # <= MAX_NDIM dims, product < 2**63
# A tensor's type in the file it came from: a GGML type ("Q8_0") or a
# safetensors dtype ("BF16"), [A-Za-z0-9_]{1,32}.
SourceType = Annotated[str, "source_type"]
# A relative or absolute file path: printable, at most MAX_PATH characters,
# no empty, "." or ".." component (the daemon confines it to its --model-dir).
FilePath = Annotated[str, "file_path"]
# The keys of one block request (``block_*``): 1 to MAX_BLOCK_KEYS printable
# strings of 1 to MAX_BLOCK_KEY characters each (a tenant's keys are its own:
# the daemon namespaces them per tenant).
BlockKeys = Annotated[list[str], "block_keys"]
MAX_BLOCK_KEYS = 4096  # keys in one block request (a batch of LMCache chunks is 256)
MAX_BLOCK_KEY = 512  # characters of one block key (LMCache's are about 100)


# -- requests -----------------------------------------------------------------


def _check(op: str, name: str, value: Any, tp: Any) -> Any:
    # The common scalar types first: identity tests, before typing's introspection.
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT:
            raise BadRequest(f"{op}: {name} must be an integer in [0, 2**63), got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str) or len(value) > MAX_STR or not value.isprintable():
            raise BadRequest(f"{op}: {name} must be a printable string of at most {MAX_STR} "
                             "characters")
        return value
    if tp == FilePath:
        if not isinstance(value, str) or not 0 < len(value) <= MAX_PATH \
                or not value.isprintable():
            raise BadRequest(f"{op}: {name} must be a printable path of at most {MAX_PATH} "
                             "characters")
        parts = value.split("/")
        if any(p in ("", ".", "..") for p in (parts[1:] if value.startswith("/") else parts)):
            raise BadRequest(f"{op}: {name} must not hold empty, '.' or '..' components "
                             "(name the file as it lies in a --model-dir)")
        return value
    if tp == BufferId:
        if not isinstance(value, str) or not 0 < len(value) <= MAX_ID \
                or not _ID_CHARS.issuperset(value):
            raise BadRequest(f"{op}: {name} is not a buffer id ([A-Za-z0-9_-], at most "
                             f"{MAX_ID} characters)")
        return value
    if tp == BlockKeys:
        if not block_keys_ok(value):
            raise BadRequest(f"{op}: {name} must be a list of 1 to {MAX_BLOCK_KEYS} printable "
                             f"strings of 1 to {MAX_BLOCK_KEY} characters")
        return value
    if tp == SourceType:
        if not source_type_ok(value):
            raise BadRequest(f"{op}: {name} is not a source type ([A-Za-z0-9_], 1 to "
                             f"{MAX_SOURCE_TYPE} characters)")
        return value
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check(op, name, value, inner[0])
    if origin is Literal:
        if value not in get_args(tp):
            raise BadRequest(f"{op}: {name} must be one of {list(get_args(tp))}, got {value!r}")
        return value
    if tp is Inline:
        if not isinstance(value, bytes) or len(value) > INLINE_MAX:
            raise BadRequest(f"{op}: {name} must be bytes, at most {INLINE_MAX}")
        return value
    if tp is U64Array:
        if not isinstance(value, bytes) or len(value) % 8 or len(value) > 8 * MAX_ITEMS:
            raise BadRequest(f"{op}: {name} must be packed uint64s, at most {MAX_ITEMS}")
        return value
    if origin is list:
        if not isinstance(value, list) or len(value) > MAX_ITEMS:
            raise BadRequest(f"{op}: {name} must be a list of at most {MAX_ITEMS} items")
        (inner_tp,) = get_args(tp)
        if inner_tp == Shape:  # shapes of big batches
            if not all(map(shape_ok, value)):
                raise BadRequest(f"{op}: {name} must hold shapes: at most {MAX_NDIM} integers "
                                 "in [0, 2**63) whose product is below 2**63")
            return value
        if inner_tp == _OPT_SHAPE:  # logical shapes: a shape or None each
            if not all(v is None or shape_ok(v) for v in value):
                raise BadRequest(f"{op}: {name} must hold shapes (at most {MAX_NDIM} "
                                 "integers in [0, 2**63) whose product is below 2**63) or "
                                 "nulls")
            return value
        if inner_tp == _OPT_SOURCE_TYPE:
            if not all(v is None or source_type_ok(v) for v in value):
                raise BadRequest(f"{op}: {name} must hold source types ([A-Za-z0-9_], 1 to "
                                 f"{MAX_SOURCE_TYPE} characters) or nulls")
            return value
        if inner_tp is str:  # fast path: names and dtypes of big batches, in C calls
            try:
                joined = "".join(value)  # TypeError unless every item is a str
            except TypeError:
                joined = None
            if joined is None or not joined.isprintable() or (
                    value and max(map(len, value)) > MAX_STR):
                raise BadRequest(f"{op}: {name} must hold printable strings of at most "
                                 f"{MAX_STR} characters")
            return value
        return [_check(op, f"{name}[{i}]", v, inner_tp) for i, v in enumerate(value)]
    if tp is U64:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
            raise BadRequest(f"{op}: {name} must be an integer in [0, 2**64), got {value!r}")
        return value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value < 0:
            raise BadRequest(f"{op}: {name} must be a finite number >= 0, got {value!r}")
        return float(value)
    if tp is bytes:
        if not isinstance(value, bytes) or len(value) > MAX_STR:
            raise BadRequest(f"{op}: {name} must be bytes, at most {MAX_STR}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise BadRequest(f"{op}: {name} must be a boolean, got {value!r}")
        return value
    raise TypeError(f"unsupported field type {tp!r}")  # a bug in this module, not input


def shape_ok(v: Any) -> bool:
    """A shape: a list of at most MAX_NDIM ints in [0, 2**63) whose product
    is below 2**63 (no tensor of 2**63 bytes or more can match an item)."""
    if type(v) is not list or len(v) > MAX_NDIM:
        return False
    n = 1
    for d in v:
        if type(d) is not int or not 0 <= d <= MAX_INT:
            return False
        n = min(n * d, MAX_INT + 1)  # capped: the numbers stay small whatever comes
    return n <= MAX_INT


def block_keys_ok(v: Any) -> bool:
    """Block keys: a list of 1 to MAX_BLOCK_KEYS printable strings of 1 to
    MAX_BLOCK_KEY characters (checked in C calls: a batch is thousands)."""
    if type(v) is not list or not 0 < len(v) <= MAX_BLOCK_KEYS:
        return False
    if not all(type(k) is str for k in v):
        return False
    return min(map(len, v)) > 0 and max(map(len, v)) <= MAX_BLOCK_KEY and \
        "".join(v).isprintable()


def source_type_ok(v: Any) -> bool:
    """A source type: 1 to MAX_SOURCE_TYPE characters of [A-Za-z0-9_]."""
    return type(v) is str and 0 < len(v) <= MAX_SOURCE_TYPE and _SOURCE_CHARS.issuperset(v)


_OPT_SHAPE = Shape | None
_OPT_SOURCE_TYPE = SourceType | None


@dataclass(frozen=True)
class Request:
    """Base of every request; subclasses set ``op`` and declare typed fields."""

    op: ClassVar[str] = ""

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> Request:
        names, specs, _, defaults = _specs(cls)
        if not names.issuperset(fields):
            raise BadRequest(f"{cls.op}: unknown field(s) {sorted(set(fields) - names)}")
        op = cls.op
        values = dict(defaults)
        for name, check, optional, required in specs:
            if name in fields:
                value = fields[name]
                values[name] = None if value is None and optional else check(op, name, value)
            elif required:
                raise BadRequest(f"{op}: missing field {name!r}")
        # As the dataclass's own __init__ would (every field set, nothing else
        # runs: no request defines __post_init__), without its per-field
        # object.__setattr__ calls.
        req = object.__new__(cls)
        req.__dict__.update(values)
        return req

    def to_wire(self, req_id: int) -> dict[str, Any]:
        msg: dict[str, Any] = {"op": self.op, "id": req_id}
        for name in _specs(type(self))[2]:  # in field order, as dataclasses.fields
            value = getattr(self, name)
            if value is not None:
                msg[name] = value
        return msg


_HINTS: dict[type, dict[str, Any]] = {}
# Per request class: its field names (a set), per field (name, its checker,
# whether None is allowed, whether it is required; a union checks its first
# non-None type, as _check does), the names in field order, and the
# defaults of the optional fields.
_Checker = Callable[[str, str, Any], Any]
_Specs = tuple[frozenset[str], tuple[tuple[str, _Checker, bool, bool], ...], tuple[str, ...],
               dict[str, Any]]
_SPECS: dict[type, _Specs] = {}


def _checker(tp: Any) -> _Checker:
    """``_check`` for one field type, chosen once: the request's hot path
    (store, read: ints and a buffer id) then makes no type comparisons."""
    if tp is int:
        def check_int(op: str, name: str, value: Any) -> Any:
            if type(value) is int and 0 <= value <= MAX_INT:
                return value
            return _check(op, name, value, int)  # raises, with the message
        return check_int
    if tp == BufferId:
        def check_id(op: str, name: str, value: Any) -> Any:
            if type(value) is str and 0 < len(value) <= MAX_ID and _ID_CHARS.issuperset(value):
                return value
            return _check(op, name, value, BufferId)
        return check_id
    return lambda op, name, value: _check(op, name, value, tp)


def _specs(cls: type) -> _Specs:
    specs = _SPECS.get(cls)
    if specs is None:
        hints = _hints(cls)
        out = []
        defaults: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            tp, optional = hints[f.name], False
            if get_origin(tp) in (Union, types.UnionType):
                args = get_args(tp)
                optional = type(None) in args
                tp = next(a for a in args if a is not type(None))
            required = f.default is dataclasses.MISSING
            if not required:
                defaults[f.name] = f.default
            out.append((f.name, _checker(tp), optional, required))
        specs = _SPECS[cls] = (frozenset(hints), tuple(out), tuple(o[0] for o in out), defaults)
    return specs


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = {
            k: v for k, v in get_type_hints(cls, include_extras=True).items()
            if get_origin(v) is not ClassVar
        }
    return _HINTS[cls]


@dataclass(frozen=True)
class Hello(Request):
    op: ClassVar[str] = "hello"
    token: str
    # ``versions`` below: [oldest, newest] the client speaks (see ``negotiate``).
    # ``version`` (a client before ``versions`` said only its one version)
    # and protocol 2's same-host ``probe`` are read only so that such a client
    # is refused by its version, in one sentence, not by an unknown field.
    version: int = PROTOCOL_VERSION
    probe: bytes | None = None
    probe_addr: int | None = None
    # The bind nonce of this client's TCP session that this Unix socket
    # session replaces (it takes over that session's --max-sessions slot).
    replaces: bytes | None = None
    versions: list[int] | None = None
    # Protocol 3: on the daemon's Unix socket, ask for the same-host path
    # (a handle channel and a staging area; see ``BindHandles``).
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
    # Same-host sessions: the payload is in the session's staging area, in
    # small slot ``stage`` or (``stage == 0xFFFF``) streamed through its ring;
    # nothing comes over UCX.  See dataplane/staging.py.
    stage: int | None = None
    # The payload itself, exactly ``nbytes`` (at most INLINE_MAX, the hello's
    # ``inline_max``): a small store of a network session rides in its frame,
    # one round trip with no UCX message.
    data: Inline | None = None


@dataclass(frozen=True)
class StoreBatch(Request):
    """Many ranges of one buffer in one round trip; see ``runs.plan_runs``.

    ``names``/``dtypes``/``shapes``, when given, are index-aligned with the
    items and recorded as the buffer's tensor manifest."""

    op: ClassVar[str] = "store_batch"
    buffer_id: BufferId
    offsets: U64Array
    sizes: U64Array
    checksums: U64Array | None = None
    verify: Literal["checksum"] | None = None
    names: list[str] | None = None
    dtypes: list[str] | None = None
    shapes: list[Shape] | None = None
    manifest_version: int | None = None  # refuse if the manifest changed since
    stage: int | None = None  # same-host sessions: as ``Store.stage``, the items' runs in order
    # The manifest packed, instead of dtypes/shapes (with names as above):
    # item i has dtype kind_dtypes[kinds[i]] and shape kind_shapes[kinds[i]]
    # (no kinds with a one-kind table: every item is of that kind).
    kinds: U64Array | None = None
    kind_dtypes: list[str] | None = None
    kind_shapes: list[Shape] | None = None
    # Which checksum ``checksums`` are (absent: xxh3; protocol 2 on).  The
    # manifest's checksums are xxh3-64 (dedup and the disk cache key on it).
    checksum_kind: Literal["xxh3"] | None = None
    # Protocol 3 on, each optional, null for a tensor without: the tensors'
    # source types and logical shapes (what a model file says they are, beside
    # the NumPy view dtypes/shapes), one per item with ``dtypes``/``shapes`` ...
    source_types: list[SourceType | None] | None = None
    logical_shapes: list[Shape | None] | None = None
    # ... or one per kind with ``kind_dtypes``/``kind_shapes``.
    kind_source_types: list[SourceType | None] | None = None
    kind_logical_shapes: list[Shape | None] | None = None


@dataclass(frozen=True)
class ReadBatch(Request):
    op: ClassVar[str] = "read_batch"
    buffer_id: BufferId
    offsets: U64Array
    sizes: U64Array
    stage: int | None = None  # same-host sessions: as ``Store.stage``
    # True: answer with the bytes (``data`` in the result), at most
    # INLINE_MAX of them; the network path's small reads.
    inline: bool | None = None


@dataclass(frozen=True)
class DedupStore(Request):
    """Place tensors by content instead of by bytes (see ``control/dedupops.py``).

    Items are index-aligned like a ``StoreBatch`` with a manifest, sorted by
    offset and disjoint; ``hashes`` holds two uint64 per item (xxh3-128, low
    word first), ``checksums`` each item's xxh3-64.  The daemon copies every
    item whose content this tenant already holds (or its disk cache does),
    verifies it, records it in the manifest and answers the indices it
    ``placed`` (packed uint64s); the client sends the others."""

    op: ClassVar[str] = "dedup_store"
    buffer_id: BufferId
    offsets: U64Array
    sizes: U64Array
    hashes: U64Array
    checksums: U64Array
    names: list[str]
    dtypes: list[str]
    shapes: list[Shape]
    # As in ``StoreBatch``'s list form (protocol 3 on).
    source_types: list[SourceType | None] | None = None
    logical_shapes: list[Shape | None] | None = None


@dataclass(frozen=True)
class LoadFile(Request):
    """Node-local load (see ``control/daemon/fileops.py``): read tensors of
    a file in one of the daemon's ``--model-dir`` directories straight into
    a buffer of this tenant's, verify each against the hashes the client
    expects, and only then record them in the manifest.

    ``path`` names the file: relative to a model directory (each is tried
    in turn), or absolute inside one.  ``file_size`` is the size the client
    expects (a copy of another size fails).  Items are index-aligned like a
    ``DedupStore``'s, sorted by buffer offset and disjoint: item ``i`` is the
    tensor ``names[i]``, whose bytes lie at ``file_offsets[i]`` in the file
    (exactly one tensor of the file's own header), ``sizes[i]`` bytes long,
    and go to ``offsets[i]`` of the buffer; ``hashes`` holds two uint64 per
    item (xxh3-128, low word first), ``checksums`` each item's xxh3-64.  The
    manifest comes in the list form (``dtypes``, ``shapes``) or packed
    (``kinds``, ``kind_dtypes``, ``kind_shapes``), as for ``StoreBatch``,
    and so, optionally, do the tensors' source types and logical shapes
    (``source_types``/``logical_shapes`` or ``kind_source_types``/
    ``kind_logical_shapes``: what the model file says they are)."""

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
    dtypes: list[str] | None = None
    shapes: list[Shape] | None = None
    kinds: U64Array | None = None
    kind_dtypes: list[str] | None = None
    kind_shapes: list[Shape] | None = None
    source_types: list[SourceType | None] | None = None
    logical_shapes: list[Shape | None] | None = None
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
    stage: int | None = None  # same-host sessions: as ``Store.stage``
    # True: answer with the bytes (``data`` in the result), at most
    # INLINE_MAX of them; the network path's small reads.
    inline: bool | None = None


@dataclass(frozen=True)
class BindHandles(Request):
    """The first and only frame of a session's handle channel: a second
    connection to the daemon's Unix socket, from the same process, naming
    the session by its bind nonce.  The daemon answers nothing on it in
    msgpack: from then on it carries only fd records (``dataplane/shm``),
    the staging area's first."""

    op: ClassVar[str] = "bind_handles"
    nonce: bytes


@dataclass(frozen=True)
class Attach(Request):
    """A read-only handle of a host buffer, sent on the handle channel
    (protocol 3): stores, clears and copies into the buffer are BUSY, and
    its release is deferred, until the session detaches (or ends)."""

    op: ClassVar[str] = "attach"
    buffer_id: BufferId


@dataclass(frozen=True)
class Detach(Request):
    op: ClassVar[str] = "detach"
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
class BlockPut(Request):
    """Keyed blocks, written two-phase (``daemon/blockops.py``): each key gets
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
    stage: int | None = None


@dataclass(frozen=True)
class BlockGet(Request):
    """The bytes of blocks, each ``sizes[i]`` long as the reader expects
    (one UCX message per block, or the staging slot ``stage`` back to back).
    All or nothing: a key that is missing (or of another size) is NOT_FOUND
    naming them (``details.missing``, ``details.sizes``), and nothing moves."""

    op: ClassVar[str] = "block_get"
    keys: BlockKeys
    sizes: U64Array
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
        Hello, RequestBuffer, GetBufferMeta, Store, Read, Release, Renew,
        ListDevices, ListBuffers, Stats, Ping, StoreBatch, ReadBatch, OpenBuffer,
        ClearBuffer, CopyBuffer, CloneBuffer, DedupStore, BindHandles, Attach, Detach,
        LoadFile, BlockPut, BlockGet, BlockLookup, BlockRemove, BlockList, BlockAttach,
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
        raise RequestError(req_id, BadRequest(f"unknown op {op!r}", {"ops": sorted(OPS)}))
    fields = {k: v for k, v in msg.items() if k not in ("op", "id")}
    try:
        return req_id, cls.from_fields(fields)
    except BadRequest as exc:
        raise RequestError(req_id, exc) from None


def speaks(lo: int, hi: int) -> str:
    """A version range as a sentence says it: "2", or "1..3"."""
    return str(lo) if lo == hi else f"{lo}..{hi}"


def version_mismatch(node: tuple[int, int], client: tuple[int, int]) -> BadRequest:
    """The refusal both sides give when their versions do not meet."""
    return BadRequest(f"the node speaks protocol {speaks(*node)}, this client speaks "
                      f"{speaks(*client)}: upgrade the older side",
                      {"reason": "protocol_version", "node": list(node),
                       "client": list(client)})


def hello_versions(req: Hello) -> tuple[int, int]:
    """The [oldest, newest] versions a hello says its client speaks: its
    ``versions``, or (a client from before the field, refused by
    ``negotiate``) just its ``version``.  Raises BAD_REQUEST for a malformed
    range."""
    if req.versions is None:
        return req.version, req.version
    if len(req.versions) != 2 or not 0 < req.versions[0] <= req.versions[1]:
        raise BadRequest(f"hello: versions must be [oldest, newest], got {req.versions}")
    return req.versions[0], req.versions[1]


def negotiate(client: tuple[int, int],
              node: tuple[int, int] = (PROTOCOL_MIN, PROTOCOL_VERSION)) -> int:
    """The newest version both ranges hold (sans-I/O: the daemon calls it on
    a hello, the client checks the answer against its own range).  Raises
    BAD_REQUEST (``reason: protocol_version``) naming both ranges."""
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
    "hello_versions", "negotiate", "ok_response", "pack_u64", "parse_request",
    "source_type_ok", "speaks", "unpack_u64", "version_mismatch",
    *[c.__name__ for c in OPS.values()],
]
