"""The README's two-node quick start, run as written: two daemons on this
machine as two nodes, one token, doctor, load with a placement, ls, unload."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from conftest import ROOT


def quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- two-node-quick-start -->\n```sh\n(.*?)```", text, re.S)
    assert m, "the README lost its two-node quick start"
    return m.group(1)


def test_two_node_quick_start_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPCBUF_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    env["COLUMNS"] = "80"
    script = "set -euo pipefail\n" + quick_start()
    res = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)
    out = res.stdout + res.stderr
    logs = "".join((tmp_path / f).read_text() for f in ("node0.log", "node1.log")
                   if (tmp_path / f).exists())
    assert res.returncode == 0, out + logs
    assert "Traceback" not in out, out
    assert "FAIL" not in out and out.count("ok    reachable") == 2, out
    assert "tiny/slot0 " in out and "tiny/slot1 " in out, out
    assert max(len(line) for line in res.stdout.splitlines()) <= 80, res.stdout
