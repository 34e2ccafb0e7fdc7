"""``bench_load.py``'s table: each measurement against its reference, with its goal.

Rows are built from the results ``bench_load.py`` measures (and stores in
its JSON): medians of the per-repetition ratios, so a ratio compares the
two sides of one repetition.  ``one`` is the UCX path's, ``one_same_host``
(when measured) the same rows over the same-host path, marked "(same
host)".  Goals: the first ``load_model`` >= 0.8 x one warm ``store_tensor``
of the same bytes, and (issue 15, marked "(15)") at least 2.1 GB/s absolute,
ten times llama.cpp ``rpc-server``'s 0.21 GB/s
(issue 15's figure, not measured here); re-loads <= 10 % of the first load's
time and <= 1 % of its bytes; a fresh daemon's first store not below 1/6 of
a warm one; three nodes' aggregate >= 0.8 x the sum of their single stores.
Kept apart from ``bench_load.py`` (which sets the environment of the process
that imports it) so tests can build rows from numbers alone.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchkit import MiB
from benchkit.report import format_table

LOAD_GBPS_GOAL = 2.1  # issue 15: load_model of 1 GiB onto one node over tcp, GB/s
LLAMA_RPC_GBPS = 0.21  # issue 15's figure for llama.cpp rpc-server (10x is the goal)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def build_rows(res: dict[str, Any], nbytes: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(what: str, value: str, ref: str, ratio: float | None, goal: str,
            met: bool | None, **extra: Any) -> None:
        rows.append({"what": what, "value": value, "reference": ref, "ratio": ratio,
                     "goal": goal, "met": met, **extra})

    def gbs(seconds: float, n: int = nbytes) -> str:
        return f"{n / seconds / 1e9:.2f} GB/s"

    for path_key, on in (("one", ""), ("one_same_host", " (same host)")):
        one = res.get(path_key)
        if not one:
            continue
        store = med(one["store"])
        ratios = [s / f["seconds"] for s, f in zip(one["store"], one["first"], strict=True)]
        first = med([f["seconds"] for f in one["first"]])
        add(f"load_model, first{on}", gbs(first), f"store_tensor {gbs(store)}",
            med(ratios), ">= 0.8x", med(ratios) >= 0.8)
        speed = nbytes / first / 1e9
        add(f"load_model, first{on}", gbs(first),
            f"llama.cpp rpc-server {LLAMA_RPC_GBPS:g} GB/s (not run)", speed / LLAMA_RPC_GBPS,
            f">= {LOAD_GBPS_GOAL / LLAMA_RPC_GBPS:.0f}x = {LOAD_GBPS_GOAL:g} GB/s (15)",
            speed >= LOAD_GBPS_GOAL)
        ck = med(one["store_checksum"])
        ratios_ck = [s / f["seconds"] for s, f in zip(one["store_checksum"], one["first"],
                                                       strict=True)]
        add(f"load_model, first{on}", gbs(first),
            f"store_tensor verify=checksum {gbs(ck)}", med(ratios_ck), "-", None)
        if one.get("first_requested"):
            req = one["first_requested"]
            r_req = [s / f["seconds"] for s, f in zip(one["store"], req, strict=True)]
            add(f"load_model, first{on}, slot buffer requested before (not timed: "
                f"{med([f['request_seconds'] for f in req]) * 1e3:.0f} ms)",
                gbs(med([f["seconds"] for f in req])), f"store_tensor {gbs(store)}",
                med(r_req), "-", None)
        for key, label in (("same_name", "re-load, same name"),
                           ("new_name", "re-load, new name"),
                           ("new_name_no_hash_cache", "re-load, new name, no hash cache"),
                           ("new_name_requested",
                            "re-load, new name, slot buffer requested before")):
            if not one.get(key):
                continue
            t = [x["seconds"] / f["seconds"] for x, f in zip(one[key], one["first"],
                                                              strict=True)]
            b = [x["bytes_sent"] / max(1, f["bytes_sent"]) for x, f in zip(one[key],
                                                                            one["first"],
                                                                            strict=True)]
            secs = med([x["seconds"] for x in one[key]])
            goal = key != "new_name_requested"  # a breakdown, not what the goal measures
            add(f"{label}{on}: time", f"{secs * 1e3:.0f} ms", f"first load {first * 1e3:.0f} ms",
                med(t), "<= 0.10x" if goal else "-", med(t) <= 0.10 if goal else None)
            add(f"{label}{on}: bytes",
                f"{med([x['bytes_sent'] for x in one[key]]) / MiB:.2f} MiB",
                f"first load {nbytes / MiB:.0f} MiB", med(b), "<= 0.01x" if goal else "-",
                med(b) <= 0.01 if goal else None)
    one = res.get("one")
    cold = res.get("cold")
    if cold:
        r = [w / c for w, c in zip(cold["warm_store"], cold["cold_store"], strict=True)]
        add("first store_tensor into a fresh daemon", gbs(med(cold["cold_store"])),
            f"same buffer again {gbs(med(cold['warm_store']))}", med(r), "> 0.17x (1/6)",
            med(r) > 1 / 6)
        both = [q + c for q, c in zip(cold["request"], cold["cold_store"], strict=True)]
        rb = [w / b for w, b in zip(cold["warm_store"], both, strict=True)]
        add("request_buffer + first store, fresh daemon", gbs(med(both)),
            f"same buffer again {gbs(med(cold['warm_store']))}", med(rb), "-", None,
            request_seconds=med(cold["request"]))
        if cold.get("prefault_request"):
            add("--prefault: request_buffer (backs the new buffer)",
                f"{med(cold['prefault_request']):.2f} s", f"{nbytes / MiB:.0f} MiB buffer",
                None, "-", None)
            ra = [w / a for w, a in zip(cold["warm_store"], cold["after_prefault_store"],
                                        strict=True)]
            add("first store, --prefault daemon", gbs(med(cold["after_prefault_store"])),
                f"same buffer again {gbs(med(cold['warm_store']))}", med(ra), "-", None)
        if one:
            secs = med([x["seconds"] for x in cold["cold_load"]])
            store = med(one["store"])
            add("load_model into a fresh daemon", gbs(secs),
                f"warm store_tensor {gbs(store)}", store / secs, "-", None)
    net = res.get("netns")
    if net:
        if "skipped" in net:
            add("load_model, 3 nodes (netns, tcp)", "skipped", net["skipped"], None, ">= 0.8x",
                None)
        else:
            agg = [n / s for n, s in zip([net["bytes"]] * len(net["load"]), net["load"],
                                         strict=True)]
            sums = net["sum_single"]
            r = [a / s for a, s in zip(agg, sums, strict=True)]
            add("load_model, 3 nodes (netns, tcp), aggregate", f"{med(agg) / 1e9:.2f} GB/s",
                f"sum of single stores {med(sums) / 1e9:.2f} GB/s", med(r), ">= 0.8x",
                med(r) >= 0.8)
            serial = [net["bytes"] / sum(one) for one in net["single"]]
            rs = [a / s for a, s in zip(agg, serial, strict=True)]
            add("load_model, 3 nodes (netns, tcp), aggregate", f"{med(agg) / 1e9:.2f} GB/s",
                f"the three stores one after another {med(serial) / 1e9:.2f} GB/s", med(rs),
                "-", None)
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    head = ["what", "value", "reference", "ratio", "goal", "met"]
    lines = [[r["what"], r["value"], r["reference"],
              "-" if r["ratio"] is None else f"{r['ratio']:.3f}x", r["goal"],
              "-" if r["met"] is None else ("yes" if r["met"] else "NO")] for r in rows]
    return format_table(head, lines, right={1, 3})
