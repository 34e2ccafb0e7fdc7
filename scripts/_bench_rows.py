"""``bench.py``'s table: the measured numbers as rows of rpcbuf against a reference.

Each row holds rpcbuf's value, the reference's, their ratio (always rpcbuf /
reference: for a time row lower is better, for a throughput row higher) and
the goal that applies to it, if any (``_bench_plan``: the first round's goals,
DESIGN.md's, and issue 15's, which the goal column marks "(15)"; a row with
two goals is two rows, one goal each, so "met" always answers one question).  Rows are built
from the JSON ``bench.py`` writes, so a stored ``bench.json`` can be
re-rendered (``bench.py --render``): a section the run skipped (``--only``)
adds no rows, and a number a stored run lacks (an older shape) drops its row,
or, for a goal row, makes it say "not measured", never an error.

The table stays within about 100 columns: values are medians (the p99s are in
the JSON), and the words the rows share are spelled out once, in the notes
printed under it (``notes``).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

from _bench_plan import (
    BATCH_VS_ONE,
    BATCH_VS_STREAM,
    BIG,
    IDLE_GOAL_PERCENT,
    PAIR_VS_ECHO,
    PIPELINED_GOAL,
    PIPELINED_VS_ECHO_15,
    RTT_BYTES,
    SAME_HOST_VS_COPY,
    SAME_HOST_VS_COPY_15,
    SAME_HOST_VS_COPY_35,
    SAME_HOST_VS_TCP_15,
    SMALL,
    SMALL_VS_COPY_35,
    SMALL_VS_RTT,
    SMALL_VS_UCXX_15,
    TCP_VS_SOCKET,
    TCP_VS_UCXX,
    Goal,
)
from benchkit import MiB, size_name
from benchkit.report import format_table

NOT_MEASURED = "not measured"
WIDTH = 100  # the notes' lines, and what the table aims to stay within


@dataclass
class Row:
    what: str
    value: str
    reference: str
    ref_value: str
    ratio: float | None = None
    goal: str = "-"
    met: bool | None = None


def dig(d: Any, *keys: str) -> Any:
    """``d[k0][k1]...``, or None where a key (or a dict on the way) is missing."""
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _positive(s: Any, key: str) -> float | None:
    v = dig(s, key)
    if isinstance(v, int | float) and not isinstance(v, bool) and v > 0:
        return float(v)
    return None


def _us(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:,.2f} s"
    return f"{us / 1000:,.1f} ms" if us >= 10_000 else f"{us:,.0f} us"


def _gbps(g: float) -> str:
    return f"{g:.2f} GB/s" if g >= 1 else f"{g:.3f} GB/s"


KINDS = {"time": ("p50_us", _us), "gbps": ("gbps_p50", _gbps)}


def compare(what: str, kind: str, ours: Any, ref_name: str, ref: Any,
            goal: Goal | None = None) -> Row | None:
    """rpcbuf's summary against a reference's: ``kind`` "time" (p50: ratio
    ours / theirs, lower is better) or "gbps" (GB/s at the median, higher is
    better).  Either missing: None, or for a goal row a "not measured" row."""
    key, show = KINDS[kind]
    a, b = _positive(ours, key), _positive(ref, key)
    if a is None or b is None:
        if goal is None:
            return None
        return Row(what, NOT_MEASURED if a is None else show(a), ref_name,
                   NOT_MEASURED if b is None else show(b), None, goal.text(), None)
    ratio = a / b
    return Row(what, show(a), ref_name, show(b), ratio, goal.text() if goal else "-",
               goal.met(ratio) if goal else None)


def _add(rows: list[Row], row: Row | None) -> None:
    if row is not None:
        rows.append(row)


SIZES = {size_name(n): n for n in (SMALL, MiB, BIG)}  # a JSON key -> its size, if a row lacks it
PATHS = (("rpcbuf_tcp", "tcp"), ("rpcbuf_same_host", "same-host"))
REF_NAMES = {"raw_ucxx": {"store": "raw ucxx send+ack", "read": "raw ucxx req+recv"},
             "raw_socket": {"store": "raw sock send+ack", "read": "raw sock req+recv"}}


def data_rows(data: Any) -> list[Row]:
    """Per size and direction: both paths against raw ucxx, the raw socket,
    ``np.copyto`` and (4 KiB) each other and the socket's 40-byte round trip."""
    rows: list[Row] = []
    if not isinstance(data, dict):
        return rows
    for name, ops in data.items():
        nbytes = (dig(ops, "store", "rpcbuf_tcp", "nbytes")
                  or dig(ops, "read", "rpcbuf_tcp", "nbytes") or SIZES.get(name))
        big, small = nbytes == BIG, nbytes == SMALL
        for op in ("store", "read"):
            d = dig(ops, op)
            if not isinstance(d, dict):
                continue
            ucxx, sock = REF_NAMES["raw_ucxx"][op], REF_NAMES["raw_socket"][op]
            tcp, local = d.get("rpcbuf_tcp"), d.get("rpcbuf_same_host")
            store_small = small and op == "store"
            _add(rows, compare(f"{op} {name} p50, tcp", "time", tcp, ucxx, d.get("raw_ucxx"),
                               SMALL_VS_UCXX_15 if store_small else None))
            _add(rows, compare(f"{op} {name} GB/s, tcp", "gbps", tcp, ucxx, d.get("raw_ucxx"),
                               TCP_VS_UCXX if big else None))
            if big:
                _add(rows, compare(f"{op} {name} GB/s, tcp", "gbps", tcp, sock,
                                   d.get("raw_socket"), TCP_VS_SOCKET))
            _add(rows, compare(f"{op} {name} p50, same-host", "time", local, ucxx,
                               d.get("raw_ucxx")))
            if small:
                _add(rows, compare(f"{op} {name} p50, same-host", "time", local, "rpcbuf tcp",
                                   tcp, SAME_HOST_VS_TCP_15 if op == "store" else None))
                _add(rows, compare(f"{op} {name} p50, same-host", "time", local, "np.copyto",
                                   d.get("memcpy"), SMALL_VS_COPY_35 if op == "store" else None))
            if isinstance(nbytes, int) and nbytes >= MiB:
                goals = (SAME_HOST_VS_COPY, SAME_HOST_VS_COPY_15) if big else (
                    (SAME_HOST_VS_COPY_35,) if nbytes == MiB else (None,))
                for goal in goals:
                    _add(rows, compare(f"{op} {name} GB/s, same-host", "gbps", local,
                                       "np.copyto", d.get("memcpy"), goal))
            rtt = d.get("raw_socket_rtt_40B")
            if rtt is not None:
                for key, label in PATHS:
                    _add(rows, compare(f"{op} {name} p50, {label}", "time", d.get(key),
                                       f"raw sock {RTT_BYTES} B RTT", rtt, SMALL_VS_RTT))
    return rows


