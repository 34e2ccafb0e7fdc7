"""The tables of ``bench_kv_store.py`` from its report alone (pure: no
process, no numpy), so they can be tested on fabricated numbers.

Three tables, each under 80 columns: the timings (put / get p50 in ms per
size and for the 256-block batch, the hit in microseconds), the blocks held
(with the holding process's fds and the blocks per second of the hold's
puts and gets), and the ratios that issue 40's goals name, one run's
numbers against each other: the time of the reference over rpcbuf's (so
1.00 or more means rpcbuf is as fast or faster), then one line per goal
saying met or missed.  A side that was not measured, or a row that failed,
shows "-" and its reason below the tables.
"""

from __future__ import annotations

import textwrap
from typing import Any

SIZES = ("256 KiB", "2 MiB", "16 MiB")
ORDER = ("rpcbuf same-host", "rpcbuf ucx", "Mooncake tcp", "Mooncake same-host", "memcpy")
# (rpcbuf side, reference side, label): the comparisons issue 40 asks for.
PAIRS = (("rpcbuf same-host", "Mooncake same-host", "same-host / MC same-host"),
         ("rpcbuf ucx", "Mooncake tcp", "ucx / MC tcp"),
         ("rpcbuf same-host", "memcpy", "same-host / memcpy"))
# Same host against memcpy (issue 40): (row, op, at least).
MEMCPY_GOALS = (("2 MiB", "get", 0.6), ("16 MiB", "get", 0.8),
                ("2 MiB", "put", 0.4), ("16 MiB", "put", 0.5))
HOLD_GOAL = {"blocks": 250_000, "fds": 500, "rate": 50_000}


WIDTH = 79


def _num(v: float | None) -> str:
    """3 or 4 figures at most: 0.016, 0.44, 3.93, 41.1, 267, 15,017."""
    if v is None:
        return "-"
    for bound, fmt in ((1, ".3f"), (10, ".2f"), (100, ".1f")):
        if v < bound:
            return format(v, fmt)
    return f"{v:,.0f}"


def _cell(row: dict[str, Any] | None, put: str = "put_ms", get: str = "get_ms") -> str:
    if not row or "error" in row or get not in row:
        return "-"
    return f"{_num(row.get(put))}/{_num(row[get])}"


