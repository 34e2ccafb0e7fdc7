"""``bench.py``'s table: the measured numbers as rows of rpcbuf against a reference.

Each row holds rpcbuf's value, the reference's, their ratio (always rpcbuf /
reference: for a time row lower is better, for a throughput row higher) and
the goal that applies to it, if any (DESIGN.md "Performance goals"; the
numbers are in ``_bench_plan`` and in the rows below).  Rows are built from
the JSON ``bench.py`` writes, so a stored ``bench.json`` can be re-rendered;
a section the run skipped (``--only``) adds no rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from _bench_plan import BIG, IDLE_GOAL_PERCENT, PIPELINED_GOAL, RTT_BYTES
from benchkit import MiB, size_name
from benchkit.report import format_table


@dataclass
class Row:
    what: str
    value: str
    reference: str
    ref_value: str
    ratio: float | None = None
    goal: str = "-"
    met: bool | None = None


def _us(us: float) -> str:
    return f"{us / 1000:,.1f} ms" if us >= 10_000 else f"{us:,.0f} us"


def _lat(s: dict[str, Any]) -> str:
    return f"{_us(s['p50_us'])} (p99 {_us(s['p99_us'])})"


PATH_KEYS = (("rpcbuf_tcp", "tcp"), ("rpcbuf_same_host", "same-host"))
REF_NAMES = {"raw_ucxx": {"store": "raw ucxx send+ack", "read": "raw ucxx req+recv"},
             "raw_socket": {"store": "raw socket send+ack", "read": "raw socket req+recv"}}


def lat_row(what: str, ours: dict[str, Any], ref_name: str, ref: dict[str, Any],
            goal: float | None = None) -> Row:
    """A latency (time) row: ratio = ours / reference, lower is better."""
    ratio = ours["p50_us"] / ref["p50_us"]
    row = Row(what, _lat(ours), ref_name, _lat(ref), ratio)
    if goal is not None:
        row.goal, row.met = f"<= {goal:g}x", ratio <= goal
    return row


def thr_row(what: str, ours: dict[str, Any], ref_name: str, ref: dict[str, Any],
            goal: float | None = None) -> Row:
    """A throughput row: ratio = ours / reference (GB/s at the medians), higher is better."""
    ratio = ours["gbps_p50"] / ref["gbps_p50"]
    row = Row(what, f"{ours['gbps_p50']:.3f} GB/s", ref_name, f"{ref['gbps_p50']:.3f} GB/s",
              ratio)
    if goal is not None:
        row.goal, row.met = f">= {goal:g}x", ratio >= goal
    return row


def data_rows(data: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for name, ops in data.items():
        nbytes = ops["store"]["rpcbuf_tcp"]["nbytes"]
        big = nbytes == BIG
        for op in ("store", "read"):
            d = ops[op]
            ucxx_name, sock_name = REF_NAMES["raw_ucxx"][op], REF_NAMES["raw_socket"][op]
            tcp, local = d["rpcbuf_tcp"], d["rpcbuf_same_host"]
            rows.append(lat_row(f"{op} {name} p50, tcp", tcp, ucxx_name, d["raw_ucxx"]))
            rows.append(thr_row(f"{op} {name} throughput, tcp", tcp, ucxx_name, d["raw_ucxx"],
                                0.9 if big else None))
            if big:
                rows.append(thr_row(f"{op} {name} throughput, tcp", tcp, sock_name,
                                    d["raw_socket"], 1.5))
            rows.append(lat_row(f"{op} {name} p50, same-host", local, ucxx_name, d["raw_ucxx"]))
            if nbytes >= MiB:
                rows.append(thr_row(f"{op} {name} throughput, same-host", local, "np.copyto",
                                    d["memcpy"], 0.6 if big else None))
            rtt = d.get("raw_socket_rtt_40B")
            if rtt is not None:
                for key, label in PATH_KEYS:
                    rows.append(lat_row(f"{op} {name} p50, {label}", d[key],
                                        f"raw socket {RTT_BYTES} B round trip", rtt, 2.0))
    return rows


def control_rows(control: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for key, label in (("same_host", "same-host"), ("tcp", "tcp")):
        seq = control[key]["sequential"]
        ours, ref = seq["rpcbuf"], seq["echo"]
        rows.append(lat_row(f"request+release pair p50, {label}", ours["pair"],
                            "2 msgpack echos", ref["pair"], 2.0))
        for op, echo in (("request_buffer", "first"), ("release_buffer", "second")):
            rows.append(lat_row(f"{op} p50, {label}", ours[op], "1 msgpack echo", ref[echo]))
        pipe = control[key]["pipelined"]
        ops = pipe["rpcbuf"]["ops_per_s"]
        rows.append(Row(f"pipelined request+release ({pipe['concurrency']} in flight), {label}",
                        f"{ops:,.0f} ops/s", "pipelined echos",
                        f"{pipe['echo']['echos_per_s']:,.0f} /s",
                        ops / pipe["echo"]["echos_per_s"],
                        f">= {PIPELINED_GOAL:,} ops/s", ops >= PIPELINED_GOAL))
    return rows


def idle_rows(idle: dict[str, Any]) -> list[Row]:
    goal = f"~0 % (< {IDLE_GOAL_PERCENT:g} %)"
    before, after = idle["before_clients"], idle["connected"]
    return [
        Row("daemon idle CPU, before any client", f"{before['daemon_percent']:.1f} % of a core",
            "-", "-", None, goal, before["daemon_percent"] < IDLE_GOAL_PERCENT),
        Row("daemon idle CPU, 2 contexts connected", f"{after['daemon_percent']:.1f} % of a core",
            "-", "-", None, goal, after["daemon_percent"] < IDLE_GOAL_PERCENT),
        Row("client idle CPU, 2 contexts connected", f"{after['client_percent']:.1f} % of a core",
            "-", "-"),
    ]


def build_rows(results: dict[str, Any]) -> list[Row]:
    """Every row, in the order of the table: data, control, batching, idle."""
    rows: list[Row] = []
    if "data" in results:
        rows += data_rows(results["data"])
    if "control" in results:
        rows += control_rows(results["control"])
    if "batching" in results:
        for key, label in (("same_host", "same-host"), ("tcp", "tcp")):
            rows += batching_rows(results["batching"][key], label)
    if "idle" in results:
        rows += idle_rows(results["idle"])
    return rows


def _took(s: dict[str, Any]) -> str:
    return f"{_us(s['p50_us'])} ({s['gbps_p50']:.2f} GB/s)"


def batching_rows(b: dict[str, Any], label: str) -> list[Row]:
    """Against one op on a single 40 MiB array: time / its time, lower is
    better; against the raw socket stream: throughput / its throughput (the
    same 40,960,000 bytes), higher is better."""
    n, size = b["tensors"], size_name(b["tensor_bytes"])
    one = f"one {size_name(b['one_tensor_bytes'])}"
    naive = b["naive_loop"]
    naive_name = f"naive loop {n:,} x store_tensor"
    if naive["timed_tensors"] != n:
        naive_name += f" ({naive['timed_tensors']:,} timed, x{naive['scaled_by']:g})"
    stream = f"raw socket {b['total_bytes'] / 1e6:.2f} MB stream"
    rows = []
    for what, key, ref_key, ref, time_goal, sock_ref, sock_goal in (
            (f"{n:,} x {size} store_tensors", "store_tensors", "one_store", f"{one} store",
             3.0, f"{stream} (store)", 0.5),
            (f"{n:,} x {size} store_batch", "store_batch", "one_store", f"{one} store",
             None, f"{stream} (store)", None),
            (naive_name, "naive_loop", "one_store", f"{one} store", None, None, None),
            (f"{n:,} x {size} load_tensors", "load_tensors", "one_read", f"{one} read_buffer",
             None, f"{stream} (read)", None)):
        ours, theirs = b[key]["rpcbuf"], b[key][ref_key]
        ratio = ours["p50_us"] / theirs["p50_us"]
        row = Row(f"{what}, {label}", _took(ours), ref, _took(theirs), ratio)
        if time_goal is not None:
            row.goal, row.met = f"<= {time_goal:g}x", ratio <= time_goal
        rows.append(row)
        if sock_ref is not None:
            rows.append(thr_row(f"{what}, {label}", ours, sock_ref,
                                b[key]["raw_socket_stream"], sock_goal))
    return rows


def render(rows: list[Row]) -> str:
    """The aligned table (numbers right-aligned)."""
    return format_table(
        ("what", "rpcbuf", "reference", "reference value", "ratio", "goal", "met?"),
        [(r.what, r.value, r.reference, r.ref_value,
          "-" if r.ratio is None else f"{r.ratio:.2f}x", r.goal,
          "-" if r.met is None else ("yes" if r.met else "NO")) for r in rows],
        right={1, 3, 4})
