"""The byte progress bars' columns (issue 28, item 12): KiB/MiB like the
tables, and a speed even when rich has too few samples for its own."""

from __future__ import annotations

from rich.progress import Progress

from rpcbuf.control.client.progress import byte_columns


def test_done_total_and_speed_are_in_binary_units() -> None:
    clock = [100.0]
    with Progress(*byte_columns(), get_time=lambda: clock[0], disable=True) as bar:
        task = bar.add_task("get", total=256 << 20)
        clock[0] += 2.0
        bar.update(task, advance=64 << 20)  # one 64 MiB step: rich's speed has one sample
        (t,) = bar.tasks
        done, speed = (str(col.render(t)) for col in bar.columns)
    assert done == "64.0/256.0 MiB", done
    assert speed == "32.0 MiB/s", speed
    assert "MB" not in done + speed and "?" not in speed