def _row(side: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The ``key`` row of a side (a size name, "batch", "hit", "hold")."""
    got = side.get("single", {}).get(key) if key in SIZES else side.get(key)
    return got if isinstance(got, dict) else None


def _ms(side: dict[str, Any], key: str, op: str) -> float | None:
    """A side's p50 in ms for ``op`` (put, get) of row ``key``; None if missing."""
    row = _row(side, key)
    if row is None or "error" in row:
        return None
    if key == "hit":
        return row["get_us"] / 1e3 if op == "get" and "get_us" in row else None
    value = row.get(f"{op}_ms")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def ratio(report: dict[str, Any], ours: str, ref: str, key: str, op: str) -> float | None:
    """Reference time over ours (>= 1: ours as fast or faster); None if either is missing."""
    sides = report.get("sides", {})
    a, b = _ms(sides.get(ours, {}), key, op), _ms(sides.get(ref, {}), key, op)
    return None if a is None or b is None else b / a


def _sides(report: dict[str, Any]) -> list[str]:
    sides = report.get("sides", {})
    return [n for n in ORDER if n in sides] + [n for n in sides if n not in ORDER]


def timing_table(report: dict[str, Any]) -> str:
    from benchkit.report import format_table

    rows = []
    for name in _sides(report):
        side = report["sides"][name]
        hit = _row(side, "hit")
        rows.append([name, *(_cell(_row(side, s)) for s in SIZES), _cell(_row(side, "batch")),
                     "-" if not hit or "get_us" not in hit else _num(hit["get_us"])])
    return format_table(["put/get ms", *SIZES, "256x256 KiB", "hit us"], rows)


def hold_table(report: dict[str, Any]) -> str:
    from benchkit.report import format_table

    rows = []
    for name in _sides(report):
        h = _row(report["sides"][name], "hold")
        if h is None:
            continue
        if "error" in h:
            rows.append([name, "-", "-", "-", "-"])
            continue
        rows.append([name, f"{h['held']:,} of {h['asked']:,}",
                     "-" if h.get("fds") is None else f"{h['fds']:,}",
                     _num(h.get("put_blocks_s")), _num(h.get("get_blocks_s"))])
    return format_table(["16 KiB blocks", "held", "server fds", "put blk/s", "get blk/s"],
                        rows)


def ratio_table(report: dict[str, Any]) -> str:
    from benchkit.report import format_table

    rows = []
    for ours, ref, label in PAIRS:
        cells = []
        for key in (*SIZES, "batch"):
            p, g = ratio(report, ours, ref, key, "put"), ratio(report, ours, ref, key, "get")
            cells.append("-" if p is None and g is None else
                         f"{'-' if p is None else f'{p:.2f}'}/"
                         f"{'-' if g is None else f'{g:.2f}'}")
        hit = ratio(report, ours, ref, "hit", "get")
        rows.append([label, *cells, "-" if hit is None else f"{hit:.2f}"])
    return format_table(["ref time / ours", *SIZES, "batch", "hit"], rows)


def goal_lines(report: dict[str, Any]) -> list[str]:
    """One line per goal of issue 40 this run can judge: met, missed, or not measured."""
    out = []
    for key, op, least in MEMCPY_GOALS:
        r = ratio(report, "rpcbuf same-host", "memcpy", key, op)
        out.append(f"same-host {op} {key}: " + ("not measured" if r is None else
                   f"{r:.2f}x memcpy's speed, goal {least}x: "
                   f"{'met' if r >= least else 'missed'}"))
    for ours, ref, _label in PAIRS[:2]:
        judged = [(key, op, ratio(report, ours, ref, key, op))
                  for key in (*SIZES, "batch") for op in ("put", "get")]
        judged.append(("hit", "get", ratio(report, ours, ref, "hit", "get")))
        have = [(k, o, r) for k, o, r in judged if r is not None]
        if not have:
            out.append(f"{ours} >= {ref} on every row: not measured")
            continue
        slow = [f"{k} {o}" if k != "hit" else "hit" for k, o, r in have if r < 1.0]
        out.append(f"{ours} >= {ref} on every row: "
                   + (f"met ({len(have)} rows)" if not slow else
                      f"missed on all {len(have)} rows" if len(slow) == len(have) else
                      f"missed on {len(slow)} of {len(have)} ({', '.join(slow)})"))
    h = _row(report.get("sides", {}).get("rpcbuf same-host", {}), "hold")
    if h is None or "error" in h:
        out.append("scale (250,000 x 16 KiB held): not measured")
    else:
        ok = (h["held"] >= HOLD_GOAL["blocks"] and h.get("fds") is not None
              and h["fds"] < HOLD_GOAL["fds"]
              and min(h.get("put_blocks_s") or 0, h.get("get_blocks_s") or 0)
              >= HOLD_GOAL["rate"])
        out.append(f"scale: {h['held']:,} of {h['asked']:,} held, "
                   f"{'-' if h.get('fds') is None else format(h['fds'], ',')} fds, "
                   f"{_num(h.get('put_blocks_s'))} / {_num(h.get('get_blocks_s'))} "
                   f"blocks/s (goal 250,000, < 500 fds, 50,000/s): "
                   f"{'met' if ok else 'missed'}")
    return out


def notes(report: dict[str, Any]) -> list[str]:
    """What each side checks, why a side or row is missing, why a hold stopped."""
    out = []
    for name in _sides(report):
        side = report["sides"][name]
        if side.get("checks"):
            out.append(f"{name} checks: {side['checks']}")
        if "error" in side:
            out.append(f"{name}: not measured: {side['error']}")
        for key in (*SIZES, "batch", "hit", "hold"):
            row = _row(side, key)
            if row and "error" in row:
                out.append(f"{name} {key}: {row['error']}")
            elif key == "hold" and row:
                said = [row["why"]] if row.get("why") else []
                if row.get("corrupt"):
                    said.append(f"{row['corrupt']:,} came back corrupt")
                if row.get("lost"):
                    said.append(f"{row['lost']:,} of the {row['put']:,} blocks whose put "
                                "answered OK were gone when read back")
                if said:
                    out.append(f"{name} hold: " + "; ".join(said))
    for name, why in report.get("missing", {}).items():
        out.append(f"{name}: not measured: {why}")
    return [*out, *report.get("notes", [])]


def _wrapped(lines: list[str]) -> list[str]:
    return [w for line in lines
            for w in textwrap.wrap(line, WIDTH, subsequent_indent="    ") or [""]]


def render(report: dict[str, Any]) -> str:
    """The three tables, the goals and the notes, every line at most ``WIDTH``."""
    return "\n".join([timing_table(report), "", hold_table(report), "", ratio_table(report),
                      "", *_wrapped(goal_lines(report)), "", *_wrapped(notes(report))])
