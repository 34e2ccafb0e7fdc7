"""What a benchmark prints and writes: an aligned table, a JSON file, the run's metadata.

Benchmarks print a table and write JSON; they are not timed tests
(DESIGN.md).  The table is plain text (it is read in terminals, pasted into
issues and diffed), columns padded to their widest cell, numbers on the
right.  The JSON holds every number; ``machine_meta`` is the part of its
``meta`` that says where it ran.  Progress goes to stderr, one
``[script] message`` line each, so stdout is the table alone.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                 right: Collection[int] | None = None, rule: bool = True) -> str:
    """Columns padded to their widest cell, two spaces apart; the columns in
    ``right`` (default: all but the first) are right-aligned.  A rule of
    dashes under the header unless ``rule`` is false."""
    cells = [tuple(header), *(tuple(r) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    align = set(range(1, len(header))) if right is None else set(right)

    def line(c: tuple[str, ...]) -> str:
        return "  ".join(v.rjust(w) if i in align else v.ljust(w)
                         for i, (v, w) in enumerate(zip(c, widths, strict=True))).rstrip()

    out = [line(cells[0])]
    if rule:
        out.append("  ".join("-" * w for w in widths))
    return "\n".join([*out, *(line(c) for c in cells[1:])])


def machine_meta() -> dict[str, Any]:
    """Where a run ran: python, platform, CPUs."""
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "cpus": os.cpu_count()}


def write_json(path: str | Path, obj: Any, indent: int | None = 1,
               default: Callable[[Any], Any] | None = None) -> None:
    """Write ``obj`` as JSON (one trailing newline) atomically: a reader never
    sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=indent, default=default) + "\n")
    os.replace(tmp, path)


def progress_printer(script: str) -> Callable[[str], None]:
    """A ``progress(msg)`` that prints ``[script] msg`` to stderr at once."""
    def progress(msg: str) -> None:
        print(f"[{script}] {msg}", file=sys.stderr, flush=True)
    return progress


def read_stored(path: str, script: str) -> dict[str, Any] | None:
    """A stored run's JSON object (``--render``), or None with the reason
    printed to stderr (``script``: who says so)."""
    import json
    import sys

    try:
        with open(path) as f:
            stored = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"{script}: --render {path}: {exc}", file=sys.stderr)
        return None
    if not isinstance(stored, dict):
        print(f"{script}: --render {path}: not a {script} JSON object", file=sys.stderr)
        return None
    return stored
