"""A loaded model as one node holds it (``model_info``): its slot buffers, every
tensor by name with where it lies and what it is, the file's metadata (read,
checksum-compared, decoded within bounds), and whether this node's share is
complete by its load records.

The daemon's answers are checked before anything is built on them
(``parse_tensors``, sans-I/O): offsets and sizes within the buffer, a non-object
NumPy dtype, shape bytes equal to the size, source type and logical shape as the
wire bounds them.  A malformed answer is BAD_REQUEST (``reason: bad_answer``)
naming the field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rpcbuf.control.client.answers import bad_answer, parse_meta
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, NotFound, VerifyFailed
from rpcbuf.control.wire.manifest import np_dtype
from rpcbuf.dataplane.checksum import checksum
from rpcbuf.models import metadata as MD, record as LR

if TYPE_CHECKING:
    from rpcbuf.control.client.context import RpcContext

_ANSWER = "buffer meta"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    slot: int
    buffer_id: str
    offset: int
    nbytes: int
    dtype: str  # the NumPy view's dtype (``np.dtype(dtype)``), e.g. "|u1" for Q8_0 rows
    shape: tuple[int, ...]  # the NumPy view's shape, e.g. (512, 272)
    checksum: int | None  # xxh3-64 of its bytes, as the daemon computed it
    source_type: str | None  # what the file says: "Q8_0", "BF16", ... (None: not recorded)
    logical_shape: tuple[int, ...] | None  # its elements, e.g. (512, 256) (None: not recorded)

    @property
    def entry(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape),
                               "offset": self.offset, "nbytes": self.nbytes,
                               "checksum": self.checksum}
        if self.source_type is not None:
            out["source_type"] = self.source_type
        if self.logical_shape is not None:
            out["logical_shape"] = list(self.logical_shape)
        return out


@dataclass(frozen=True, slots=True)
class SlotBuffer:
    slot: int
    buffer_id: str
    name: str
    size: int
    device_type: str
    device: int


@dataclass(frozen=True)
class ModelInfo:
    """What one node holds of a loaded model (``model_info``)."""

    name: str
    node_id: str
    slots: list[SlotBuffer]  # by slot number
    tensors: dict[str, TensorInfo]  # slot by slot, in offset order
    # The file's metadata: GGUF key/values as plain Python, or safetensors
    # ``__metadata__`` strings ({} when the load stored none: an older rpcbuf).
    metadata: dict[str, Any] = field(default_factory=dict)
    format: str | None = None  # "gguf" or "safetensors"; None when no metadata was stored
    # What keeps this node's share from being complete (``record.problems``):
    # a load interrupted or still running, a tensor missing or changed.
    problems: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Every slot here was committed by one load and holds what it verified."""
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "node_id": self.node_id, "format": self.format,
                "slots": [{"slot": s.slot, "buffer_id": s.buffer_id, "name": s.name,
                           "size": s.size, "device_type": s.device_type,
                           "device": s.device} for s in self.slots],
                "complete": self.complete, "problems": self.problems,
                "tensors": {n: {"slot": t.slot, "buffer_id": t.buffer_id, **t.entry}
                            for n, t in self.tensors.items()},
                "metadata": self.metadata}


def slot_of(model: str, buffer_name: Any) -> int | None:
    if not isinstance(buffer_name, str):
        return None
    m = re.fullmatch(re.escape(model) + r"/slot(\d{1,9})", buffer_name)
    return int(m.group(1)) if m else None


async def model_info(ctx: RpcContext, name: str) -> ModelInfo:
    """Raises NOT_FOUND when the node holds none of ``name``, BAD_REQUEST
    (``reason: bad_answer``) for a malformed answer or metadata and a tensor in two
    slots, VERIFY_FAILED when the metadata does not match its checksum."""
    found: list[tuple[int, dict[str, Any]]] = []
    for b in await ctx.list_buffers():
        slot = slot_of(name, b.get("name")) if isinstance(b, dict) else None
        if slot is not None:
            found.append((slot, b))
    if not found:
        raise NotFound(f"this node holds no model named {name!r}", {"name": name})
    slots: list[SlotBuffer] = []
    tensors: dict[str, TensorInfo] = {}
    meta_at: tuple[str, dict[str, Any]] | None = None
    manifests: dict[int, tuple[str, dict[str, Any]]] = {}
    for slot, meta in sorted(found, key=lambda f: f[0]):
        if not isinstance(meta.get("tensors"), dict):  # a listing without manifests
            meta = await ctx.get_buffer_meta(str(meta.get("buffer_id")))
        parsed = parse_meta(meta, _ANSWER)
        slots.append(SlotBuffer(slot, parsed.buffer_id, str(meta.get("name")), parsed.size,
                                parsed.device_type, parsed.device))
        entries = parse_tensors(meta.get("tensors"), slot, parsed.buffer_id, parsed.size)
        manifests[slot] = (parsed.buffer_id, {t.name: t.entry for t in entries})
        for t in entries:
            if t.name == LR.LOAD_TENSOR:
                continue
            if t.name == MD.META_TENSOR:
                if meta_at is None:
                    meta_at = (parsed.buffer_id, t.entry)
                continue
            if t.name in tensors:
                raise BadRequest(f"model {name!r}: tensor {t.name[:80]!r} is in slots "
                                 f"{tensors[t.name].slot} and {slot} of this node (a load "
                                 "still running?)", {"reason": "inconsistent"})
            tensors[t.name] = t
    fmt: str | None = None
    metadata: dict[str, Any] = {}
    if meta_at is not None:
        fmt, metadata = await _read_metadata(ctx, *meta_at)
    records = await LR.records(ctx, manifests)
    problems = LR.problems({k: (records[k], m) for k, (_, m) in manifests.items()},
                           every_node=False)
    return ModelInfo(name, ctx.node_id, slots, tensors, metadata, fmt, problems)


