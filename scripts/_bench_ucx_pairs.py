"""The parent's side of ``bench_ucx.py``: one ``Pair`` of processes per
configuration, started, paused, woken for each command, and the rounds over them.

A pair is this script run twice more (``--role server`` and ``--role
client``) in the configuration's environment (``child_env``), started with
``benchkit.procs.spawn`` (own session; SIGKILL from the kernel should the
parent die: a paused child must not outlive it).  ``measure`` starts every
pair of a generation, each alone, pauses them (SIGSTOP), and runs the rounds:
each round wakes each pair in turn (SIGCONT) for one chunk of every
measurement, in an order that rotates and reverses, so drift hits every
configuration alike.  Every wait is bounded; a pair that fails is stopped,
asked nothing more, and its error lands in the table.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _bench_ucx_config import BIG, REF, Config, Plan, child_env
from _bench_ucx_report import Agg, parse_proto_info
from benchkit import SCRIPTS
from benchkit.procs import CHILDREN, spawn, stop, tail as _tail, wait_ready
from benchkit.report import progress_printer
from benchkit.timing import cpu_split, rotated

progress = progress_printer("bench_ucx")
SCRIPT = SCRIPTS / "bench_ucx.py"  # the children are this script with --role


def proto_line(line: str) -> bool:
    """A line of UCX_PROTO_INFO's tables (left out of log tails)."""
    return "ucp_context" in line or line.rstrip().endswith(("|", "+"))


def tail(path: Path, n: int = 8) -> str:
    """The log's last lines, without UCX_PROTO_INFO's tables."""
    return _tail(path, n, skip=proto_line)


def launch(cmd: list[str], env: dict[str, str], log: Path,
           **kw: Any) -> subprocess.Popen[bytes]:
    """A pair's process: SIGKILL, not SIGTERM, when the parent dies (it may be
    paused, and a stopped process does not act on SIGTERM)."""
    return spawn(cmd, log, env, death_signal=signal.SIGKILL, **kw)


def machine_cpu() -> tuple[float, float]:
    """(CPU seconds the whole machine has used, CPU seconds of this process and
    its children), to tell how much other processes took meanwhile."""
    return cpu_split([p.pid for p in CHILDREN]) or (0.0, 0.0)


