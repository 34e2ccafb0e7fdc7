"""Placement: which slot (a device of the cluster) holds which of a model's
tensors, decided synchronously before a byte moves.

Tensors group by name into the *prolog* (embeddings and anything outside the
layers), *layers* 0..N-1 (``layers.N.``, ``blk.N.``, ``h.N.``, ``blocks.N.``,
...) and the *epilog* (a non-layer tensor naming ``norm``, ``output``,
``lm_head`` or ``ln_f``).  Slot ``i`` is the ``i``-th device, node after node.
Groups go to slots by a spec (``"0:prolog,epilog;1:20;2:all"``, in the spirit
of llama.cpp's ``-ngl``) or ``plan_auto`` (by free memory, packed in order when
that split does not fit).  Each slot's buffer is sized with 256-byte aligned
tensors and checked against its device's largest free block, rounded as its
allocator rounds.  A bad spec or a model that does not fit is ``BadRequest``
saying what to change.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rpcbuf.control.client.tensors import ALIGN
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.control.wire.units import format_size

_LAYER = re.compile(r"(?:^|\.)(?:layers|blk|h|blocks|block|layer)\.(\d+)\.")
_EPILOG = re.compile(r"norm|output|lm_head|ln_f", re.IGNORECASE)
SPEC_HELP = ('want "SLOT:ITEM[,ITEM...];SLOT:..." where ITEM is prolog, epilog, a layer '
             'count N, or all (the remaining layers), e.g. "0:prolog,epilog;1:20;2:all"')


def classify(name: str) -> str | int:
    """``"prolog"``, ``"epilog"`` or the layer index of a tensor name."""
    m = _LAYER.search(name)
    if m:
        return int(m.group(1))
    return "epilog" if _EPILOG.search(name) else "prolog"


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Groups:
    """A model's tensors by group, each in file order; ``sizes`` in bytes."""

    prolog: list[str]
    layers: list[list[str]]  # by position in ``layer_ids``
    layer_ids: list[int]  # the distinct layer indices, ascending
    epilog: list[str]
    sizes: dict[str, int]

    @classmethod
    def of(cls, tensors: Mapping[str, int] | Iterable[tuple[str, int]]) -> Groups:
        """Group ``{name: nbytes}`` (or ``(name, nbytes)`` pairs, in file order)."""
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        prolog: list[str] = []
        epilog: list[str] = []
        by_layer: dict[int, list[str]] = {}
        for name, _ in items:
            g = classify(name)
            if g == "prolog":
                prolog.append(name)
            elif g == "epilog":
                epilog.append(name)
            else:
                by_layer.setdefault(int(g), []).append(name)
        ids = sorted(by_layer)
        return cls(prolog, [by_layer[i] for i in ids], ids, epilog,
                   {n: int(s) for n, s in items})

    def bytes_of(self, names: Iterable[str]) -> int:
        """Aligned bytes, as ``calculate_buffer_size(..., headroom=0)`` counts them."""
        return sum(_aligned(self.sizes[n]) for n in names)


@dataclass(frozen=True)
class Slot:
    slot: int
    endpoint: str
    device_type: str
    device: int
    free: int
    largest_free: int
    allocator: str = "buddy"

    @property
    def key(self) -> str:
        return f"{self.device_type.lower()}:{self.device}"

    @property
    def capacity(self) -> int:
        """The largest buffer this device can grant now."""
        if self.allocator == "linear":
            return self.largest_free // ALIGN * ALIGN
        return self.largest_free  # buddy/slab: largest_free is a whole power-of-two block

    @classmethod
    def from_device(cls, slot: int, endpoint: str, dev: Mapping[str, Any]) -> Slot:
        return cls(slot, endpoint, str(dev["device_type"]), int(dev["device"]),
                   int(dev["free"]), int(dev["largest_free"]), str(dev.get("allocator", "buddy")))


