"""``bench_ucx.py``'s configurations, plans and the wire of its process pairs.

A ``Config`` is one UCX/ucxx setting under test (its environment over
``BASE_ENV``, and how ucxx is driven); ``CONFIGS`` is the list the table
shows, ``REF`` the row every ratio is against.  A ``Plan`` says how much each
round measures.  The pair's TCP phase protocol (``HDR`` and the ``M_*``
modes) and the ucxx tags are here because both ends of a pair
(``_bench_ucx_child``) and the parent's environment (``child_env``) need
them.  Nothing here imports ucxx: UCX reads its environment at import, so
only a child, in its configuration's environment, does (``load_ucxx``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchkit import KiB, MiB

BIG = 64 * MiB
MULTI_COUNT, MULTI_BYTES = 10_000, 4 * KiB
TAG_DATA, TAG_REPLY = 2, 3

# Control messages over TCP: header (mode, nbytes, iters, arg).
HDR = struct.Struct("<qqqq")
LEN = struct.Struct("<q")
(M_QUIT, M_HELLO, M_STORE, M_READ, M_STORE_MANY, M_MULTI, M_CMA_STORE, M_CMA_READ,
 M_DEADPEER) = range(9)

BASE_ENV = {
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": "lo",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_PROTO_INFO": "y",
    "RPCBUF_UCX_CUDA": "0",
}


@dataclass(frozen=True)
class Config:
    key: str
    what: str
    env: dict[str, str | None] = field(default_factory=dict)  # over BASE_ENV; None: unset
    rpcbuf_env: bool = True  # rpcbuf.dataplane.ucx.UCX_DEFAULTS in the environment
    adaptive: bool = True  # rpcbuf.dataplane.ucx.ucxx() (AdaptiveProgress) + progress.busy()
    same_host: bool = False  # worker-address endpoints, error handling off; cma, memcpy
    drain: bool = False  # AdaptiveProgress variant: worker.progress() after progress_once()


REF = "rpcbuf"
CONFIGS = (
    Config("ucxx-default", "ucxx as installed: thread progress, UCX defaults",
           {"UCXPY_PROGRESS_MODE": None}, rpcbuf_env=False, adaptive=False),
    Config("thread", "rpcbuf env, ucxx thread progress",
           {"UCXPY_PROGRESS_MODE": "thread"}, adaptive=False),
    Config("polling", "rpcbuf env, ucxx polling progress",
           {"UCXPY_PROGRESS_MODE": "polling"}, adaptive=False),
    Config("ucxx-blocking", "rpcbuf env, ucxx's own blocking mode",
           {"UCXPY_PROGRESS_MODE": "blocking"}, adaptive=False),
    Config(REF, "rpcbuf defaults (AdaptiveProgress + busy())"),
    Config("rpcbuf-drain", "rpcbuf, polling turns drain the worker (progress())",
           drain=True),
    Config("rndv-get", "rpcbuf, UCX_RNDV_SCHEME=get_zcopy", {"UCX_RNDV_SCHEME": "get_zcopy"}),
    Config("rndv-auto", "rpcbuf, UCX_RNDV_SCHEME=auto", {"UCX_RNDV_SCHEME": "auto"}),
    Config("seg-default", "rpcbuf, tcp segments at UCX default (8k/64k)",
           {"UCX_TCP_TX_SEG_SIZE": "8k", "UCX_TCP_RX_SEG_SIZE": "64k"}),
    Config("seg-8m", "rpcbuf, tcp segments 8m",
           {"UCX_TCP_TX_SEG_SIZE": "8m", "UCX_TCP_RX_SEG_SIZE": "8m"}),
    Config("sockbuf-16m", "rpcbuf, UCX_TCP_SNDBUF/RCVBUF=16m",
           {"UCX_TCP_SNDBUF": "16m", "UCX_TCP_RCVBUF": "16m"}),
    Config("sm", "rpcbuf, UCX_TLS=sm,self, worker-address eps, no error handling",
           {"UCX_TLS": "sm,self"}, same_host=True),
)
BY_KEY = {c.key: c for c in CONFIGS}


@dataclass(frozen=True)
class Plan:
    """How much to measure. Counts are per round (one chunk per configuration)."""

    name: str
    rounds: int
    lat_iters: int  # 4 KiB back-to-back round trips
    cold_iters: int  # 4 KiB, and 1 MiB, stores after a quiet gap
    cold_gap: float
    mid_iters: int  # 1 MiB transfers per direction
    big_iters: int  # 64 MiB transfers per direction (and cma, memcpy on ``sm``)
    idle_seconds: float
    multi_reps: int  # rounds of the three batching variants (``rpcbuf`` only)
    dead_timeout: float  # the server's bound on one receive in the dead-peer test
    command_timeout: float  # bound on one command (setup, a chunk, ...)
    generations: int  # fresh sets of pairs the rounds are split over


FULL = Plan("full", rounds=12, lat_iters=100, cold_iters=2, cold_gap=0.025, mid_iters=4,
            big_iters=2, idle_seconds=1.5, multi_reps=3, dead_timeout=4.0,
            command_timeout=60.0, generations=2)
QUICK = Plan("quick", rounds=3, lat_iters=60, cold_iters=2, cold_gap=0.025, mid_iters=3,
             big_iters=2, idle_seconds=1.0, multi_reps=2, dead_timeout=3.0,
             command_timeout=60.0, generations=1)
PLANS = {p.name: p for p in (FULL, QUICK)}


def child_env(cfg: Config) -> dict[str, str]:
    """The environment of ``cfg``'s two processes: ours without any UCX_/UCXPY_
    variable, then ``BASE_ENV``, rpcbuf's UCX defaults where ``cfg`` says,
    ``cfg.env`` (None: unset); PYTHONPATH gets this checkout's ``src/``."""
    from rpcbuf.dataplane.ucx import UCX_DEFAULTS  # does not import ucxx

    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "UCXPY_"))}
    env.update(BASE_ENV)
    if cfg.rpcbuf_env:
        env.update(UCX_DEFAULTS)
    env.update({k: v for k, v in cfg.env.items() if v is not None})
    for k in [k for k, v in cfg.env.items() if v is None]:
        env.pop(k, None)
    return env


def load_ucxx(cfg: Config) -> tuple[Any, Callable[[], Any]]:
    """ucxx (imported only now: the environment is ours) and the busy() marker."""
    if cfg.adaptive:
        from rpcbuf.dataplane import progress, ucx

        mod = ucx.ucxx()
        if cfg.drain:
            _drain_each_turn()
        return mod, progress.busy
    import ucxx

    return ucxx, contextlib.nullcontext


def _drain_each_turn() -> None:
    """The ``rpcbuf-drain`` variant: AdaptiveProgress's polling loop (a copy of
    ``rpcbuf.dataplane.ucx``'s ``_poll_until_armed``) with one change: a turn that made
    progress also calls ``worker.progress()``, which repeats
    ``ucp_worker_progress`` until nothing is left (ucxx's PollingMode calls only
    that), instead of one ``progress_once()`` per event-loop turn."""
    from ucxx._lib_async import application_context

    async def _poll_until_armed(self: Any) -> None:
        worker = self.worker
        while worker is not None and not self.stopped:
            try:
                if worker.progress_once():
                    worker.progress()
                    self._until = time.monotonic() + self.GRACE
                elif not self.busy and time.monotonic() >= self._until:
                    if worker.arm():
                        return
                    continue
            except Exception:
                pass
            await asyncio.sleep(0)
            worker = self.worker

    application_context.BlockingMode._poll_until_armed = _poll_until_armed

