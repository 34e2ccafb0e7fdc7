"""systemd's readiness and watchdog protocol, without a dependency: one datagram of
``KEY=VALUE`` lines to ``$NOTIFY_SOCKET`` (a path or ``@name``); nothing outside
systemd. Watchdog pings come from an asyncio timer on purpose (a wedged loop stops
them), every half of ``$WATCHDOG_USEC``, only if ``$WATCHDOG_PID`` is ours.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping

log = logging.getLogger("rpcbuf.daemon")


def _address(env: Mapping[str, str]) -> str | None:
    addr = env.get("NOTIFY_SOCKET", "")
    if not addr or addr[0] not in "/@":
        return None
    return "\0" + addr[1:] if addr[0] == "@" else addr


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between watchdog deadlines, or None when no watchdog is asked for."""
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = env.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 1e6


class Notifier:
    """Sends sd_notify messages; a no-op when not started by systemd."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.address = _address(env)
        self.watchdog = watchdog_interval(env) if self.address else None
        self._sock: socket.socket | None = None
        self._timer: asyncio.TimerHandle | None = None
        if self.address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, **fields: str | int) -> bool:
        """``notify(READY=1, STATUS="serving")``; returns whether it was sent."""
        if self._sock is None or self.address is None:
            return False
        message = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            self._sock.sendto(message, self.address)
        except OSError as exc:  # systemd went away or the socket is full: not our problem
            log.debug("sd_notify to %r failed: %s", self.address, exc)
            return False
        return True

    def start_heartbeat(self, status: Callable[[], str], every: float = 10.0) -> None:
        """Ping the watchdog (if asked for) and refresh STATUS= from the event loop."""
        if self._sock is None:
            return
        period = self.watchdog / 2 if self.watchdog else every
        loop = asyncio.get_running_loop()

        def beat() -> None:
            fields: dict[str, str | int] = {"STATUS": status()}
            if self.watchdog:
                fields["WATCHDOG"] = 1
            self.notify(**fields)
            self._timer = loop.call_later(period, beat)

        beat()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