@dataclass(frozen=True)
class SlotPlan:
    """What one slot gets: its tensors in order and the buffer bytes they need."""

    slot: Slot
    prolog: bool
    epilog: bool
    layers: tuple[int, int]  # [first, stop) in layer order
    tensors: list[str]
    nbytes: int

    def describe(self) -> dict[str, Any]:
        return {"slot": self.slot.slot, "endpoint": self.slot.endpoint, "device": self.slot.key,
                "prolog": self.prolog, "epilog": self.epilog, "layers": list(self.layers),
                "tensors": len(self.tensors), "nbytes": self.nbytes}


@dataclass(frozen=True)
class Placement:
    """Each used slot's share, the spec that reproduces it, and whether it
    was planned by free memory (``auto``)."""

    slots: list[SlotPlan]  # only slots that get something, by slot number
    spec: str  # an explicit spec that reproduces this placement
    auto: bool = False

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec, "auto": self.auto, "slots": [s.describe() for s in self.slots]}


# -- the spec ---------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One ``SLOT:ITEMS`` of a spec; ``count`` None with ``rest`` = all remaining."""

    slot: int
    prolog: bool = False
    epilog: bool = False
    count: int | None = None
    rest: bool = False

    def text(self) -> str:
        items = (["prolog"] if self.prolog else []) + \
            ([str(self.count)] if self.count is not None else []) + \
            (["all"] if self.rest else []) + (["epilog"] if self.epilog else [])
        return f"{self.slot}:{','.join(items)}"


def parse_spec(text: str) -> list[Entry]:
    """Parse ``"0:prolog,epilog;1:20;2:all"``. Raises BAD_REQUEST naming the bad part."""
    if not isinstance(text, str) or not text.strip():
        raise BadRequest(f"empty placement spec: {SPEC_HELP}", {"spec": text})
    entries: list[Entry] = []
    seen: set[int] = set()
    for raw in text.split(";"):
        part = raw.strip()
        if not part:
            continue
        slot_text, colon, items_text = part.partition(":")
        if not colon:
            raise BadRequest(f"placement entry {part!r} has no ':'; {SPEC_HELP}",
                             {"spec": text, "entry": part})
        slot_text = slot_text.strip()
        if not slot_text.isdigit():
            raise BadRequest(f"placement entry {part!r}: slot {slot_text!r} is not a "
                             f"number; {SPEC_HELP}", {"spec": text, "entry": part})
        slot = int(slot_text)
        if slot in seen:
            raise BadRequest(f"slot {slot} appears twice in the placement spec; list each "
                             "slot once", {"spec": text, "slot": slot})
        seen.add(slot)
        fields: dict[str, Any] = {}
        for item in (i.strip().lower() for i in items_text.split(",")):
            if item in ("prolog", "epilog"):
                key = item
            elif item == "all":
                key = "rest"
            elif item.isdigit():
                key = "count"
            else:
                raise BadRequest(f"placement entry {part!r}: unknown item {item!r}; "
                                 f"{SPEC_HELP}", {"spec": text, "entry": part, "item": item})
            if key in fields or (key in ("count", "rest") and ({"count", "rest"} & set(fields))):
                raise BadRequest(f"placement entry {part!r} gives its layers twice; use one "
                                 "count or 'all' per slot", {"spec": text, "entry": part})
            fields[key] = int(item) if key == "count" else True
        if fields.get("count") == 0:
            raise BadRequest(f"placement entry {part!r}: a layer count must be at least 1 "
                             "(leave the slot out instead)", {"spec": text, "entry": part})
        entries.append(Entry(slot, **fields))
    if not entries:
        raise BadRequest(f"empty placement spec: {SPEC_HELP}", {"spec": text})
    for key in ("prolog", "epilog"):
        owners = [e.slot for e in entries if getattr(e, key)]
        if len(owners) > 1:
            raise BadRequest(f"the {key} is given to slots {owners}; give it to one slot",
                             {"spec": text, key: owners})
    if sum(e.rest for e in entries) > 1:
        raise BadRequest("'all' appears in more than one slot; use it once (the other "
                         "slots take counts)", {"spec": text})
    return entries