def wait_file(path: Path, proc: subprocess.Popen[bytes] | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if proc is not None and proc.poll() is not None:
            return path.exists()
        time.sleep(0.02)
    return False



class Pair:
    """One configuration's server and client, kept alive (and paused with
    SIGSTOP while the other configurations measure) for the whole run."""

    def __init__(self, cfg: Config, plan: Plan, d: Path, extras: set[str]) -> None:
        self.cfg, self.plan, self.d, self.extras = cfg, plan, d, extras
        self.server: subprocess.Popen[bytes] | None = None
        self.client: subprocess.Popen[bytes] | None = None
        self._fd = -1
        self._buf = b""
        self.alive = False
        self.errors: list[str] = []

    def start(self) -> None:
        d, cfg = self.d, self.cfg
        d.mkdir()
        env = child_env(cfg)
        me = [sys.executable, str(SCRIPT), "--config", cfg.key, "--plan", self.plan.name]
        self.server = launch([*me, "--role", "server", "--ready-file", str(d / "ready"),
                              "--result-file", str(d / "server.json"), "--max-bytes", str(BIG)],
                             env, d / "server.log")
        ctrl_port, ucx_port = wait_ready(d / "ready", self.server, d / "server.log", "server",
                                         60, skip=proto_line).split()
        r, w = os.pipe()
        try:
            self.client = launch(
                [*me, "--role", "client", "--ctrl-port", ctrl_port, "--ucx-port", ucx_port,
                 "--server-pid", str(self.server.pid), "--result-fd", str(w),
                 "--extras", ",".join(sorted(self.extras))],
                env, d / "client.log", stdin=subprocess.PIPE, pass_fds=(w,))
        finally:
            os.close(w)
        self._fd = r
        answer = self.answer(self.plan.command_timeout + 10)
        if not answer.get("ready"):
            raise RuntimeError(f"client: {answer.get('error')}\n{tail(d / 'client.log')}")
        self.alive = True

    def answer(self, timeout: float) -> dict[str, Any]:
        """The client's next JSON line (bounded; EOF: it exited)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from the client in {timeout:.0f} s")
            ready, _, _ = select.select([self._fd], [], [], left)
            if ready:
                got = os.read(self._fd, 1 << 16)
                if not got:
                    code = None if self.client is None else self.client.poll()
                    raise EOFError(f"client exited ({code}):\n{tail(self.d / 'client.log')}")
                self._buf += got
        line, self._buf = self._buf.split(b"\n", 1)
        result: dict[str, Any] = json.loads(line)
        return result

    def send(self, command: str) -> None:
        assert self.client is not None and self.client.stdin is not None
        self.client.stdin.write(command.encode() + b"\n")
        self.client.stdin.flush()

    def ask(self, command: str) -> dict[str, Any]:
        """Run one command with the pair awake; pause it again after. A failed
        pair is stopped and asked nothing more."""
        if not self.alive:
            return {}
        self.signal(signal.SIGCONT)
        try:
            self.send(command)
            answer = self.answer(self.plan.command_timeout + 10)
        except Exception as exc:
            answer = {"error": f"{command}: {type(exc).__name__}: {exc}"}
        if "error" in answer:
            self.errors.append(answer["error"])
            self.close()
        else:
            self.signal(signal.SIGSTOP)
        return answer

    def signal(self, sig: int) -> None:
        for proc in (self.server, self.client):
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    def dead_peer(self) -> dict[str, Any]:
        """The client SIGKILLs itself mid-send: how does the server's receive end?"""
        info: dict[str, Any] = {}
        if not self.alive or self.server is None or self.client is None:
            return {"outcome": "pair not running"}
        self.signal(signal.SIGCONT)
        self.alive = False
        try:
            self.send("deadpeer")
            info.update(self.answer(self.plan.command_timeout))
            died = float(info.pop("killed_at"))
            info["send_done_at_kill"] = info.pop("send_done", None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.client.wait(5)
            info["client_exit"] = self.client.poll()
            path = self.d / "server.json"
            if wait_file(path, self.server, self.plan.dead_timeout + 5):
                r = json.loads(path.read_text())["dead_peer"]
                info.update(r)
                info["ended_after_kill_s"] = r["ended"] - died
            else:
                code = self.server.poll()
                info["outcome"] = (f"server exited with {code}" if code is not None
                                   else "no answer from the server")
            # The server ends by itself once the client's TCP connection is gone:
            # 0 is a clean exit, a negative status the signal that ended it (-6: abort).
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.server.wait(3)
            info["server_exit"] = self.server.poll()
        except Exception as exc:
            info["outcome"] = f"test failed: {type(exc).__name__}: {exc}"
        return info

    def close(self) -> None:
        self.alive = False
        stop(self.client)
        stop(self.server)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1



def start_pairs(configs: list[Config], plan: Plan, base: Path,
                aggs: dict[str, Agg]) -> dict[str, Pair]:
    """Start every configuration's pair, each alone, and pause it once ready."""
    base.mkdir()
    pairs: dict[str, Pair] = {}
    for cfg in configs:
        extras = {"multi", "core"} if cfg.key == REF else set()
        pair = pairs[cfg.key] = Pair(cfg, plan, base / cfg.key, extras)
        t0 = time.monotonic()
        try:
            pair.start()
            pair.signal(signal.SIGSTOP)
        except Exception as exc:
            pair.errors.append(f"start: {type(exc).__name__}: {exc}")
            pair.close()
        aggs[cfg.key].errors += pair.errors
        pair.errors = []
        progress(f"started {cfg.key} ({time.monotonic() - t0:.1f} s)"
                 + ("" if pair.alive else f" ERROR {aggs[cfg.key].errors[-1]}"))
    return pairs


def measure(configs: list[Config], plan: Plan, tmp: Path, aggs: dict[str, Agg],
            dead: dict[str, Any], others: list[float]) -> None:
    """Rounds over fresh pairs per generation; then idle CPU, batching and the
    dead-peer test on the last generation's pairs."""
    rnd = 0
    for gen in range(plan.generations):
        pairs = start_pairs(configs, plan, tmp / f"gen{gen}", aggs)
        try:
            n = plan.rounds // plan.generations + (gen < plan.rounds % plan.generations)
            for _ in range(n):
                keys = rotated(list(pairs), rnd * (len(pairs) // plan.rounds + 1))
                if rnd % 2:
                    keys.reverse()
                cpu0, t0 = machine_cpu(), time.monotonic()
                for key in keys:
                    aggs[key].add(rnd, pairs[key].ask(f"chunk {rnd}").get("samples", {}))
                cpu1, wall = machine_cpu(), time.monotonic() - t0
                others.append(((cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / wall)
                progress(f"round {rnd + 1}/{plan.rounds}: {wall:.1f} s, other processes "
                         f"kept {others[-1]:.1f} CPUs busy")
                rnd += 1
            if gen == plan.generations - 1:
                for key, pair in pairs.items():  # idle CPU, each pair alone
                    aggs[key].idle = pair.ask("idle").get("idle")
                if REF in pairs:
                    aggs[REF].add(-1, pairs[REF].ask("multi").get("samples", {}))
                for key in (REF, "sm"):
                    if key in pairs:
                        dead[key] = pairs[key].dead_peer()
        finally:
            for key, pair in pairs.items():
                pair.close()
                aggs[key].errors += pair.errors
                aggs[key].proto_info = {who: parse_proto_info(pair.d / f"{who}.log")
                                        for who in ("client", "server")}

