"""Leases that ran out, remembered a while so a NOT_FOUND says so (``lease_expired``),
to its own tenant only; the newest ``LAPSED_MAX`` ids and names.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from rpcbuf.control.daemon.accounting.buffers import Buffer
from rpcbuf.control.wire.errors import NotFound

LAPSED_MAX = 4096  # lapsed leases remembered (ids and names)


class Lapsed:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._when: OrderedDict[tuple[str, str], float] = OrderedDict()

    def not_found(self, tenant: str, key: str, message: str) -> NotFound:
        """NOT_FOUND for ``key`` (a buffer id, or "=" + a name) of ``tenant``."""
        when = self._when.get((tenant, key))
        if when is None:
            return NotFound(message)
        ago = max(0.0, self._clock() - when)
        return NotFound(f"{message}: its lease ran out {ago:.0f} s ago and it was released",
                        {"reason": "lease_expired", "expired_at": when})

    def note(self, buf: Buffer, when: float) -> None:
        keys = [(buf.tenant, buf.buffer_id)]
        if buf.name is not None:
            keys.append((buf.tenant, "=" + buf.name))
        for key in keys:
            self._when[key] = when
            self._when.move_to_end(key)
        while len(self._when) > LAPSED_MAX:
            self._when.popitem(last=False)

    def forget_name(self, tenant: str, name: str) -> None:
        """An older buffer's lapse under this name is no longer news."""
        self._when.pop((tenant, "=" + name), None)
