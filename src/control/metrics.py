"""Prometheus metrics for one daemon, served on ``--metrics HOST:PORT``.

Each daemon has its own ``CollectorRegistry`` (never the process-global one),
so two daemons in one process, as in tests, never mix their numbers.

Two kinds of numbers:

- counted as requests are answered: ``rpcbuf_ops_total{op,code}`` and
  ``rpcbuf_op_duration_seconds{op}``, recorded in one place, where the
  session answers every request (``Session._finish``);
- read from the daemon's state when scraped (a custom collector): bytes
  stored and read, verification failures, lease expiries, sessions,
  transfers in flight, and per device the pool's size, used bytes and
  largest free block, and per tenant its buffers and bytes.

The HTTP endpoint runs on the daemon's own event loop (not in a thread), so a
scrape reads consistent state without locks, and a wedged loop shows as a
failed scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .server import Daemon

# From a 4 KiB control round trip on loopback (~100 us) to a multi-GiB transfer.
LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class Metrics:
    def __init__(self, daemon: Daemon) -> None:
        self.registry = CollectorRegistry()
        self._ops = Counter("rpcbuf_ops", "Requests answered, by op and result code",
                            ["op", "code"], registry=self.registry)
        self._latency = Histogram("rpcbuf_op_duration_seconds",
                                  "Time from a request's arrival to its end (transfers "
                                  "included), by op", ["op"], buckets=LATENCY_BUCKETS,
                                  registry=self.registry)
        self._refused = Counter("rpcbuf_connections_refused",
                                "Connections turned away, by reason", ["reason"],
                                registry=self.registry)
        self.registry.register(_StateCollector(daemon))
        ProcessCollector(registry=self.registry)
        self._children: dict[tuple[str, str], Any] = {}
        self._timers: dict[str, Any] = {}
        self._server: asyncio.AbstractServer | None = None

    def observe(self, op: str, code: str, started: float) -> None:
        """One answered request; ``started`` is its ``time.perf_counter()``."""
        child = self._children.get((op, code))
        if child is None:
            child = self._children[(op, code)] = self._ops.labels(op, code)
        child.inc()
        timer = self._timers.get(op)
        if timer is None:
            timer = self._timers[op] = self._latency.labels(op)
        timer.observe(time.perf_counter() - started)

    def refused(self, reason: str) -> None:
        self._refused.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- the HTTP endpoint ------------------------------------------------------

    async def serve(self, host: str, port: int) -> tuple[str, int]:
        """Listen on host:port; returns the bound address. Raises OSError."""
        self._server = await asyncio.start_server(self._handle, host, port)
        addr = self._server.sockets[0].getsockname()
        return addr[0], addr[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
            parts = head.split(b"\r\n", 1)[0].split()
            method = parts[0] if parts else b""
            path = parts[1].split(b"?", 1)[0] if len(parts) > 1 else b""
            if method not in (b"GET", b"HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            elif path != b"/metrics":
                status, ctype, body = "404 Not Found", "text/plain", b"see /metrics\n"
            else:
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, self.render()
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
            if method != b"HEAD":
                writer.write(body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()


class _StateCollector(Collector):
    """Reads the daemon's state at scrape time (on the event loop)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Any]:
        d = self.daemon
        c, reg = d.counters, d.registry
        for name, doc, value in (
            ("rpcbuf_bytes_stored", "Bytes received into buffers", c["bytes_stored"]),
            ("rpcbuf_bytes_read", "Bytes sent out of buffers", c["bytes_read"]),
            ("rpcbuf_verify_failures", "Stores whose checksum did not match",
             c["verify_failures"]),
            ("rpcbuf_sessions_opened", "Control connections accepted", c["sessions_total"]),
            ("rpcbuf_lease_expiries", "Buffers released because their lease ran out",
             reg.expired_total),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("rpcbuf_sessions", "Open control connections",
                                value=len(d.sessions))
        yield GaugeMetricFamily("rpcbuf_sessions_limit", "--max-sessions",
                                value=d.limits.max_sessions)
        yield GaugeMetricFamily("rpcbuf_transfers_in_flight", "Data transfers running",
                                value=sum(len(s.transfers) for s in d.sessions.values()))
        pools = {k: GaugeMetricFamily(f"rpcbuf_pool_{k}", doc, labels=["device"]) for k, doc in (
            ("size_bytes", "Arena size"),
            ("used_bytes", "Bytes handed out (whole allocator blocks)"),
            ("largest_free_bytes", "Largest block that can be allocated now"),
            ("buffers", "Buffers held"),
            ("waiters", "Requests waiting for memory"),
        )}
        for key, pool in reg.pools.items():
            st = pool.allocator.stats()
            pools["size_bytes"].add_metric([key], st.total)
            pools["used_bytes"].add_metric([key], st.used)
            pools["largest_free_bytes"].add_metric([key], st.largest_free)
            pools["buffers"].add_metric([key], st.count)
            pools["waiters"].add_metric([key], reg.waiting(pool))
        yield from pools.values()
        buffers = GaugeMetricFamily("rpcbuf_tenant_buffers", "Buffers held by a tenant",
                                    labels=["tenant"])
        held = GaugeMetricFamily("rpcbuf_tenant_bytes", "Bytes held by a tenant on a device",
                                 labels=["tenant", "device"])
        usage = reg.tenant_usage()
        for tenant, n in sorted(usage["buffers"].items()):
            buffers.add_metric([tenant], n)
        for (tenant, device), n in sorted(usage["bytes"].items()):
            held.add_metric([tenant, device], n)
        yield buffers
        yield held