async def _read_metadata(ctx: RpcContext, buffer_id: str, entry: Mapping[str, Any]
                         ) -> tuple[str, dict[str, Any]]:
    if entry["dtype"] != "|u1" or len(entry["shape"]) != 1:
        raise bad_answer("model metadata", "metadata", "is not a flat uint8 tensor")
    if entry["nbytes"] > MD.MAX_BLOB:  # before a byte is read
        raise bad_answer("model metadata", "metadata", f"is {entry['nbytes']} bytes (at most "
                                                       f"{MD.MAX_BLOB})")
    blob = await ctx.read_buffer(buffer_id, entry["offset"], entry["nbytes"])
    if entry["checksum"] is not None and checksum(blob) != entry["checksum"]:
        raise VerifyFailed("the model's metadata does not match its manifest checksum",
                           {"tensors": [MD.META_TENSOR]})
    return MD.decode(blob)


def _shape(value: Any, key: str, name: str) -> tuple[int, ...]:
    if type(value) not in (list, tuple) or not P.shape_ok(list(value)):
        raise bad_answer(_ANSWER, f"tensors.{key}", f"of {name[:80]!r} is no shape (at most "
                                                    f"{P.MAX_NDIM} integers >= 0)")
    return tuple(value)


def parse_tensors(entries: Any, slot: int, buffer_id: str, size: int) -> list[TensorInfo]:
    """A manifest's entries, each checked, as ``TensorInfo`` in offset order.
    Raises BAD_REQUEST (``reason: bad_answer``) naming the field."""
    if not isinstance(entries, dict):
        raise bad_answer(_ANSWER, "tensors", "must be a map of entries")
    out: list[TensorInfo] = []
    for name, e in entries.items():
        if not isinstance(name, str) or not isinstance(e, dict):
            raise bad_answer(_ANSWER, "tensors", "must map names to entries")
        offset, nbytes = e.get("offset"), e.get("nbytes")
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0 \
                or offset + nbytes > size:
            raise bad_answer(_ANSWER, "tensors.offset", f"and nbytes of {name[:80]!r} are not "
                                                        f"a range of its {size}-byte buffer")
        dtype = e.get("dtype")
        try:
            dt = np_dtype(dtype) if isinstance(dtype, str) and len(dtype) <= 64 else None
        except BadRequest:
            dt = None
        if dt is None:
            raise bad_answer(_ANSWER, "tensors.dtype", f"of {name[:80]!r} is no NumPy dtype")
        shape = _shape(e.get("shape"), "shape", name)
        if math.prod(shape) * dt.itemsize != nbytes:
            raise bad_answer(_ANSWER, "tensors.shape", f"of {name[:80]!r} is not its "
                                                       f"{nbytes} bytes")
        checksum = e.get("checksum")
        if checksum is not None and (type(checksum) is not int or not 0 <= checksum < 1 << 64):
            raise bad_answer(_ANSWER, "tensors.checksum", f"of {name[:80]!r} is no uint64")
        source = e.get("source_type")
        if source is not None and not P.source_type_ok(source):
            raise bad_answer(_ANSWER, "tensors.source_type", f"of {name[:80]!r} is not 1 to "
                                                             f"{P.MAX_SOURCE_TYPE} of "
                                                             "[A-Za-z0-9_]")
        logical = e.get("logical_shape")
        out.append(TensorInfo(name, slot, buffer_id, offset, nbytes, dt.str, shape, checksum,
                              source, None if logical is None
                              else _shape(logical, "logical_shape", name)))
    out.sort(key=lambda t: t.offset)
    return out
