"""The benchmarks' tables from numbers alone: ``scripts/_bench_load_rows.py``
(``bench_load.py``), fed small fabricated results.

Each goal row must carry value, reference, ratio, goal and met, and say
"met" only when the number is on the right side of the goal.  Nothing here
starts a process or imports ucxx: the modules under test are the pure ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import _bench_load_rows as load_rows  # noqa: E402


def test_load_rows_absolute_goal() -> None:
    gib = 1 << 30
    one = {"store": [0.4], "store_checksum": [0.5], "first": [{"seconds": 0.45,
                                                              "bytes_sent": gib}],
           **{k: [{"seconds": 0.03, "bytes_sent": 0}]
              for k in ("same_name", "new_name", "new_name_no_hash_cache")}}
    rows = load_rows.build_rows({"one": one}, gib)
    absolute = [r for r in rows if r["goal"] == ">= 10x = 2.1 GB/s (15)"]
    assert len(absolute) == 1 and absolute[0]["met"] is True  # 2.39 GB/s
    assert absolute[0]["ratio"] == pytest.approx(gib / 0.45 / 1e9 / 0.21)
    relative = [r for r in rows if r["what"] == "load_model, first (warm arena)"
                and r["goal"] == ">= 0.8x"]
    assert relative[0]["met"] is True  # 0.4 / 0.45 = 0.89
    one["first"] = [{"seconds": 0.6, "bytes_sent": gib}]  # 1.79 GB/s, 0.67x
    rows = load_rows.build_rows({"one": one}, gib)
    assert [r["met"] for r in rows if r["what"] == "load_model, first (warm arena)"
            and r["goal"] != "-"] == [False, False]
    assert ">= 10x = 2.1 GB/s (15)" in load_rows.render(rows)
