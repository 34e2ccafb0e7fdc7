"""The loader's choice of a buffer to clone (``acquire.clone_candidates`` /
``_clone_source``): exactly the slot's layout and checksums, and a listing
no daemon of ours would send (a hostile one) is simply not a candidate."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from rpcbuf.control.client.tensors import plan_layout
from rpcbuf.models import acquire as L, slots
from rpcbuf.models.modelfile import TensorSpec

SPECS = [TensorSpec("a", "float32", (256,), 1024, "F32"), TensorSpec("b", "float32", (64,), 256,
                                                                     "F32")]
HASHES = {"a": (11, 1), "b": (22, 2)}


def job() -> Any:
    slot = SimpleNamespace(device_type="CPU", device=0)
    return slots.SlotJob(SimpleNamespace(slot=slot), SPECS, "new/slot0")  # type: ignore[arg-type]


def listing(**over: Any) -> dict[str, Any]:
    offsets = plan_layout({s.name: s for s in SPECS}, {}, start=0)
    tensors = {s.name: {"offset": offsets[s.name], "nbytes": s.nbytes,
                        "checksum": HASHES[s.name][1]} for s in SPECS}
    return {"buffer_id": "b-src", "name": "old/slot0", "device_type": "CPU", "device": 0,
            "size": 4096, "tensors": tensors, **over}


def choose(bufs: list[Any]) -> str | None:
    j = job()
    layout, cands = L.clone_candidates(bufs, j, 2048)
    return L.clone_source(j, layout, cands, HASHES)


def test_the_buffer_with_exactly_the_plan_is_chosen() -> None:
    assert choose([listing()]) == "b-src"


def test_anything_else_is_not() -> None:
    moved = listing()
    moved["tensors"]["b"] = {**moved["tensors"]["b"], "offset": 4000}
    other = listing()
    other["tensors"]["a"] = {**other["tensors"]["a"], "checksum": 99}  # other bytes
    extra = listing()
    extra["tensors"]["c"] = {"offset": 3000, "nbytes": 8, "checksum": 3}
    for b in (moved, other, extra, listing(size=100), listing(device=1),
              listing(device_type="GPU"), listing(name="new/slot0")):
        assert choose([b]) is None, b
    j = job()
    layout, cands = L.clone_candidates([listing()], j, 2048)
    assert L.clone_source(j, layout, cands, {"a": HASHES["a"]}) is None  # a hash unknown


def test_a_hostile_listing_is_not_a_candidate_and_raises_nothing() -> None:
    bad: list[Any] = [7, None, "x", listing(tensors=[1, 2]), listing(size="big"),
                      listing(tensors={"a": 5, "b": None}), listing(buffer_id=3),
                      listing(tensors={"a": {"offset": []}, "b": {}})]
    assert choose(bad) is None
    assert choose([*bad, listing()]) == "b-src"