def format_spec(entries: Sequence[Entry]) -> str:
    return ";".join(e.text() for e in entries)


# -- plans ---------------------------------------------------------------------------


def _fit_error(plans: Sequence[SlotPlan]) -> None:
    over = [p for p in plans if p.nbytes > p.slot.capacity]
    if not over:
        return
    detail = [{"slot": p.slot.slot, "endpoint": p.slot.endpoint, "device": p.slot.key,
               "needs": p.nbytes, "largest_free": p.slot.largest_free, "free": p.slot.free}
              for p in over]
    first = detail[0]
    raise BadRequest(
        f"slot {first['slot']} ({first['endpoint']} {first['device']}) cannot hold its share: "
        f"it needs {format_size(over[0].nbytes)}, its largest free block is "
        f"{format_size(over[0].slot.largest_free)}; "
        "give it fewer layers (or move the prolog/epilog), free memory there, or leave "
        "--placement out to split by free memory", {"slots": detail})


def _slot_plan(groups: Groups, slot: Slot, prolog: bool, epilog: bool,
               first: int, stop: int) -> SlotPlan:
    names = (groups.prolog if prolog else []) + \
        [n for layer in groups.layers[first:stop] for n in layer] + \
        (groups.epilog if epilog else [])
    return SlotPlan(slot, prolog, epilog, (first, stop), names, groups.bytes_of(names))


def plan_from_spec(groups: Groups, slots: Sequence[Slot], spec: str | Sequence[Entry]
                   ) -> Placement:
    """Raises BAD_REQUEST: syntax, an unknown slot, the prolog/epilog left
    out, layers left over or too many, a slot that cannot hold its share."""
    entries = parse_spec(spec) if isinstance(spec, str) else list(spec)
    text = spec if isinstance(spec, str) else format_spec(entries)
    by_slot = {s.slot: s for s in slots}
    unknown = [e.slot for e in entries if e.slot not in by_slot]
    if unknown:
        known = ", ".join(f"{s.slot}={s.endpoint} {s.key}" for s in slots)
        raise BadRequest(f"slot {unknown[0]} does not exist: the cluster has slots "
                         f"0..{len(slots) - 1} ({known})",
                         {"spec": text, "unknown_slots": unknown, "slots": len(slots)})
    for key, names in (("prolog", groups.prolog), ("epilog", groups.epilog)):
        if names and not any(getattr(e, key) for e in entries):
            raise BadRequest(f"the {key} ({len(names)} tensors, e.g. {names[0]!r}) is not "
                             f"placed: add it to a slot, e.g. '0:{key}'",
                             {"spec": text, "missing": key})
    n = len(groups.layers)
    counted = sum(e.count or 0 for e in entries)
    has_rest = any(e.rest for e in entries)
    if counted > n:
        raise BadRequest(f"the spec places {counted} layers but the model has {n}: lower the "
                         "counts", {"spec": text, "placed": counted, "layers": n})
    if counted < n and not has_rest:
        raise BadRequest(f"layers left over: the spec places {counted} of {n} layers; raise a "
                         f"count or give one slot 'all' (e.g. '{entries[-1].slot}:all')",
                         {"spec": text, "placed": counted, "layers": n,
                          "left_over": [groups.layer_ids[i] for i in range(counted, n)][:20]})
    cursor = 0
    plans: list[SlotPlan] = []
    for e in entries:
        take = e.count if e.count is not None else (n - counted if e.rest else 0)
        plans.append(_slot_plan(groups, by_slot[e.slot], e.prolog, e.epilog,
                                cursor, cursor + take))
        cursor += take
    plans = [p for p in plans if p.tensors]
    _fit_error(plans)
    plans.sort(key=lambda p: p.slot.slot)
    return Placement(plans, text)


