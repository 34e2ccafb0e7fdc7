"""``bench_peers.py``'s tables: rpcbuf on each path against each peer and reference, and the goals.

The ratio table: one row per measurement and comparison, the peer's (or
reference's) value, rpcbuf's over tcp and same-host, and each ratio rpcbuf /
peer.  For a time row (4 KiB write+ack p50, the 10,000-item batch) lower is
better; for a throughput row (1 MiB, 64 MiB, GB/s at the median) higher is
better, and the last column says which.  A peer that failed to install or
run is one line naming it and the reason.

The goals table: issue 15's goals that need a peer, or that this run
measures anyway (``GOALS``), one row each with rpcbuf's value, the
reference's, the ratio, the goal and whether it is met; a reference this run
did not measure (a peer that failed, or a stored run without it) is a row
that says "not measured" and why.  ``bench.py`` has the goals it can measure
alone.

Both are built from the JSON ``bench_peers.py`` writes (the summaries and
the peers' results), so a stored ``bench_peers.json`` can be re-rendered
(``bench_peers.py --render``); missing numbers never raise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from _bench_peers_run import CONFIGS
from _bench_plan import Goal, at_least, at_most
from benchkit.report import format_table

ROWS = (  # key, words, what counts (time: p50, lower is better; GB/s: higher)
    ("write_4k", "4 KiB write+ack p50", "time"),
    ("write_1m", "1 MiB write GB/s", "gbps"),
    ("write_64m", "64 MiB write GB/s", "gbps"),
    ("batch_10000x4k", "10k x 4 KiB batch", "time"),
)
KIND = {key: kind for key, _, kind in ROWS}
OURS = (("rpcbuf_tcp", "tcp"), ("rpcbuf_same_host", "same-host"))
REFS = {"raw_ucxx": "raw ucxx, tuned", "memcpy": "np.copyto, 1 thread"}
PEER_KEYS = tuple(c.key for c in CONFIGS)
LABELS = {**REFS, "rpcbuf_tcp": "rpcbuf tcp", "rpcbuf_same_host": "rpcbuf same-host",
          **{c.key: c.label for c in CONFIGS}}


@dataclass(frozen=True)
class PeerGoal:
    what: str
    key: str  # which measurement (ROWS)
    side: str  # rpcbuf's side (OURS)
    ref: str  # the reference's key in the summaries (a peer's config key, REFS, rpcbuf_tcp)
    goal: Goal


GOALS = (  # issue 15 (performance round 2)
    PeerGoal("4 KiB p50, tcp", "write_4k", "rpcbuf_tcp", "mooncake_tcp",
             at_most(1.0)),
    PeerGoal("4 KiB p50, tcp", "write_4k", "rpcbuf_tcp", "raw_ucxx", at_most(1.5)),
    PeerGoal("4 KiB p50, same-host", "write_4k", "rpcbuf_same_host", "rpcbuf_tcp",
             at_most(0.5)),
    PeerGoal("64 MiB GB/s, tcp", "write_64m", "rpcbuf_tcp", "raw_ucxx", at_least(0.9)),
    PeerGoal("64 MiB GB/s, tcp", "write_64m", "rpcbuf_tcp", "mooncake_tcp",
             at_least(2.0)),
    PeerGoal("64 MiB GB/s, tcp", "write_64m", "rpcbuf_tcp", "nixl_tcp", at_least(2.0)),
    PeerGoal("64 MiB GB/s, tcp", "write_64m", "rpcbuf_tcp", "nixl_tcp_2m", at_least(2.0)),
    PeerGoal("64 MiB GB/s, same-host", "write_64m", "rpcbuf_same_host", "memcpy",
             at_least(1.0)),
    PeerGoal("10k batch, tcp", "batch_10000x4k", "rpcbuf_tcp", "nixl_tcp",
             at_most(0.33)),
    PeerGoal("10k batch, tcp", "batch_10000x4k", "rpcbuf_tcp", "nixl_tcp_2m",
             at_most(0.33)),
    PeerGoal("10k batch, same-host", "batch_10000x4k", "rpcbuf_same_host", "nixl_shm",
             at_most(1.0)),
)


@dataclass
class GoalRow:
    what: str
    value: str
    reference: str
    ref_value: str
    ratio: float | None
    goal: str
    met: bool | None
    reason: str = ""  # why it is not measured ("" when it is)


def _stat(s: Any, kind: str) -> float | None:
    v = s.get("gbps_p50" if kind == "gbps" else "p50_us") if isinstance(s, dict) else None
    if isinstance(v, int | float) and not isinstance(v, bool) and v > 0:
        return float(v)
    return None


def _value(s: Any, kind: str) -> str:
    v = _stat(s, kind)
    if v is None:
        return "-"
    if kind == "gbps":
        return f"{v:.2f} GB/s"
    return f"{v / 1000:,.1f} ms" if v >= 10_000 else f"{v:,.0f} us"


def _ratio(ours: Any, ref: Any, kind: str) -> float | None:
    a, b = _stat(ours, kind), _stat(ref, kind)
    return None if a is None or b is None else a / b


def _summaries(report: dict[str, Any]) -> dict[str, Any]:
    summ = report.get("summaries")
    return summ if isinstance(summ, dict) else {}


def _peers(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    peers = report.get("peers")
    return {k: v for k, v in peers.items() if isinstance(v, dict)} if isinstance(
        peers, dict) else {}


def _label(key: str, peers: dict[str, dict[str, Any]]) -> str:
    return str(peers.get(key, {}).get("label") or LABELS.get(key, key))


def build_rows(report: dict[str, Any]) -> list[list[str]]:
    """The ratio table's rows from a report's ``summaries`` and ``peers``."""
    summ, peers = _summaries(report), _peers(report)
    refs = [*REFS, *(k for k in peers if k not in REFS)]
    rows: list[list[str]] = []
    for key, words, kind in ROWS:
        for ref_key in refs:
            ref = summ.get(ref_key, {}).get(key) if isinstance(summ.get(ref_key), dict) else None
            if _stat(ref, kind) is None or (ref_key == "memcpy" and kind == "time"):
                continue  # a copy of 4 KiB in one process is no reference for a round trip
            row = [words, _label(ref_key, peers), _value(ref, kind)]
            for side, _ in OURS:
                ours = summ.get(side, {}).get(key) if isinstance(summ.get(side), dict) else None
                r = _ratio(ours, ref, kind)
                row += [_value(ours, kind), "-" if r is None else f"{r:.2f}x"]
            row.append("lower" if kind == "time" else "higher")
            rows.append(row)
    return rows


def _why_missing(key: str, report: dict[str, Any]) -> str:
    """Why reference (or rpcbuf side) ``key`` has no number in this report."""
    peer = _peers(report).get(key)
    if peer is not None and not peer.get("ok", False):
        return str(peer.get("reason") or "it failed (no reason recorded)")
    if key == "raw_ucxx":
        said = [n for n in report.get("notes") or [] if isinstance(n, str) and "raw ucxx" in n]
        return said[0].removeprefix("note: ") if said else "no raw ucxx numbers in this run"
    if key in PEER_KEYS and peer is None:
        return "not in this run"
    return f"no {LABELS.get(key, key)} numbers in this run"


def goal_rows(report: dict[str, Any]) -> list[GoalRow]:
    """One row per goal in ``GOALS``: measured (ratio, met) or why not."""
    summ, peers = _summaries(report), _peers(report)
    rows = []
    for g in GOALS:
        kind = KIND[g.key]
        ours = summ.get(g.side, {}).get(g.key) if isinstance(summ.get(g.side), dict) else None
        ref = summ.get(g.ref, {}).get(g.key) if isinstance(summ.get(g.ref), dict) else None
        ratio = _ratio(ours, ref, kind)
        reason = ""
        if ratio is None:
            missing = g.side if _stat(ours, kind) is None else g.ref
            reason = _why_missing(missing, report)
        rows.append(GoalRow(g.what, _value(ours, kind), _label(g.ref, peers), _value(ref, kind),
                            ratio, g.goal.text(), None if ratio is None else g.goal.met(ratio),
                            reason))
    return rows


def goals_json(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The goal rows as the JSON's ``goals``."""
    return [asdict(r) for r in goal_rows(report)]


