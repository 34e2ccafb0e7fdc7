"""The checked field types of requests and the ``Request`` base that checks them.
Every bound a request's work depends on is a field type's check; each field's
checker is chosen once per class (``_specs``), so the hot path compares no types.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import (
    Annotated,
    Any,
    ClassVar,
    Literal,
    NewType,
    Self,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

from rpcbuf.control.wire.errors import BadRequest

# How a refused value is quoted in an error: a few items, a short string, two
# levels, so quoting costs nothing whatever the value (a 4.5 MB message had
# quoted a nested list whole; a 1,000-deep one raised RecursionError).
_SHOWN = reprlib.Repr()  # keyword arguments only from Python 3.12
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 2, 60, 60, 40
_SHOWN.maxlist = _SHOWN.maxdict = _SHOWN.maxtuple = _SHOWN.maxset = 4


def shown(value: object) -> str:
    """``value``'s repr, bounded (see ``_SHOWN``)."""
    return _SHOWN.repr(value)


MAX_ITEMS = 100_000  # tensors in one batch, and in one buffer's manifest
MAX_INT = (1 << 63) - 1
MAX_STR = 1024
MAX_NDIM = 32  # dimensions of one tensor's shape (NumPy allows 64; no model needs 32)
MAX_ID = 64  # characters of a buffer id (the daemon makes 26)
MAX_SOURCE_TYPE = 32  # characters of a source type name ("Q4_K", "BF16", "F8_E4M3FNUZ")
MAX_PATH = 1024  # characters of a file path in a request (load_file), no NUL, printable
# A token's claims in a challenge (header.payload, base64url): what
# ``auth.create_token`` mints at most (MINT_MAX), under the 4 KiB hello frame.
Claims = NewType("Claims", str)
MAX_CLAIMS = 3072
_CLAIM_CHARS = frozenset(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.")
_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
_SOURCE_CHARS = _ID_CHARS - {"-"}
U64 = NewType("U64", int)  # checksums: the whole unsigned 64-bit range
U64Array = NewType("U64Array", bytes)  # packed little-endian uint64s (offsets, sizes, checksums)
# A small op's payload carried in its frame (``Store.data``, a ``Read``'s
# answer): at most INLINE_MAX bytes.
Inline = NewType("Inline", bytes)
INLINE_MAX = 64 << 10
# The data path a data op's bytes take, as the client chose it (the daemon
# reads it, never infers it): the session's UCX endpoint, the same-host
# staging area (slot ``stage``), or the frames themselves (a store's
# ``data``, a read's answer).  Absent: UCX.
PathName = Literal["ucx", "staged", "inline"]
INLINE_ROOM = 1 << 10  # a frame's bytes besides its payload, at most (the fields)


def inline_max(max_frame: int) -> int:
    """Most bytes a store or read carries in its frame under ``max_frame``."""
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
            raise BadRequest(f"{op}: {name} must be an integer in [0, 2**63), got {shown(value)}")
        return value
    if tp is str:
        if not isinstance(value, str) or len(value) > MAX_STR or not value.isprintable():
            raise BadRequest(f"{op}: {name} must be a printable string of at most {MAX_STR} "
                             "characters")
        return value
    if tp == Claims:
        if not isinstance(value, str) or not 0 < len(value) <= MAX_CLAIMS \
                or not _CLAIM_CHARS.issuperset(value):
            raise BadRequest(f"{op}: {name} must be a token's header.payload (base64url, "
                             f"at most {MAX_CLAIMS} characters)")
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
            raise BadRequest(
                f"{op}: {name} must be one of {list(get_args(tp))}, got {shown(value)}")
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
            raise BadRequest(f"{op}: {name} must be an integer in [0, 2**64), got {shown(value)}")
        return value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value < 0:
            raise BadRequest(f"{op}: {name} must be a finite number >= 0, got {shown(value)}")
        return float(value)
    if tp is bytes:
        if not isinstance(value, bytes) or len(value) > MAX_STR:
            raise BadRequest(f"{op}: {name} must be bytes, at most {MAX_STR}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise BadRequest(f"{op}: {name} must be a boolean, got {shown(value)}")
        return value
    raise TypeError(f"unsupported field type {tp!r}")  # a bug in this module, not input


def shape_ok(v: Any) -> bool:
    """At most MAX_NDIM ints in [0, 2**63) whose product is below 2**63."""
    if type(v) is not list or len(v) > MAX_NDIM:
        return False
    n = 1
    for d in v:
        if type(d) is not int or not 0 <= d <= MAX_INT:
            return False
        n = min(n * d, MAX_INT + 1)  # capped: the numbers stay small whatever comes
    return n <= MAX_INT


def block_keys_ok(v: Any) -> bool:
    """1 to MAX_BLOCK_KEYS printable strings of 1 to MAX_BLOCK_KEY characters
    (checked in C calls: a batch is thousands)."""
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

    def replace(self, **changes: Any) -> Self:
        """As ``dataclasses.replace``, unchecked, at a tenth of its cost."""
        req = object.__new__(type(self))
        req.__dict__.update(self.__dict__, **changes)
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