def plan_auto(groups: Groups, slots: Sequence[Slot]) -> Placement:
    """Layers by free memory (prolog first, epilog last), else packed in order.
    Raises BAD_REQUEST when the model cannot fit at all."""
    usable = [s for s in slots if s.free > 0 and s.capacity > 0]
    if not usable:
        raise BadRequest("no device in the cluster has free memory",
                         {"slots": [s.slot for s in slots]})
    counts = _proportional(groups, usable)
    plans = _plans_for_counts(groups, usable, counts)
    if any(p.nbytes > p.slot.capacity for p in plans):
        packed = _packed(groups, usable)
        if packed is None:
            total = groups.bytes_of(groups.sizes)
            caps = {f"{s.slot}:{s.endpoint} {s.key}": s.capacity for s in usable}
            # --placement chooses a split: no help with one device to split over.
            more = "add nodes" if len(usable) == 1 else \
                "add nodes, or pass --placement to choose the split"
            raise BadRequest(
                f"the model ({format_size(total)} in aligned tensors) does not fit the "
                f"cluster's free memory ({format_size(sum(caps.values()))}): free memory, "
                f"{more}", {"model_bytes": total, "capacity": caps})
        plans = _plans_for_counts(groups, usable, packed)
    spec = [Entry(p.slot.slot, p.prolog, p.epilog,
                  (p.layers[1] - p.layers[0]) or None) for p in plans]
    return Placement(plans, format_spec(spec), auto=True)


def _layer_bytes(groups: Groups) -> list[int]:
    return [groups.bytes_of(layer) for layer in groups.layers]


def _proportional(groups: Groups, usable: Sequence[Slot]) -> list[int]:
    """Each layer goes to the slot whose share (by free memory) holds its midpoint."""
    sizes = _layer_bytes(groups)
    pro, epi = groups.bytes_of(groups.prolog), groups.bytes_of(groups.epilog)
    total = pro + sum(sizes) + epi
    weight = sum(s.free for s in usable)
    bounds: list[float] = []
    acc = 0
    for s in usable:
        acc += s.free
        bounds.append(total * acc / weight)
    counts = [0] * len(usable)
    pos, j = float(pro), 0
    for size in sizes:
        mid = pos + size / 2
        while j < len(usable) - 1 and mid > bounds[j]:
            j += 1
        counts[j] += 1
        pos += size
    return counts


def _packed(groups: Groups, usable: Sequence[Slot]) -> list[int] | None:
    """Greedy, each slot takes as many next layers as fit: complete for this
    shape of plan (taking more early never hurts)."""
    sizes = _layer_bytes(groups)
    pro, epi = groups.bytes_of(groups.prolog), groups.bytes_of(groups.epilog)
    counts = [0] * len(usable)
    k, last = 0, len(usable) - 1
    for j, s in enumerate(usable):
        room = s.capacity - (pro if j == 0 else 0) - (epi if j == last else 0)
        if room < 0:
            return None
        while k < len(sizes) and sizes[k] <= room:
            room -= sizes[k]
            counts[j] += 1
            k += 1
    return counts if k == len(sizes) else None


def _plans_for_counts(groups: Groups, usable: Sequence[Slot], counts: list[int]
                      ) -> list[SlotPlan]:
    plans: list[SlotPlan] = []
    cursor, last = 0, len(usable) - 1
    for j, (s, c) in enumerate(zip(usable, counts, strict=True)):
        p = _slot_plan(groups, s, j == 0, j == last, cursor, cursor + c)
        cursor += c
        if p.tensors:
            plans.append(p)
    return plans


def plan(groups: Groups, slots: Sequence[Slot], spec: str | None = None) -> Placement:
    return plan_auto(groups, slots) if spec is None else plan_from_spec(groups, slots, spec)
