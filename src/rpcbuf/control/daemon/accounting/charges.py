"""What each owner makes the daemon hold, and the limit of each: one table.

An owner is a tenant or an unauthenticated source; a kind is one countable thing
(``fds``, ``mappings``, ``sessions``, ``frame_bytes``). Each kind has a limit per
owner and optionally one for the node (fds: ``RLIMIT_NOFILE`` less a reserve, so
a tenant at its limit leaves room to accept connections). ``charge`` checks both
before counting (QUOTA_EXCEEDED names the flag; a refusal changes nothing); a
refund of what was never charged is a bug (RuntimeError). ``table`` is one owner's
view, ``totals`` the node's aggregates (no owner named).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from rpcbuf.control.wire.errors import QuotaExceeded


@dataclass(frozen=True)
class Limit:
    """One kind's bounds (None: none) and the flag that sets each."""

    per_owner: int | None = None
    node: int | None = None
    flag: str = ""
    node_flag: str = ""


class Charges:
    """Per owner and kind: what is held, checked against its limits."""

    def __init__(self, limits: Mapping[str, Limit] | None = None) -> None:
        self.limits: dict[str, Limit] = dict(limits or {})
        self._held: dict[tuple[Hashable, str], int] = {}
        self._total: dict[str, int] = {}
        self.refused: dict[str, int] = {}  # refusals per kind (metrics)

    def set_limit(self, kind: str, limit: Limit) -> None:
        self.limits[kind] = limit

    def held(self, owner: Hashable, kind: str) -> int:
        return self._held.get((owner, kind), 0)

    def total(self, kind: str) -> int:
        return self._total.get(kind, 0)

    def check(self, owner: Hashable, kind: str, n: int = 1) -> None:
        """Raise what ``charge(owner, kind, n)`` would raise; change nothing."""
        if n <= 0:
            return
        lim = self.limits.get(kind)
        if lim is None:
            return
        held = self.held(owner, kind)
        if lim.per_owner is not None and held + n > lim.per_owner:
            self.refused[kind] = self.refused.get(kind, 0) + 1
            why = f" ({lim.flag})" if lim.flag else ""
            raise QuotaExceeded(
                f"{_who(owner)} would hold {held + n} {kind}, at most {lim.per_owner}{why}",
                {"limit": kind, "flag": lim.flag, "held": held, "requested": n,
                 "max": lim.per_owner})
        total = self.total(kind)
        if lim.node is not None and total + n > lim.node:
            self.refused[kind] = self.refused.get(kind, 0) + 1
            raise QuotaExceeded(
                f"this node holds {total} {kind} for its tenants, at most {lim.node} "
                f"({lim.node_flag}); try again when others are released",
                {"limit": f"node_{kind}", "flag": lim.node_flag, "held": total,
                 "requested": n, "max": lim.node})

    def charge(self, owner: Hashable, kind: str, n: int = 1) -> None:
        """Count ``n`` more of ``kind``; QUOTA_EXCEEDED, changing nothing, past a limit."""
        if n < 0:
            raise ValueError(f"a charge of {n} {kind}")  # a bug
        self.check(owner, kind, n)
        if n:
            key = (owner, kind)
            self._held[key] = self._held.get(key, 0) + n
            self._total[kind] = self._total.get(kind, 0) + n

    def refund(self, owner: Hashable, kind: str, n: int = 1) -> None:
        if n <= 0:
            if n < 0:
                raise ValueError(f"a refund of {n} {kind}")  # a bug
            return
        key = (owner, kind)
        left = self._held.get(key, 0) - n
        if left < 0:
            raise RuntimeError(f"refund of {n} {kind} that {_who(owner)} was not charged")
        if left:
            self._held[key] = left
        else:
            del self._held[key]
        self._total[kind] -= n

    def table(self, owner: Hashable) -> dict[str, dict[str, Any]]:
        """``owner``'s rows: what it holds of each limited kind, and its limit."""
        return {kind: {"held": self.held(owner, kind), "limit": lim.per_owner}
                for kind, lim in sorted(self.limits.items())}

    def totals(self) -> dict[str, dict[str, Any]]:
        """Node-wide per kind: held, limit, largest owner's share, refusals (no owner named)."""
        largest: dict[str, int] = {}
        for (_, kind), n in self._held.items():
            largest[kind] = max(largest.get(kind, 0), n)
        return {kind: {"held": self.total(kind), "limit": lim.node,
                       "per_owner_limit": lim.per_owner,
                       "largest_owner": largest.get(kind, 0),
                       "refused": self.refused.get(kind, 0)}
                for kind, lim in sorted(self.limits.items())}

    def check_invariants(self) -> None:
        """Every total is the sum of its owners' counts, each positive."""
        sums: dict[str, int] = {}
        for (_, kind), n in self._held.items():
            assert n > 0, (kind, n)
            sums[kind] = sums.get(kind, 0) + n
        for kind, n in self._total.items():
            assert sums.get(kind, 0) == n, (kind, n, sums.get(kind, 0))


def _who(owner: Hashable) -> str:
    if isinstance(owner, str):
        return f"tenant {owner!r}"
    return f"source {owner!r}"


# What the daemon keeps of its fds for itself: per authenticated session a
# control socket, a handle channel and a staging memfd; per unauthenticated
# connection or pending UCX endpoint a socket each; and some for listeners,
# logs, UCX and Python itself.  Kept freed blocks (``kept.MAX_KEPT``) come on top.
FDS_PER_SESSION = 3
FDS_BASE = 256
MAPS_RESERVE = 16384  # the process's own mappings (Python, UCX, libraries, threads)


def fd_reserve(max_sessions: int, max_unauthenticated: int) -> int:
    """The fds the daemon keeps for what is not a tenant's buffer."""
    return FDS_PER_SESSION * max_sessions + 2 * max_unauthenticated + FDS_BASE


def handle_limits(nofile: int, reserve: int, kept: int, per_tenant: int | None,
                  map_count: int) -> dict[str, Limit]:
    """The limits of ``fds`` and ``mappings``: the node may open ``nofile`` less
    ``reserve`` and the ``kept`` blocks' fds (at least an eighth of ``nofile``), a tenant
    ``per_tenant`` of it (default half). Mappings: ``map_count`` less the process's own,
    halved (a block may split the arena's mapping in two)."""
    budget = max(nofile // 8, nofile - reserve - kept)
    mine = budget // 2 if per_tenant is None else per_tenant
    maps = max(1, (map_count - MAPS_RESERVE) // 2)
    return {"fds": Limit(mine, budget, "--max-fds-per-tenant", "--fd-reserve"),
            "mappings": Limit(mine, maps, "--max-fds-per-tenant", "vm.max_map_count")}