def render_goals(report: dict[str, Any]) -> str:
    """The goals table; a row not measured points to its reason, printed under
    the table once per reference and reason: ``[1] NIXL tcp: why``."""
    reasons: dict[tuple[str, str], int] = {}
    rows = []
    for r in goal_rows(report):
        if r.met is None:
            n = reasons.setdefault((r.reference, r.reason), len(reasons) + 1)
            met = f"not measured [{n}]"
        else:
            met = "yes" if r.met else "NO"
        rows.append([r.what, r.value, r.reference, r.ref_value,
                     "-" if r.ratio is None else f"{r.ratio:.2f}x", r.goal, met])
    out = [format_table(["goal (issue 15)", "rpcbuf", "reference", "its value", "ratio", "goal",
                         "met"], rows, right={1, 3, 4})]
    out += [f"[{n}] {ref}: {why}" for (ref, why), n in reasons.items()]
    out.append("4 KiB p50: a 4 KiB write and its ack (median); 64 MiB GB/s: at the median; "
               "10k batch:")
    out.append("10,000 x 4 KiB in one call (rpcbuf: store_tensors); same ratios as above")
    return "\n".join(out)


def render(report: dict[str, Any]) -> str:
    header = ["what", "peer / reference", "its value", "rpcbuf tcp", "ratio",
              "same-host", "ratio", "better"]
    out = [format_table(header, build_rows(report), right={2, 3, 4, 5, 6})]
    failed = [(p.get("label", k), p.get("reason", "?")) for k, p in _peers(report).items()
              if not p.get("ok", False)]
    for label, reason in failed:
        out.append(f"{label}: NOT MEASURED: {reason}")
    out.append("ratio = rpcbuf / peer: for a time row lower is better, for a throughput row "
               "higher;")
    out.append("every side ran the same operations in this one run (10k: 10,000 items)")
    out += ["", render_goals(report)]
    return "\n".join(out)
