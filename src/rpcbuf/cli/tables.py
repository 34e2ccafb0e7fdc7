"""Tables that fit the terminal (``$COLUMNS``, the terminal, else 80).  Optional
columns are dropped first, lowest priority first, and named under the table; a
key column (ids, endpoints) is never cut, only wrapped whole where it says
``wrap``; numbers keep their width.  ``--wide`` keeps every column.

Every string a daemon, registry or file chose goes through ``clean`` before it
is printed: a terminal obeys the escape sequences in someone else's text.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

CLEAN_MAX = 4096  # characters of one printed string a peer chose (then "... N more")


def _escaped(ch: str) -> str:
    return ascii(ch)[1:-1]  # \x1b, \u202e, \U0001f600 style: visible, inert


def clean(text: Any, newlines: bool = False, limit: int = CLEAN_MAX) -> str:
    """``text`` safe for a terminal: every non-printable character (controls,
    ESC, DEL, bidi and format characters, line separators; newlines unless
    ``newlines``) as its Python escape; at most ``limit`` characters."""
    s = text if isinstance(text, str) else str(text)
    if len(s) > limit:
        s = f"{s[:limit]}... ({len(s) - limit} more characters)"
    if s.isprintable():
        return s
    return "".join(ch if ch.isprintable() or (newlines and ch == "\n") else _escaped(ch)
                   for ch in s)


@dataclass(frozen=True)
class Col:
    name: str
    key: bool = False  # never cut: ids, names, endpoints
    wrap: bool = False  # may continue on the next line when nothing else gives (names)
    drop: int = 0  # > 0: may be dropped when narrow, lowest first
    right: bool = False


def duration(seconds: float) -> str:
    """45s, 59m, 23h 59m, 6d 23h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def width() -> int:
    return shutil.get_terminal_size((80, 24)).columns


WRAP_ROOM = 24  # the room a wrapped column (names) is given before optional columns stay
SEPARATORS = "/-_.,:"  # where a word too long for a line (a path, a name) may break


def _pieces(word: str, room: int) -> list[str]:
    """``word`` in pieces of at most ``room``, cut after a separator where
    there is one, mid-word only where not."""
    out = []
    while len(word) > room:
        cut = max(word.rfind(sep, 0, room) for sep in SEPARATORS)
        cut = cut + 1 if cut > 0 else room
        out.append(word[:cut])
        word = word[cut:]
    return [*out, word]


def fold(text: str, room: int) -> list[str]:
    """Lines of at most ``room``, broken between words, a long word after a
    separator (``_pieces``)."""
    room = max(1, room)
    lines: list[str] = []
    for para in text.split("\n"):
        cur = ""
        for word in para.split(" "):
            if not word:
                continue
            if len(cur) + 1 + len(word) <= room and cur:
                cur += " " + word
            elif len(word) <= room:
                if cur:
                    lines.append(cur)
                cur = word
            else:
                if cur:
                    lines.append(cur)
                *whole, cur = _pieces(word, room)
                lines += whole
        lines.append(cur)
    return lines


def warn(text: str) -> None:
    """One sentence on stderr, folded to a terminal's width; whole on a pipe."""
    if sys.stderr.isatty():
        text = "\n".join(fold(text, width() - 1))
    print(text, file=sys.stderr)


def _cell(cell: Any) -> Text:
    """Rich text: a ``Text`` as is (its builder cleans it), anything else plain,
    never markup, and ``clean``ed (a ``[`` must not restyle or break the table)."""
    return cell if isinstance(cell, Text) else Text(clean(cell, newlines=True))


def _text_len(cell: Text) -> int:
    return max((len(line) for line in cell.plain.split("\n")), default=0)


def fit(title: str, cols: Sequence[Col], rows: Sequence[Sequence[Any]], *, wide: bool = False,
        columns: int | None = None) -> Table:
    """A rich table of ``rows`` that fits ``columns`` (the terminal's width)."""
    columns = width() if columns is None else columns
    keep = list(range(len(cols)))
    cells = [[_cell(c) for c in r] for r in rows]
    need = [max([len(c.name)] + [_text_len(r[i]) for r in cells]) for i, c in enumerate(cols)]

    def total(idx: list[int]) -> int:  # cell padding 2 + one border per column, + 1
        # (a wrapped column counts as WRAP_ROOM at most: optional columns go
        # until a long name has that much room, not until it fits on one line)
        return sum((min(need[i], WRAP_ROOM) if cols[i].wrap else need[i]) + 3
                   for i in idx) + 1

    if not wide:
        for i in sorted((i for i, c in enumerate(cols) if c.drop), key=lambda i: cols[i].drop):
            if total(keep) <= columns:
                break
            keep.remove(i)
    for i in (i for i in keep if cols[i].wrap):  # a wrapped column (names) gets the
        room = columns - total([j for j in keep if j != i]) - 3  # room the others leave,
        if need[i] > room >= 8:  # its lines broken after separators (``fold``)
            for r in cells:
                if _text_len(r[i]) > room:
                    r[i] = Text("\n".join(fold(r[i].plain, room)), style=r[i].style)
            need[i] = room
    # A column left out says so, so that its absence never reads as "none"
    # (a buffer with a lease looked permanent without its "ttl left").
    dropped = [cols[i].name for i in range(len(cols)) if i not in keep]
    caption = f"not shown at this width: {', '.join(dropped)} (--wide)" if dropped else None
    table = Table(title=Text(clean(title), style="table.title"), caption=caption, expand=False)
    for i in keep:
        c = cols[i]
        table.add_column(c.name, justify="right" if c.right else "left",
                         min_width=None if c.wrap else need[i], no_wrap=not c.wrap,
                         overflow="fold")
    for r in cells:
        table.add_row(*[r[i] for i in keep])
    return table


def console(wide: bool = False) -> Console:
    """Where tables go: the terminal's width (wider with ``--wide``)."""
    w = width()
    return Console(width=max(w, 200) if wide else w, soft_wrap=False)
