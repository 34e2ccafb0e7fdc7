"""``rpcbuf.dataplane.progress.drain``: how many progress calls one turn of the event loop makes.

A fake worker (the only thing ``drain`` touches is ``progress_once``), a fake
clock for the time budget; the real progress engine runs in every UCX test.
"""

from __future__ import annotations

import pytest

from rpcbuf.dataplane import progress


class Worker:
    """``progress_once`` answers from ``script`` (True: it progressed), then False
    for ever; each call moves the fake clock on by ``step`` seconds."""

    def __init__(self, script: list[bool], clock: list[float] | None = None,
                 step: float = 0.0) -> None:
        self.script, self.calls, self.clock, self.step = list(script), 0, clock, step

    def progress_once(self) -> bool:
        self.calls += 1
        if self.clock is not None:
            self.clock[0] += self.step
        return self.script.pop(0) if self.script else False


def test_nothing_to_do_is_one_call() -> None:
    w = Worker([])
    assert progress.drain(w) is False
    assert w.calls == 1


@pytest.mark.parametrize("pending", [1, 2, 7])
def test_drains_until_nothing_is_left(pending: int) -> None:
    w = Worker([True] * pending)
    assert progress.drain(w, most=64, seconds=10.0) is True
    assert w.calls == pending + 1  # the last call found nothing
    assert w.script == []


def test_stops_at_most_calls() -> None:
    w = Worker([True] * 1000)
    assert progress.drain(w, most=64, seconds=10.0) is True
    assert w.calls == 64
    assert len(w.script) == 1000 - 64


def test_most_one_is_one_call_per_turn() -> None:
    w = Worker([True] * 5)
    assert progress.drain(w, most=1, seconds=10.0) is True
    assert w.calls == 1


def test_stops_when_the_time_is_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    w = Worker([True] * 1000, clock, step=0.0004)
    assert progress.drain(w, most=64, seconds=0.001) is True
    # the budget starts after the first call (t=0.4 ms): calls at 0.4, 0.8, 1.2 ms
    # still start before 1.4 ms; at 1.6 ms no new call is made
    assert w.calls == 4


def test_a_failing_call_propagates() -> None:
    class Broken(Worker):
        def progress_once(self) -> bool:
            super().progress_once()
            if self.calls == 3:
                raise RuntimeError("endpoint error")
            return True

    w = Broken([])
    with pytest.raises(RuntimeError, match="endpoint error"):
        progress.drain(w, most=64, seconds=10.0)
    assert w.calls == 3  # nothing after the failure


def test_defaults_are_bounded() -> None:
    assert 1 < progress.DRAIN_CALLS <= 1024
    assert 0 < progress.DRAIN_BUDGET <= 0.01
    w = Worker([True] * 10_000)
    assert progress.drain(w) is True
    assert w.calls <= progress.DRAIN_CALLS
