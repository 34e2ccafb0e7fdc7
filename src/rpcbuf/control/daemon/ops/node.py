"""What a session sees of the daemon: the node's ``Limits`` and ``Node``, the
daemon's shared parts (``service.server.Daemon`` is the one implementation;
the rooms below it may not import it).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from rpcbuf.control.daemon.accounting.admission import Pending
from rpcbuf.control.daemon.accounting.charges import Charges
from rpcbuf.control.daemon.accounting.registry import Registry
from rpcbuf.control.daemon.content.blocks import BlockStore
from rpcbuf.control.daemon.content.index import ContentIndex
from rpcbuf.control.daemon.content.modeldirs import ModelFiles
from rpcbuf.control.daemon.observe.metrics import Metrics
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.auth import Keyring
from rpcbuf.control.wire.errors import QuotaExceeded
from rpcbuf.dataplane.copypool import CopyPool
from rpcbuf.dataplane.janitor import Janitor
from rpcbuf.dataplane.ucx import DataEndpoint


@dataclass(frozen=True)
class Limits:
    max_frame: int = P.DEFAULT_MAX_FRAME
    max_inflight: int = 64
    transfer_timeout: float = 300.0
    drain_timeout: float = 30.0
    hello_timeout: float = 10.0  # from accept to a successful hello, one deadline
    max_sessions: int = 1024  # authenticated control connections
    # One tenant's share of them: a host's workers (8 GPUs x 8 processes)
    # fit, and it takes 16 tenants at their cap to fill the node.
    max_sessions_per_tenant: int = 64
    # Connections before their hello, and UCX endpoints before they bind
    # (each its own count): at the bound the oldest goes (see admission.py).
    max_unauthenticated: int = 512
    max_unauthenticated_per_source: int = 128  # control connections, per address (or uid)
    copy_threads: int = 4  # same-host copies (copypool.py): at most half for one tenant
    # Bounded memory work for tenants (copypool.py, ``sweeps``): one per CPU,
    # at least 4 (one tenant may use half: two, as pre-faulting does alone).
    sweep_threads: int = max(4, min(16, os.cpu_count() or 1))
    # File descriptors (and mappings) one tenant's host buffers may hold
    # (None: half the node's budget), and the fds the daemon keeps for
    # sessions, sockets and logs (None: ``charges.fd_reserve``).
    max_fds_per_tenant: int | None = None
    fd_reserve: int | None = None
    # Control bytes received and not yet a whole frame, one tenant's sessions
    # together (at least one frame of max_frame), and how long one frame may
    # take to arrive once its first byte did.
    max_buffered_per_tenant: int = 4 * P.DEFAULT_MAX_FRAME
    frame_timeout: float = 60.0

    def to_wire(self) -> dict[str, Any]:
        return {"max_frame": self.max_frame, "max_inflight": self.max_inflight,
                "transfer_timeout": self.transfer_timeout}


class Node(Protocol):
    """The daemon's parts that every session shares."""

    registry: Registry
    charges: Charges  # what each tenant holds, and the limit of each (charges.py)
    blocks: BlockStore  # the keyed block tier (blocks.py)
    keys: Keyring
    node_id: str
    cluster: str  # --cluster: what a token's audience must name
    limits: Limits
    unauthenticated: Pending[Any]
    pending_endpoints: Pending[DataEndpoint]
    janitor: Janitor | None  # drops old UCX messages no request asked for
    listening: list[str]  # every TCP socket the daemon listens on (read at start)
    ucx_library: dict[str, Any]  # which UCX the daemon runs on (``ucx.library``, at start)
    copies: CopyPool  # same-host ring copies
    sweeps: CopyPool  # bounded memory work for tenants, shared fairly (copypool.py)
    metrics: Metrics
    content: ContentIndex
    model_files: ModelFiles | None  # --model-dir: what node-local loads may read
    counters: dict[str, int]
    tenant_counters: dict[str, dict[str, int]]
    shutting_down: bool
    stopped: bool
    ucx_port: int
    started_at: float

    @property
    def sessions(self) -> MutableMapping[str, Any]: ...  # id -> session, authenticated or not
    @property
    def by_nonce(self) -> MutableMapping[bytes, Any]: ...  # bind nonce -> session not yet bound
    @property
    def by_handles_nonce(self) -> MutableMapping[bytes, Any]: ...  # -> session awaiting handles

    def local_info(self) -> dict[str, Any] | None: ...
    def schedule_expiry(self) -> None: ...
    def authenticated(self) -> int: ...
    def too_many_sessions(self) -> QuotaExceeded: ...