def control_rows(control: Any) -> list[Row]:
    """Per path: request+release one pair at a time against two echos (and
    each op against one), and pipelined against pipelined echos."""
    rows: list[Row] = []
    for key, label in (("same_host", "same-host"), ("tcp", "tcp")):
        c = dig(control, key)
        if not isinstance(c, dict):
            continue
        ours, ref = dig(c, "sequential", "rpcbuf"), dig(c, "sequential", "echo")
        _add(rows, compare(f"req+rel pair p50, {label}", "time", dig(ours, "pair"),
                           "2 msgpack echos", dig(ref, "pair"), PAIR_VS_ECHO))
        for op, field, echo in (("request", "request_buffer", "first"),
                                ("release", "release_buffer", "second")):
            _add(rows, compare(f"{op} p50, {label}", "time", dig(ours, field), "1 msgpack echo",
                               dig(ref, echo)))
        pipe = dig(c, "pipelined")
        ops = _positive(dig(pipe, "rpcbuf"), "ops_per_s")
        echos = _positive(dig(pipe, "echo"), "echos_per_s")
        what = f"pipelined x{dig(pipe, 'concurrency') or '?'}, {label}"
        value = NOT_MEASURED if ops is None else f"{ops:,.0f}/s"
        rows.append(Row(what, value, "-", "-", None, f">= {PIPELINED_GOAL:,}/s",
                        None if ops is None else ops >= PIPELINED_GOAL))
        goal = PIPELINED_VS_ECHO_15
        ratio = None if ops is None or echos is None else ops / echos
        rows.append(Row(what, value, "pipelined echos",
                        NOT_MEASURED if echos is None else f"{echos:,.0f}/s", ratio,
                        goal.text(), None if ratio is None else goal.met(ratio)))
    return rows


def batching_rows(b: Any, label: str) -> list[Row]:
    """Against one op on a single 40 MiB array: time / its time, lower is
    better; against the raw socket stream: throughput / its throughput (the
    same 40,960,000 bytes), higher is better."""
    rows: list[Row] = []
    if not isinstance(b, dict):
        return rows
    n = b.get("tensors")
    count = f"{n // 1000}k" if isinstance(n, int) and n % 1000 == 0 and n else f"{n}"
    one = f"one {size_name(b['one_tensor_bytes'])}" if isinstance(
        b.get("one_tensor_bytes"), int) else "one array"
    for what, key, ref_key, ref, time_goal, stream, stream_goal in (
            (f"store_tensors {count}", "store_tensors", "one_store", f"{one} store",
             BATCH_VS_ONE, True, BATCH_VS_STREAM),
            (f"store_batch {count}", "store_batch", "one_store", f"{one} store", None, True,
             None),
            (f"naive loop {count}", "naive_loop", "one_store", f"{one} store", None, False,
             None),
            (f"load_tensors {count}", "load_tensors", "one_read", f"{one} read", None, True,
             None)):
        ours = dig(b, key, "rpcbuf")
        _add(rows, compare(f"{what}, {label}", "time", ours, ref, dig(b, key, ref_key),
                           time_goal))
        if stream:
            _add(rows, compare(f"{what}, {label}", "gbps", ours, "raw sock stream",
                               dig(b, key, "raw_socket_stream"), stream_goal))
    return rows


