"""``admission.Pending``: bounded room for unauthenticated peers, the oldest
(of the newcomer's source first) displaced, never the newcomer."""

from __future__ import annotations

import pytest

from rpcbuf.control.daemon.accounting.admission import Pending


def test_the_oldest_of_a_source_then_the_oldest_of_all_make_room() -> None:
    p: Pending[str] = Pending(4, per_source=2)
    assert p.add("a1", "a") == [] and p.add("a2", "a") == []
    assert p.add("a3", "a") == ["a1"]  # per source: a's oldest
    assert p.add("b1", "b") == [] and p.add("c1", "c") == []
    assert p.add("d1", "d") == ["a2"]  # in all: the oldest overall
    assert len(p) == 4 and "a3" in p and "a2" not in p
    p.discard("b1")
    p.discard("b1")  # idempotent
    assert p.add("e1", "e") == [] and len(p) == 4


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Pending(0)
    with pytest.raises(ValueError):
        Pending(1, per_source=0)
