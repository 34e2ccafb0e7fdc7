"""The raw ucxx reference pair (``scripts/_bench_rawucx.py`` driven by
``_bench_refs.RawUcxx``), real processes over loopback UCX: each kind of
server memory (``--memory``) is what it says and carries bytes both ways;
an unknown kind is refused at start, with the reason."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from _bench_refs import RawUcxx  # noqa: E402

NBYTES = 1 << 20


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("memory", ["anon", "nohuge", "memfd"])
def test_each_memory_kind_moves_bytes(tmp_path: Path, memory: str) -> None:
    raw = RawUcxx.start(tmp_path, NBYTES, memory=memory, timeout=60)
    try:
        data = np.random.default_rng(1).integers(0, 256, NBYTES, dtype=np.uint8)
        stores = raw.store(data, 3)
        reads = raw.read(np.empty(NBYTES, dtype=np.uint8), 3)
        assert len(stores) == len(reads) == 3
        assert all(0 < s < 30 for s in stores + reads)
        memfd = "memfd:rawucx-buffer" in _maps(raw._server.pid)
        assert memfd == (memory == "memfd")
    finally:
        raw.close()


def test_unknown_memory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="invalid choice: 'huge'"):
        RawUcxx.start(tmp_path, NBYTES, memory="huge", timeout=10)