def idle_rows(idle: Any) -> list[Row]:
    goal = f"~0 % (< {IDLE_GOAL_PERCENT:g} %)"
    rows: list[Row] = []
    for what, keys, has_goal in (
            ("daemon idle CPU, no client", ("before_clients", "daemon_percent"), True),
            ("daemon idle CPU, 2 contexts", ("connected", "daemon_percent"), True),
            ("client idle CPU, 2 contexts", ("connected", "client_percent"), False)):
        v = dig(idle, *keys)
        num = isinstance(v, int | float) and not isinstance(v, bool)
        if not num and not has_goal:
            continue
        rows.append(Row(what, f"{v:.1f} %" if num else NOT_MEASURED, "-", "-", None,
                        goal if has_goal else "-",
                        (v < IDLE_GOAL_PERCENT) if num and has_goal else None))
    return rows


def build_rows(results: dict[str, Any]) -> list[Row]:
    """Every row, in the order of the table: data, control, batching, idle."""
    rows: list[Row] = []
    if "data" in results:
        rows += data_rows(results["data"])
    if "control" in results:
        rows += control_rows(results["control"])
    if "batching" in results:
        for key, label in (("same_host", "same-host"), ("tcp", "tcp")):
            rows += batching_rows(dig(results, "batching", key), label)
    if "idle" in results:
        rows += idle_rows(results["idle"])
    return rows


def notes(results: dict[str, Any], width: int = WIDTH) -> list[str]:
    """The lines under the table: what its shared words mean."""
    said = ["ratio = rpcbuf / reference: for p50 and time rows lower is better, for GB/s and /s "
            "rows higher. goal (15): issue 15's; unmarked: the first round's. tcp: the UCX "
            "path over loopback; same-host: the default context's path here. p50: the median "
            "per op (the p99s are in the JSON). raw sock: a plain blocking TCP socket."]
    if "control" in results:
        conc = dig(results, "control", "tcp", "pipelined", "concurrency") or "N"
        unix = dig(results, "control", "same_host", "echo_over") == "unix"
        said.append("request, release: request_buffer(4096), release_buffer; req+rel pair: "
                    f"the two, one after the other; pipelined x{conc}: pairs from {conc} "
                    "workers on one connection. echos: a bare msgpack echo server with the "
                    "daemon's framing, " + (
                        "over a Unix socket for the same-host rows (as their control channel) "
                        "and TCP for the tcp rows." if unix else "over TCP."))
    b = dig(results, "batching", "tcp") or dig(results, "batching", "same_host")
    n, size = dig(b, "tensors"), dig(b, "tensor_bytes")
    if isinstance(n, int) and isinstance(size, int):
        naive = f"naive loop: {n:,} store_tensor calls"
        timed, scaled = dig(b, "naive_loop", "timed_tensors"), dig(b, "naive_loop", "scaled_by")
        if isinstance(timed, int) and timed != n and isinstance(scaled, int | float):
            naive += f" ({timed:,} timed, the time x{scaled:g})"
        total = dig(b, "total_bytes")
        stream = (f"; raw sock stream: the same {total:,} bytes as one send (read: one "
                  "request)") if isinstance(total, int) else ""
        said.append(f"store_tensors {n // 1000}k and the like: {n:,} tensors of "
                    f"{size_name(size)} in one call; {naive}{stream}.")
    return [line for para in said for line in textwrap.wrap(para, width)]
def _ratio(r: float | None) -> str:
    if r is None:
        return "-"
    return f"{r:.0f}x" if r >= 100 else f"{r:.2f}x"


def render(rows: list[Row], under: list[str] | None = None) -> str:
    """The aligned table (numbers right-aligned), then the ``under`` lines."""
    table = format_table(
        ("what", "rpcbuf", "reference", "its value", "ratio", "goal", "met"),
        [(r.what, r.value, r.reference, r.ref_value,
          _ratio(r.ratio), r.goal,
          "-" if r.met is None else ("yes" if r.met else "NO")) for r in rows],
        right={1, 3, 4})
    return "\n".join([table, *(under or [])])
