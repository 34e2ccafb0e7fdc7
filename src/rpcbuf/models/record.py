"""A model load's record, Mooncake Store's PutStart / PutEnd: the tensor
``LOAD_TENSOR`` after each slot buffer's tensors and metadata (msgpack).

Named buffers outlive the loader, so an interrupted or killed load leaves slots
holding part of their tensors.  The record is written ``PLANNED`` (load id,
every slot, this slot's names) before any tensor, replacing the old one first so
a re-load stops the model being complete before it changes a byte; and
``COMMITTED`` with the checksums only after every slot verified.  A model is
complete when every slot holds a committed record of one load, every planned
slot is there, and each manifest still holds every named tensor with its
checksum (``problems`` names what is not).  A killed loader leaves slots
planned: incomplete until unloaded or reloaded.  ``decode`` trusts no daemon:
at most ``MAX_RECORD`` bytes, the exact shape ``encode`` makes.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack
import numpy as np

from rpcbuf.control.client.answers import bad_answer
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import NotFound, RpcBufError, VerifyFailed
from rpcbuf.control.wire.manifest import ALIGN, LOAD_TENSOR, align
from rpcbuf.dataplane.checksum import checksum

if TYPE_CHECKING:
    from rpcbuf.control.client.context import RpcContext

PLANNED, COMMITTED = "planned", "committed"
VERSION = 1
MAX_RECORD = 32 << 20  # 100,000 names of 300 bytes: far past any model's slot
_ANSWER = "model load record"
_KEYS = {"rpcbuf_model_load", "load", "state", "slots", "slot", "names", "checksums"}
_SHOWN = 5  # names a problem lists before "+N more"


@dataclass(frozen=True)
class LoadRecord:
    load: str  # the load's id (16 hex digits): every slot of one load holds the same
    state: str  # PLANNED or COMMITTED
    slots: tuple[int, ...]  # every slot of the model, across the nodes
    slot: int  # the slot whose buffer holds this record
    names: tuple[str, ...]  # the tensors this slot holds (the metadata tensor where carried)
    checksums: tuple[int, ...] | None  # theirs (xxh3-64), in ``names`` order; None while planned

    def committed(self, sums: Mapping[str, int]) -> LoadRecord:
        return LoadRecord(self.load, COMMITTED, self.slots, self.slot, self.names,
                          tuple(sums[n] for n in self.names))

    def encode(self) -> np.ndarray:
        """The uint8 tensor a slot holds; its length does not depend on the
        checksums' values, so ``room`` reserves the committed record's."""
        sums = None if self.checksums is None else \
            np.asarray(self.checksums, "<u8").tobytes()
        raw = msgpack.packb({"rpcbuf_model_load": VERSION, "load": self.load,
                             "state": self.state, "slots": list(self.slots), "slot": self.slot,
                             "names": list(self.names), "checksums": sums}, use_bin_type=True)
        return np.frombuffer(raw, dtype=np.uint8)


def plan(slots: Sequence[int], slot: int, names: Iterable[str], load: str) -> LoadRecord:
    return LoadRecord(load, PLANNED, tuple(slots), slot, tuple(names), None)


def new_load_id() -> str:
    return secrets.token_hex(8)


def room(record: LoadRecord) -> int:
    """The aligned bytes the slot buffer keeps for ``record``, committed."""
    full = LoadRecord(record.load, COMMITTED, record.slots, record.slot, record.names,
                      (0,) * len(record.names))
    return align(full.encode().nbytes, ALIGN)


def decode(raw: bytes) -> LoadRecord:
    """Raises BAD_REQUEST (``reason: bad_answer``): too big, not msgpack, or not
    the shape ``encode`` makes."""
    if len(raw) > MAX_RECORD:
        raise bad_answer(_ANSWER, "load", f"is {len(raw)} bytes (at most {MAX_RECORD})")
    # msgpack bounds each object, not the nesting: a list of 100,001-item
    # lists of empty lists (one byte each) passes them all and cost 2.4 GB and
    # 17 s to build.  A record has one map and two lists: count as they are made.
    made = [0, 0]

    def _list(items: list[Any]) -> list[Any]:
        made[0] += 1
        if made[0] > 2:
            raise ValueError("more than the record's two lists")
        return items

    def _map(pairs: dict[str, Any]) -> dict[str, Any]:
        made[1] += 1
        if made[1] > 1:
            raise ValueError("more than the record's one map")
        return pairs

    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True,
                              max_str_len=4 * P.MAX_STR, max_bin_len=8 * P.MAX_ITEMS,
                              max_array_len=P.MAX_ITEMS + 1, max_map_len=len(_KEYS),
                              max_ext_len=0, list_hook=_list, object_hook=_map)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise bad_answer(_ANSWER, "load", f"is not msgpack within bounds: {exc}") from None
    if not isinstance(obj, dict) or set(obj) != _KEYS or obj["rpcbuf_model_load"] != VERSION:
        raise bad_answer(_ANSWER, "load", f"is not rpcbuf's load record, version {VERSION}")
    load, state, slots, slot, names, sums = (obj[k] for k in (
        "load", "state", "slots", "slot", "names", "checksums"))
    ok = isinstance(load, str) and len(load) <= P.MAX_ID and state in (PLANNED, COMMITTED) \
        and isinstance(slots, list) and all(type(s) is int and 0 <= s < P.MAX_ITEMS
                                            for s in slots) \
        and type(slot) is int and slot in slots \
        and isinstance(names, list) and all(isinstance(n, str) for n in names) \
        and (sums is None if state == PLANNED
             else isinstance(sums, bytes) and len(sums) == 8 * len(names))
    if not ok:
        raise bad_answer(_ANSWER, "load", "does not hold a load's id, state, slots and names")
    return LoadRecord(load, state, tuple(slots), slot, tuple(names), None if sums is None
                      else tuple(int(c) for c in np.frombuffer(sums, "<u8")))


async def read_record(ctx: RpcContext, buffer_id: str, entry: Any) -> LoadRecord:
    """The record a manifest ``entry`` places, checked against its checksum.
    Raises BAD_REQUEST (``bad_answer``) or VERIFY_FAILED."""
    offset = entry.get("offset") if isinstance(entry, dict) else None
    nbytes = entry.get("nbytes") if isinstance(entry, dict) else None
    if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0 \
            or entry.get("dtype") != "|u1":
        raise bad_answer(_ANSWER, "load", "is not a flat uint8 tensor")
    if nbytes > MAX_RECORD:  # before a byte is read
        raise bad_answer(_ANSWER, "load", f"is {nbytes} bytes (at most {MAX_RECORD})")
    blob = await ctx.read_buffer(buffer_id, offset, nbytes)
    want = entry.get("checksum")
    if want is not None and checksum(blob) != want:
        raise VerifyFailed("a model's load record does not match its manifest checksum",
                           {"tensors": [LOAD_TENSOR]})
    return decode(bytes(blob))


K = TypeVar("K")
Found = LoadRecord | RpcBufError | None  # a slot's record, why it cannot be read, or none


async def records(ctx: RpcContext, slots: Mapping[K, tuple[str, Mapping[str, Any]]]
                  ) -> dict[K, Found]:
    """Each slot's record from ``{key: (buffer id, manifest)}``: None where none
    is held, the error where it cannot be read."""
    out: dict[K, Found] = {}
    for key, (buffer_id, manifest) in slots.items():
        entry = manifest.get(LOAD_TENSOR)
        if entry is None:
            out[key] = None
            continue
        try:
            out[key] = await read_record(ctx, buffer_id, entry)
        except RpcBufError as exc:
            out[key] = exc
    return out


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n[:80]) for n in names[:_SHOWN])
    return shown + (f" +{len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def problems(found: Mapping[int, tuple[Found, Mapping[str, Any]]],
             every_node: bool) -> list[str]:
    """What keeps the model in ``found`` (``{slot: (record or error, manifest)}``)
    from being complete; [] when it is.  ``every_node``: a planned slot none holds
    is missing."""
    out: list[str] = []
    loads: dict[str, list[int]] = {}
    planned: set[int] = set()
    for slot, (rec, manifest) in sorted(found.items()):
        if isinstance(rec, RpcBufError):
            out.append(f"slot {slot}: its load record cannot be read: {rec.message}")
            continue
        if rec is None:
            out.append(f"slot {slot} has no load record (an interrupted load, or one made "
                       "before rpcbuf recorded loads)")
            continue
        if rec.slot != slot:
            out.append(f"slot {slot} holds the load record of slot {rec.slot}")
            continue
        loads.setdefault(rec.load, []).append(slot)
        planned |= set(rec.slots)
        lacking = [n for n in rec.names if not isinstance(manifest.get(n), dict)]
        if lacking:
            out.append(f"slot {slot} lacks {len(lacking)} of {len(rec.names)} tensor(s): "
                       f"{_names(lacking)}")
        if rec.state != COMMITTED:
            out.append(f"slot {slot}: its load did not finish (planned, never committed)")
            continue
        assert rec.checksums is not None
        changed = [n for n, c in zip(rec.names, rec.checksums, strict=True)
                   if isinstance(manifest.get(n), dict) and manifest[n].get("checksum") != c]
        if changed:
            out.append(f"slot {slot}: {len(changed)} tensor(s) changed since the load: "
                       f"{_names(changed)}")
    if len(loads) > 1:
        out.append("slots " + "; ".join(", ".join(map(str, s)) for s in loads.values())
                   + " come from different loads")
    missing = sorted(planned - set(found))
    if every_node and missing:
        out.append(f"slot(s) {', '.join(map(str, missing))} of the load are missing")
    return out


def incomplete(name: str, why: Sequence[str], where: str = "") -> NotFound:
    """NOT_FOUND, ``reason: incomplete``, with ``problems``."""
    return NotFound(f"model {name[:200]!r}{where} is incomplete: {'; '.join(why[:3])}"
                    + (f" (+{len(why) - 3} more)" if len(why) > 3 else ""),
                    {"name": name, "reason": "incomplete", "problems": list(why[:20])})
