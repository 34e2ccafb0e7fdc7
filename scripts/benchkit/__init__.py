"""The benchmark kit: what every script under ``scripts/`` shares.

``bench.py``, ``bench_ucx.py``, ``bench_dedup.py``, ``bench_gpu.py`` and
``demo.py`` each start processes, time things and print a table; this package
holds those steps once, one concern a module:

* ``procs``: child processes (own session, killed with us), a real
  ``rpcbufd`` started on free loopback ports behind its ready file
  (``Daemon``), bounded stops, ready files, log tails;
* ``interrupt``: SIGINT/SIGTERM become ``Interrupted`` (exit 128 + signal)
  after a cleanup that a second signal cannot cut short;
* ``timing``: the garbage collector off while timing, timed loops, rounds
  that alternate rpcbuf with its references, latency statistics, CPU time
  of a process and of the machine;
* ``report``: the aligned text table, the JSON file, the run's metadata, the
  progress line on stderr.

Importing the kit sets nothing but ``sys.path``: it puts this checkout's
``src/`` first, so a script measures the code next to it whatever the
virtualenv's editable install points at.  It never imports ucxx (UCX reads
its environment at import, and each script sets that environment first:
``loopback_ucx_env``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent
ROOT = SCRIPTS.parent
SRC = ROOT / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

# What a benchmark on one machine uses: UCX over loopback TCP, quiet about
# variables a given UCX does not know.  Each only where the caller has not set it.
LOOPBACK_UCX = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def loopback_ucx_env() -> None:
    """Set ``LOOPBACK_UCX`` where unset; call before anything imports ucxx."""
    for key, value in LOOPBACK_UCX.items():
        os.environ.setdefault(key, value)


KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def size_name(nbytes: int) -> str:
    """``4 KiB``, ``64 MiB``: how tables and JSON keys name a payload size."""
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"
