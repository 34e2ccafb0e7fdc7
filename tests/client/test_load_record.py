"""The load record (``models/record.py``) with no daemon: what it
encodes, what a daemon may hand back, and how a model's slots are judged."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

import rpcbuf
from rpcbuf.models import record as LR


def rec(slot: int, names: list[str], state: str = LR.COMMITTED, load: str = "a" * 16,
        slots: tuple[int, ...] = (0, 1)) -> LR.LoadRecord:
    planned = LR.plan(slots, slot, names, load)
    return planned.committed({n: i + 1 for i, n in enumerate(names)}) \
        if state == LR.COMMITTED else planned


def manifest(names: list[str]) -> dict[str, Any]:
    return {n: {"checksum": i + 1} for i, n in enumerate(names)}


def test_round_trip_and_room() -> None:
    r = rec(1, ["a", "lm_head.weight"])
    assert LR.decode(r.encode().tobytes()) == r
    p = LR.plan((0, 1), 1, ["a", "lm_head.weight"], r.load)
    assert LR.decode(p.encode().tobytes()) == p
    assert p.encode().nbytes <= r.encode().nbytes <= LR.room(p)


@pytest.mark.parametrize("raw", [
    b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"rpcbuf_model_load": 2}),
    msgpack.packb({"rpcbuf_model_load": 1, "load": "x", "state": "committed", "slots": [0],
                   "slot": 3, "names": ["a"], "checksums": b"\0" * 8}),  # slot not in slots
    msgpack.packb({"rpcbuf_model_load": 1, "load": "x", "state": "committed", "slots": [0],
                   "slot": 0, "names": ["a"], "checksums": b"\0" * 7}),  # short checksums
])
def test_a_malformed_record_is_a_bad_answer(raw: bytes) -> None:
    with pytest.raises(rpcbuf.BadRequest) as info:
        LR.decode(raw)
    assert info.value.details["reason"] == "bad_answer"


def test_a_complete_model_has_no_problems() -> None:
    found = {0: (rec(0, ["a"]), manifest(["a"])), 1: (rec(1, ["b"]), manifest(["b"]))}
    assert LR.problems(found, every_node=True) == []


def test_each_way_a_model_is_incomplete_is_named() -> None:
    names = ["x", "lm_head.weight"]
    lacking = {0: (rec(0, ["a"]), manifest(["a"])),
               1: (rec(1, names, LR.PLANNED), manifest(["x"]))}
    got = LR.problems(lacking, every_node=True)
    assert any("lacks 1 of 2" in p and "lm_head.weight" in p for p in got), got
    assert any("did not finish" in p for p in got), got
    assert LR.problems({0: (rec(0, ["a"]), manifest(["a"]))}, every_node=True) == [
        "slot(s) 1 of the load are missing"]
    assert LR.problems({0: (rec(0, ["a"]), manifest(["a"]))}, every_node=False) == []
    assert "no load record" in LR.problems({0: (None, manifest(["a"]))}, True)[0]
    changed = {0: (rec(0, ["a"]), {"a": {"checksum": 99}}), 1: (rec(1, ["b"]), manifest(["b"]))}
    assert "changed since the load" in LR.problems(changed, True)[0]
    mixed = {0: (rec(0, ["a"]), manifest(["a"])),
             1: (rec(1, ["b"], load="b" * 16), manifest(["b"]))}
    assert "different loads" in LR.problems(mixed, True)[0]
    err = LR.incomplete("m", LR.problems(lacking, True))
    assert err.code == "NOT_FOUND" and err.details["reason"] == "incomplete"
    assert "lm_head.weight" in err.message


def test_a_record_nested_to_blow_up_is_refused_at_once() -> None:
    """msgpack bounds each object, not the nesting: a malicious daemon's
    record whose names are 200 lists of 100,001 empty lists each (20 MB)
    passed every bound and cost 2.4 GB and 17 s to build before decode
    refused it.  One map and two lists is all a record has."""
    inner = b"\xdd" + (100_001).to_bytes(4, "big") + b"\x90" * 100_001
    names = b"\xdd" + (200).to_bytes(4, "big") + inner * 200
    raw = b"\x87" + b"".join(msgpack.packb(x) for x in [
        "rpcbuf_model_load", 1, "load", "x", "state", "planned", "slots", [0], "slot", 0,
        "checksums", None, "names"]) + names
    with pytest.raises(rpcbuf.RpcBufError, match="two lists"):
        LR.decode(raw)
