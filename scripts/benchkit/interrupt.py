"""SIGINT and SIGTERM during a benchmark: stop measuring, clean up, exit 128 + signal.

Outside an event loop a signal raises ``Interrupted`` at once.  Inside one,
``note_signals`` turns it into a flag that ``check_interrupted`` (called by
every timed loop between operations) raises: cancelling the main task is not
enough, because on Python 3.11 ``asyncio.wait_for`` (which the rpcbuf client
uses) swallows a cancellation that races with the answer arriving.
``Interrupted`` is a ``BaseException`` so that no ``except Exception`` on
the way up swallows it.  ``interruptible`` ignores both signals while its
cleanup runs, so a second Ctrl-C cannot leave a daemon behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: stop measuring, clean up, exit 128 + signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


_pending: int | None = None


def _raise(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


def _note(signum: int) -> None:
    global _pending
    _pending = signum


def note_signals(loop: asyncio.AbstractEventLoop) -> None:
    """Inside ``loop``: a signal sets the flag ``check_interrupted`` raises."""
    for sig in SIGNALS:
        loop.add_signal_handler(sig, _note, sig)


def check_interrupted() -> None:
    """Raise ``Interrupted`` if a signal was noted (cheap: one global read)."""
    if _pending is not None:
        raise Interrupted(_pending)


@contextlib.contextmanager
def interruptible(cleanup: Callable[[], None]) -> Iterator[None]:
    """Signals raise ``Interrupted`` inside; ``cleanup`` runs on every exit
    with both signals ignored, then the previous handlers come back."""
    handlers = {sig: signal.signal(sig, _raise) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig in handlers:
            signal.signal(sig, signal.SIG_IGN)
        try:
            cleanup()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
