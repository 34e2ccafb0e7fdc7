"""Helpers the benchmark scripts share (``bench.py``, ``bench_ucx.py``)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """The garbage collector off while timing (after one collection)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of every thread of ``pid``, in clock ticks (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5)
