"""Byte progress bars (rich) in KiB, MiB, GiB; the speed falls back to the
average since the start (rich shows ``?`` for bars advanced rarely).
"""

from __future__ import annotations

from typing import Any

from rich.progress import DownloadColumn, ProgressColumn, Task
from rich.text import Text

from rpcbuf.control.wire.units import format_size


class SpeedColumn(ProgressColumn):
    """``12.3 MiB/s``: rich's recent speed, else the average so far."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        if speed is None and task.elapsed:
            speed = task.completed / task.elapsed
        return Text("?" if not speed else f"{format_size(speed)}/s", style="progress.data.speed")


def byte_columns() -> list[Any]:
    """The done/total and speed columns of a byte bar."""
    return [DownloadColumn(binary_units=True), SpeedColumn()]
