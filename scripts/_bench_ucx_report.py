"""What ``bench_ucx.py`` makes of its samples: per-configuration summaries
against the ``rpcbuf`` row, the tables it prints, and the protocols UCX chose.

``Agg`` collects one configuration's samples over all rounds and pairs;
``summarize`` takes medians of the pooled samples and, against the
reference, the median over rounds of the per-round ratio (both measured in
the same round), with how many rounds this configuration beat it.
``parse_proto_info`` reads the ``UCX_PROTO_INFO=y`` tables from a child's
log, so the table can say which protocol a size went by.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from _bench_ucx_config import BIG, REF, Config
from benchkit import KiB, MiB
from benchkit.report import format_table

_TITLE = re.compile(r"\|\s*(ucp_context_\d+ .*?cfg#\d+)\s*\|\s*(.+?)\s*\|\s*$")
_ROW = re.compile(r"\|\s*([0-9KMGTinf]+\.\.[0-9KMGTinf]+)\s*\|\s*(.+?)\s*\|\s*(.+?)\s*\|\s*$")
TAG_SEND = "tagged message by ucp_tag_send* from host memory"


def parse_proto_info(log: Path) -> dict[str, list[list[str]]]:
    """``{"<scope>: <operation>": [[range, protocol, transport], ...]}``."""
    tables: dict[str, list[list[str]]] = {}
    current: list[list[str]] | None = None
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            if m := _TITLE.search(line):
                current = tables.setdefault(f"{m[1]}: {m[2]}", [])
            elif current is not None and (m := _ROW.search(line)):
                if [m[1], m[2], m[3]] not in current:
                    current.append([m[1], m[2], m[3]])
    return tables


def _size(tok: str) -> float:
    if tok == "inf":
        return float("inf")
    units = {"K": KiB, "M": MiB, "G": 1 << 30, "T": 1 << 40}
    return float(tok[:-1]) * units[tok[-1]] if tok[-1] in units else float(tok)


def protocol_for(tables: dict[str, list[list[str]]], nbytes: int) -> str:
    """The tag-send protocol (and transport) UCX picked for ``nbytes``."""
    for title, rows in tables.items():
        if title.endswith(": " + TAG_SEND):
            for rng, proto, tl in rows:
                lo, hi = rng.split("..")
                if _size(lo) <= nbytes <= _size(hi):
                    return f"{proto} [{tl}]"
    return "?"


# -- summary --------------------------------------------------------------------------


def p50(xs: list[float]) -> float | None:
    return float(np.median(xs)) if xs else None


# (sample key, "time" or "rate"): how its "x ref" reads (rate: higher is better)
COMPARED = (("lat_4k", "time"), ("cold_4k", "time"), ("cold_1m", "time"),
            ("store_1m", "rate"), ("read_1m", "rate"), ("store_64m", "rate"),
            ("read_64m", "rate"))


@dataclass
class Agg:
    """Everything measured for one configuration, over all rounds and pairs."""

    cfg: Config
    samples: dict[str, list[float]] = field(default_factory=dict)
    by_round: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    idle: dict[str, float] | None = None
    proto_info: dict[str, dict[str, list[list[str]]]] = field(default_factory=dict)

    def add(self, rnd: int, samples: dict[str, list[float]]) -> None:
        for k, v in samples.items():
            self.samples.setdefault(k, []).extend(v)
            self.by_round.setdefault(rnd, {}).setdefault(k, []).extend(v)


def summarize(agg: Agg, ref: Agg | None) -> dict[str, Any]:
    """Medians of the pooled samples; against the reference, the median over
    rounds of the per-round ratio (both measured in the same round), and in how
    many rounds this configuration beat it."""
    s: dict[str, Any] = {"what": agg.cfg.what,
                         "n": {k: len(v) for k, v in agg.samples.items()}}
    for k, v in agg.samples.items():
        m = p50(v)
        if m is None:
            continue
        s[f"{k}_p50_us"] = m * 1e6
        nbytes = {"1m": MiB, "64m": BIG}.get(k.rsplit("_", 1)[-1])
        if nbytes is not None and not k.startswith("cold"):
            s[f"{k}_gbps"] = nbytes / m / 1e9
    for k, kind in COMPARED:
        if ref is None:
            break
        ratios = []
        for rnd, mine in agg.by_round.items():
            a, b = p50(mine.get(k, [])), p50(ref.by_round.get(rnd, {}).get(k, []))
            if a and b:
                ratios.append(a / b if kind == "time" else b / a)
        if ratios:
            s[f"{k}_x_ref"] = float(np.median(ratios))
            better = sum(r < 1 if kind == "time" else r > 1 for r in ratios)
            s[f"{k}_rounds_better"] = f"{better}/{len(ratios)}"
    if agg.idle:
        s["idle_server_pct"] = agg.idle["server_pct"]
        s["idle_client_pct"] = agg.idle["client_pct"]
    s["errors"] = agg.errors
    s["proto_info"] = agg.proto_info
    s["protocols"] = {name: protocol_for(agg.proto_info.get("client", {}), n)
                      for name, n in (("4K", 4 * KiB), ("1M", MiB), ("64M", BIG))}
    return s


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def ratio(v: float | None, ref: float | None) -> str:
    return "-" if v is None or not ref else f"{v / ref:.2f}x"


def wins(s: dict[str, Any]) -> str:
    """Rounds in which 64 MiB store, read beat the reference: "st,rd/rounds"."""
    st, rd = s.get("store_64m_rounds_better"), s.get("read_64m_rounds_better")
    if not st or not rd:
        return "-"
    return f"{st.split('/')[0]},{rd}"


def report(summary: dict[str, dict[str, Any]], dead: dict[str, Any]) -> str:
    ref = summary.get(REF, {})
    rows = []
    for key, s in summary.items():
        g = s.get

        def x(k: str, g: Callable[[str], Any] = g) -> str:
            return fmt(g(f"{k}_x_ref"), ".2f") + "x" if g(f"{k}_x_ref") is not None else "-"
        rows.append((
            key, fmt(g("lat_4k_p50_us"), ".0f"), x("lat_4k"),
            fmt(g("cold_4k_p50_us"), ".0f"), fmt(g("cold_1m_p50_us"), ".0f"),
            fmt(g("store_1m_gbps"), ".2f"), x("store_1m"), fmt(g("read_1m_gbps"), ".2f"),
            x("read_1m"), fmt(g("store_64m_gbps"), ".2f"), x("store_64m"),
            fmt(g("read_64m_gbps"), ".2f"), x("read_64m"),
            wins(s), fmt(g("idle_server_pct"), ".1f"), fmt(g("idle_client_pct"), ".1f"),
            "ERR" if s["errors"] else ""))
    out = [table(("config", "4K us", "x ref", "4K cold", "1M cold", "1M st", "x ref", "1M rd",
                  "x ref", "64M st", "x ref", "64M rd", "x ref", "64M wins", "idle srv%",
                  "idle cli%", ""), rows)]
    out.append("\n4K us: 4 KiB store round trip p50; cold: the same (and 1 MiB) after 25 ms "
               "quiet, p50 us; st/rd: GB/s at the median; x ref: median over rounds of the\n"
               "ratio to the rpcbuf row's in the same round (time: lower is better; GB/s: "
               "higher is better); 64M wins: rounds in which store, read beat rpcbuf's;\n"
               "idle: % of one core, server and client, connected and quiet")

    sm = summary.get("sm")
    if sm and sm.get("memcpy_64m_gbps"):
        mc = sm["memcpy_64m_gbps"]
        rows2 = [(name, fmt(sm.get(f"{k}_gbps"), ".2f"), ratio(sm.get(f"{k}_gbps"), mc))
                 for name, k in (("UCX sm store", "store_64m"), ("UCX sm read", "read_64m"),
                                 ("process_vm_readv (store)", "cma_store_64m"),
                                 ("process_vm_writev (read)", "cma_read_64m"),
                                 ("np.copyto (memcpy)", "memcpy_64m"))]
        out += ["", "same host, 64 MiB, one process pair, alternating:",
                table(("path", "GB/s", "x memcpy"), rows2)]
    if ref.get("multi_one_send_p50_us"):
        one = ref["multi_one_send_p50_us"]
        rows3 = [(name, fmt(ref.get(f"{k}_p50_us", 0) / 1e3, ".1f"),
                  ratio(ref.get(f"{k}_p50_us"), one))
                 for name, k in (("send_multi 10,000 x 4 KiB", "multi_send_multi"),
                                 ("loop of 10,000 send()", "multi_send_loop"),
                                 ("one 40,960,000 B send", "multi_one_send"))]
        out += ["", "batching on rpcbuf (tcp), time per batch incl. 1-byte ack:",
                table(("how", "ms p50", "x one send"), rows3)]
    if ref.get("lat_4k_core_p50_us"):
        out.append(f"\n4 KiB round trip, ucxx core API {ref['lat_4k_core_p50_us']:.0f} us vs "
                   f"asyncio Endpoint {ref['lat_4k_p50_us']:.0f} us "
                   f"({ratio(ref['lat_4k_core_p50_us'], ref['lat_4k_p50_us'])})")
    out += ["", "protocol UCX chose for tag send (UCX_PROTO_INFO):"]
    out.append(table(("config", "4 KiB", "1 MiB", "64 MiB"),
                     [(k, s["protocols"]["4K"], s["protocols"]["1M"], s["protocols"]["64M"])
                      for k, s in summary.items()], text=True))
    if dead:
        out += ["", "dead peer (client SIGKILLed mid-send; server receive bounded):"]
        for k, info in dead.items():
            after = info.get("ended_after_kill_s")
            timed_out = "timed out" in str(info.get("outcome"))
            out.append(f"  {k}: {info.get('completed_before', 0)} receives done, then "
                       f"{info.get('outcome')}"
                       + ("" if after is None or timed_out else f", {after:.3f} s after the kill")
                       + f"; server exit status {info.get('server_exit')}")
    errs = [(k, e) for k, s in summary.items() for e in s["errors"]]
    if errs:
        out += ["", "errors:"] + [f"  {k}: {e}" for k, e in errs]
    return "\n".join(out)



def table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]], text: bool = False) -> str:
    """Numbers right-aligned (``text``: every column left-aligned)."""
    return format_table(header, rows, right=() if text else None)
