"""One slot of a model load (``SlotJob``) and its buffer's layout, alike for an
upload and a node-local load: tensors back to back in plan order, the model's
metadata after them on each node's first slot, the load record last.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rpcbuf.control.client.tensors import ALIGN, plan_layout
from rpcbuf.control.wire.manifest import align
from rpcbuf.models import metadata as MD, placement as PL, record as LR
from rpcbuf.models.modelfile import TensorSpec


def buffer_name(name: str, slot: int) -> str:
    return f"{name}/slot{slot}"


def is_model_buffer(name: str, buf_name: str | None) -> bool:
    return buf_name is not None and re.fullmatch(re.escape(name) + r"/slot\d+", buf_name) \
        is not None


@dataclass
class SlotJob:
    plan: PL.SlotPlan
    specs: list[TensorSpec]
    buffer_name: str
    buffer_id: str = ""
    created: bool = False
    cloned: bool = False  # made by ``clone_buffer`` from a buffer that held this plan
    released: bool = False  # created, then released by a failed load's cleanup
    # Its buffer's request or clone while on its way: it runs to its end even
    # when the load is cancelled meanwhile, and records what it made (``acquire.make``).
    making: asyncio.Future[str] | None = None
    metadata: np.ndarray | None = None  # the model's metadata blob, on this node's first slot
    record: LR.LoadRecord | None = None  # this slot's load record, planned (``commit``)
    sums: dict[str, int] = field(default_factory=dict)  # verified checksums, for the commit
    held: dict[str, Any] | None = None  # a reused or cloned buffer's manifest when acquired
    expect: dict[str, int] | None = None  # every checksum, when known before the load
    inherited: bool = False  # its committed record already says what this load puts there

    @property
    def endpoint(self) -> str:
        return self.plan.slot.endpoint

    @property
    def record_offset(self) -> int:
        return record_offset(self, slot_offsets(self))

    def layout(self) -> dict[str, int]:
        """Where each tensor of the slot goes, the metadata too."""
        offsets = slot_offsets(self)
        if self.metadata is not None:
            offsets[MD.META_TENSOR] = metadata_offset(self, offsets)
        return offsets


def carry_metadata(jobs: list[SlotJob], blob: np.ndarray) -> None:
    """The first slot of each node holds the model's metadata (``metadata``)."""
    seen: set[str] = set()
    for j in jobs:  # by slot number
        if j.plan.slot.endpoint not in seen:
            seen.add(j.plan.slot.endpoint)
            j.metadata = blob


def slot_offsets(job: SlotJob) -> dict[str, int]:
    return plan_layout({sp.name: sp for sp in job.specs}, {}, start=0)


def metadata_offset(job: SlotJob, offsets: dict[str, int]) -> int:
    """Where the metadata tensor goes: aligned, right after the slot's tensors."""
    return align(max((offsets[sp.name] + sp.nbytes for sp in job.specs), default=0), ALIGN)


def metadata_bytes(job: SlotJob) -> int:
    return 0 if job.metadata is None else align(job.metadata.nbytes, ALIGN)


def record_offset(job: SlotJob, offsets: dict[str, int]) -> int:
    """Where the load record goes (``commit``): after the tensors and the metadata."""
    return metadata_offset(job, offsets) + metadata_bytes(job)


def record_bytes(job: SlotJob) -> int:
    return 0 if job.record is None else LR.room(job.record)


def metadata_names(job: SlotJob) -> set[str]:
    return set() if job.metadata is None else {MD.META_TENSOR}


def room_for_metadata(slots: list[PL.Slot], blob: np.ndarray, record: int = 0
                       ) -> list[PL.Slot]:
    """Slots less the metadata's aligned bytes (any may be a node's first) and
    ``record``, the most a load record needs."""
    less = align(blob.nbytes, ALIGN) + record
    return [PL.Slot(s.slot, s.endpoint, s.device_type, s.device, max(0, s.free - less),
                    max(0, s.largest_free - less), s.allocator) for s in slots]
