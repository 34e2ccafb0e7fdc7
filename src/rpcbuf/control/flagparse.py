"""argparse for ``rpcbuf`` and ``rpcbufd`` with errors as a one-line usage and
one sentence (not the full usage a terminal scrolls away), and a "did you
mean" for an unknown flag.  Exit code 2, as argparse's.
"""

from __future__ import annotations

import argparse
import difflib
import re
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        hint = self._suggest(message)
        self.exit(2, f"usage: {self._short_usage()}  ({self.prog} --help lists every flag)\n"
                     f"{self.prog}: error: {message}{hint}\n")

    def _short_usage(self) -> str:
        """``PROG [flags] POSITIONAL...``: the one line a mistake needs."""
        words = [self.prog, "[flags]"]
        for action in self._actions:
            if action.option_strings or action.help == argparse.SUPPRESS:
                continue
            if isinstance(action, argparse._SubParsersAction):
                words.append("COMMAND")
                continue
            words.append(self._get_formatter()._format_args(action, action.dest.upper()))
        return " ".join(w for w in words if w)

    def _suggest(self, message: str) -> str:
        m = re.match(r"unrecognized arguments: (.*)", message)
        if m is None:
            return ""
        known = [s for action in self._actions for s in action.option_strings
                 if s.startswith("--")]
        for word in m.group(1).split():
            flag = word.split("=", 1)[0]
            if flag.startswith("-"):
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
                if close:
                    return f" (did you mean {close[0]}?)"
        return ""
