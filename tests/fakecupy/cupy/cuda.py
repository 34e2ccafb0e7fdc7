"""Fake ``cupy.cuda``: two devices, no streams."""

from __future__ import annotations

from typing import Any

DEVICES = 2


class _Runtime:
    @staticmethod
    def getDeviceCount() -> int:
        return DEVICES

    @staticmethod
    def getDeviceProperties(n: int) -> dict[str, Any]:
        return {"name": b"Fake GPU (NumPy)"}

    @staticmethod
    def memGetInfo() -> tuple[int, int]:
        return (1 << 30, 2 << 30)


runtime = _Runtime()


class Device:
    def __init__(self, n: int = 0) -> None:
        self.id = n

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def synchronize(self) -> None:
        return None
