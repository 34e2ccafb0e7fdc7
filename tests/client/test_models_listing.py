"""``rpcbuf models`` groups every node's slot buffers into models
(``cli.fleet.group_models``); a synchronous core, fed listings as nodes
answer them."""

from __future__ import annotations

from typing import Any

from rpcbuf.cli.fleet import group_models
from rpcbuf.models import record as LR


def _slot(buffer_id: str, model: str, slot: int, rec: LR.LoadRecord) -> dict[str, Any]:
    tensors = {n: {"checksum": 7, "nbytes": 8} for n in rec.names}
    tensors[LR.LOAD_TENSOR] = {"nbytes": 64}
    return {"buffer_id": buffer_id, "name": f"{model}/slot{slot}", "size": 1 << 20,
            "tensor_count": len(tensors), "tensors": tensors}


def test_a_slot_held_on_two_nodes_is_a_problem_not_overwritten() -> None:
    """Seen: node A held a planned (never committed) slot 0 of an interrupted
    load, node B a committed slot 0 of another; the listing kept whichever
    node it read last, and called the model complete."""
    planned = LR.plan([0], 0, ["w"], "a" * 16)
    committed = LR.plan([0], 0, ["w"], "b" * 16).committed({"w": 7})
    results = {"A": [_slot("ba", "llama", 0, planned)],
               "B": [_slot("bb", "llama", 0, committed)]}
    records = {"A": {"ba": planned}, "B": {"bb": committed}}
    got = group_models(results, records)["llama"]
    assert got["complete"] is False
    assert "slot 0 is held on more than one node" in got["problems"]
    alone = group_models({"B": results["B"]}, {"B": records["B"]})["llama"]
    assert alone["complete"] is True and alone["problems"] == []
