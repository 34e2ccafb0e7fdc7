"""The peers' configurations in ``bench_peers.py`` and running one: target, initiator, results.

A configuration is a peer (its venv, its module) plus the environment its
two processes get: Mooncake over tcp (its queue per peer raised for the
10,000-item batch, its tcp transport bound to 127.0.0.1), NIXL over UCX tcp
(UCX's own defaults, as a user gets them), NIXL over UCX tcp with the 2 MiB
segments rpcbuf uses (so the tcp comparison cannot be blamed on UCX's small
default segments), and NIXL over UCX shared memory.  Each process starts
from this environment less every ``UCX*`` variable (ours are tuned for
rpcbuf) and plus the configuration's own.

``run_config`` starts the target, waits for its ready file, runs the
initiator to the end (bounded), stops the target, and returns the samples
or the reason it failed (the log's last lines): a failure is a row in the
table, never a crash.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import benchkit
from _bench_peers_child import PeerPlan
from benchkit import procs


@dataclass(frozen=True)
class PeerConfig:
    key: str  # JSON key and table name
    peer: str  # which venv (_bench_peers_setup.PACKAGES)
    label: str  # the table's words (NIXL always runs over UCX: "NIXL tcp" is NIXL/UCX tcp)
    env: dict[str, str] = field(default_factory=dict)


UCX_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
CONFIGS = (
    PeerConfig("mooncake_tcp", "mooncake", "Mooncake TE tcp",
               {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "20000",
                "MC_TCP_BIND_ADDRESS": "127.0.0.1"}),
    PeerConfig("nixl_tcp", "nixl", "NIXL tcp", UCX_TCP),
    PeerConfig("nixl_tcp_2m", "nixl", "NIXL tcp 2 MiB segs",
               {**UCX_TCP, "UCX_TCP_TX_SEG_SIZE": "2m", "UCX_TCP_RX_SEG_SIZE": "2m"}),
    PeerConfig("nixl_shm", "nixl", "NIXL shm", {"UCX_TLS": "sm,self"}),
)
MODULES = {"mooncake": "_bench_peers_mooncake.py", "nixl": "_bench_peers_nixl.py"}


def peer_env(cfg: PeerConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX")}
    env.update(cfg.env)
    env["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    return env


def _log_reason(log: Path) -> str:
    """The last meaningful lines of a child's log (glog's info lines left out)."""
    lines = [ln for ln in procs.tail(log, 200).splitlines()
             if ln.strip() and not ln.startswith(("I1", "I0"))]
    return " | ".join(ln.strip() for ln in lines[-3:]) or "(no output)"


def run_config(cfg: PeerConfig, python: Path, tmp: Path, plan: PeerPlan,
               timeout: float = 300.0) -> dict[str, Any]:
    """One configuration, both processes: {"ok": True, samples...} or {"ok": False, "reason"}."""
    script = str(benchkit.SCRIPTS / MODULES[cfg.peer])
    env = peer_env(cfg)
    ready, out = tmp / f"{cfg.key}.ready", tmp / f"{cfg.key}.json"
    tlog, ilog = tmp / f"{cfg.key}-target.log", tmp / f"{cfg.key}-initiator.log"
    target: subprocess.Popen[bytes] | None = None
    initiator: subprocess.Popen[bytes] | None = None
    started = time.monotonic()
    try:
        target = procs.spawn([str(python), script, "target", "--ready-file", str(ready),
                              "--deadline", str(timeout + 60)], tlog, env)
        deadline = started + 90
        while not ready.exists():  # each pass sleeps 20 ms, bounded by the deadline
            if target.poll() is not None:
                return {"ok": False, "reason": f"target exited {target.returncode}: "
                                               f"{_log_reason(tlog)}"}
            if time.monotonic() > deadline:
                return {"ok": False, "reason": f"target not ready in 90 s: {_log_reason(tlog)}"}
            time.sleep(0.02)
        initiator = procs.spawn([str(python), script, "initiator", "--ready-file", str(ready),
                                 "--out", str(out), "--plan", json.dumps(plan.__dict__),
                                 "--deadline", str(timeout)], ilog, env)
        try:
            rc = initiator.wait(timeout + 30)
        except subprocess.TimeoutExpired:
            return {"ok": False, "reason": f"initiator ran past {timeout + 30:.0f} s: "
                                           f"{_log_reason(ilog)}"}
        if rc != 0 or not out.exists():
            return {"ok": False, "reason": f"initiator exited {rc}: {_log_reason(ilog)}"}
        results: dict[str, Any] = json.loads(out.read_text())
        results["ok"] = True
        results["env"] = cfg.env
        return results
    finally:
        procs.stop(initiator, 5)
        procs.stop(target, 10)
