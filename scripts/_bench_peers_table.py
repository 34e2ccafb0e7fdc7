"""``bench_peers.py``'s table: rpcbuf on each path against each peer and reference, as ratios.

One row per measurement and comparison: the peer's (or reference's) value,
rpcbuf's over tcp and same-host, and each ratio rpcbuf / peer.  For a time
row (4 KiB write+ack p50, the 10,000-item batch) lower is better; for a
throughput row (1 MiB, 64 MiB, GB/s at the median) higher is better, and the
last column says which.  A peer that failed to install or run is one row
naming it and the reason.  Rows are built from the JSON ``bench_peers.py``
writes (the summaries), so a stored ``bench_peers.json`` can be re-rendered.
"""

from __future__ import annotations

from typing import Any

from benchkit.report import format_table

ROWS = (  # key, words, what counts (time: p50, lower is better; GB/s: higher)
    ("write_4k", "4 KiB write+ack p50", "time"),
    ("write_1m", "1 MiB write throughput", "gbps"),
    ("write_64m", "64 MiB write throughput", "gbps"),
    ("batch_10000x4k", "10,000 x 4 KiB, one batch", "time"),
)
OURS = (("rpcbuf_tcp", "tcp"), ("rpcbuf_same_host", "same-host"))
REFS = {"raw_ucxx": "raw ucxx tuned (tcp)", "memcpy": "np.copyto, 1 thread"}


def _value(s: dict[str, Any], kind: str) -> str:
    if kind == "gbps":
        return f"{s['gbps_p50']:.2f} GB/s"
    us = s["p50_us"]
    return f"{us / 1000:,.1f} ms" if us >= 10_000 else f"{us:,.0f} us"


def _ratio(ours: dict[str, Any], ref: dict[str, Any], kind: str) -> float:
    if kind == "gbps":
        return float(ours["gbps_p50"] / ref["gbps_p50"])
    return float(ours["p50_us"] / ref["p50_us"])


def build_rows(report: dict[str, Any]) -> list[list[str]]:
    """The table's rows from a report's ``summaries`` and ``peers``."""
    summ: dict[str, dict[str, Any]] = report["summaries"]
    labels = {**REFS, **{k: p["label"] for k, p in report["peers"].items()}}
    rows: list[list[str]] = []
    for key, words, kind in ROWS:
        for ref_key, label in labels.items():
            ref = summ.get(ref_key, {}).get(key)
            if ref is None or (ref_key == "memcpy" and kind == "time"):
                continue  # a copy of 4 KiB in one process is no reference for a round trip
            row = [words, label, _value(ref, kind)]
            for side, _ in OURS:
                ours = summ.get(side, {}).get(key)
                row += (["-", "-"] if ours is None else
                        [_value(ours, kind), f"{_ratio(ours, ref, kind):.2f}x"])
            row.append("lower" if kind == "time" else "higher")
            rows.append(row)
    return rows


def render(report: dict[str, Any]) -> str:
    header = ["what", "peer / reference", "its value", "rpcbuf tcp", "ratio",
              "rpcbuf same-host", "ratio", "better"]
    out = [format_table(header, build_rows(report), right={2, 3, 4, 5, 6})]
    failed = [(p["label"], p["reason"]) for p in report["peers"].values() if not p["ok"]]
    for label, reason in failed:
        out.append(f"{label}: NOT MEASURED: {reason}")
    out.append("ratio = rpcbuf / peer: for a time row lower is better, for a throughput row "
               "higher; every side ran the same operations in this one run")
    return "\n".join(out)
