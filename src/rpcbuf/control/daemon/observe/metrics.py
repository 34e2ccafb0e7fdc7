"""Prometheus metrics for one daemon, served on ``--metrics HOST:PORT`` from its own
``CollectorRegistry`` (two daemons in one process never mix numbers).

- Counted as requests are answered (``rpcbuf_ops_total{op,code}``,
  ``rpcbuf_op_duration_seconds{op}``): ``observe`` only bumps plain numbers on the
  hot path; a collector renders them as counter and histogram families at scrape.
- The daemon's state is read at scrape time by a collector given to ``Metrics``.
- The endpoint runs on the daemon's loop: consistent state without locks, and a
  wedged loop shows as a failed scrape.
- A scrape names no tenant unless ``--metrics-tenants`` (the endpoint has no
  authentication): every state family passes ``_Aggregated``, which sums away the
  ``tenant`` label, so a per-tenant series added later is summed, not leaked.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    ProcessCollector,
    generate_latest,
    metrics as _client_metrics,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

# From a 4 KiB control round trip on loopback (~100 us) to a multi-GiB transfer.
LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class Metrics:
    def __init__(self, state: Collector) -> None:
        """``state`` reads the daemon's state at scrape time (``service/gauges.py``)."""
        self.registry = CollectorRegistry()
        self._ops = _OpsCollector()
        self.registry.register(self._ops)
        self._refused = Counter("rpcbuf_connections_refused",
                                "Connections turned away, by reason", ["reason"],
                                registry=self.registry)
        self._unexpected = Counter("rpcbuf_ucx_unexpected_dropped",
                                   "UCX messages no request asked for, dropped once old",
                                   registry=self.registry)
        self._unexpected_bytes = Counter("rpcbuf_ucx_unexpected_dropped_bytes",
                                         "Bytes of the UCX messages no request asked for, "
                                         "dropped once old", registry=self.registry)
        self.per_tenant = False  # --metrics-tenants: label series by tenant
        self.registry.register(_Aggregated(state, self))
        ProcessCollector(registry=self.registry)
        self._server: asyncio.AbstractServer | None = None

    def observe(self, op: str, code: str, started: float) -> None:
        """One answered request; ``started`` is its ``time.perf_counter()``."""
        elapsed = time.perf_counter() - started
        ops = self._ops
        key = (op, code)
        counts = ops.counts
        if key in counts:
            counts[key] += 1
        else:
            ops.new_count(key)
        hist = ops.hists.get(op)
        if hist is None:
            hist = ops.new_hist(op)
        hist[bisect_left(_BOUNDS, elapsed)] += 1  # the first bucket with elapsed <= le
        hist[-1] += elapsed

    def unexpected_dropped(self, count: int, nbytes: int) -> None:
        self._unexpected.inc(count)
        self._unexpected_bytes.inc(nbytes)

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
                # A request line starts with a method in capitals: anything
                # else (an rpcbuf client given this port for --listen's)
                # gets its 400 at once, not after ten seconds of waiting
                # for a blank line that never comes.
                first = await reader.readexactly(1)
                head = first if not first.isupper() else first + await reader.readuntil(
                    b"\r\n\r\n")
            parts = head.split(b"\r\n", 1)[0].split()
            method = parts[0] if parts else b""
            path = parts[1].split(b"?", 1)[0] if len(parts) > 1 else b""
            if not first.isupper():
                status, ctype, body = "400 Bad Request", "text/plain", b"HTTP only\n"
            elif method not in (b"GET", b"HEAD"):
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


_BOUNDS = (*LATENCY_BUCKETS, float("inf"))


class _OpsCollector(Collector):
    """The op counters and durations kept as plain numbers by ``Metrics.observe``,
    exposed exactly as a ``Counter`` and a ``Histogram`` would."""

    OPS = ("rpcbuf_ops", "Requests answered, by op and result code")
    LATENCY = ("rpcbuf_op_duration_seconds",
               "Time from a request's arrival to its end (transfers included), by op")

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        # per op: one count per bucket (not cumulative), then the sum of the observations
        self.hists: dict[str, list[Any]] = {}
        self._created: dict[Any, float] = {}

    def new_count(self, key: tuple[str, str]) -> None:
        self._created[key] = time.time()
        self.counts[key] = 1

    def new_hist(self, op: str) -> list[Any]:
        self._created[op] = time.time()
        hist: list[Any] = [0] * len(_BOUNDS) + [0.0]
        self.hists[op] = hist
        return hist

    def collect(self) -> Iterator[Any]:
        # as prometheus_client's own metrics: PROMETHEUS_DISABLE_CREATED_SERIES,
        # disable_created_metrics()
        created = getattr(_client_metrics, "_use_created", True)
        ops = CounterMetricFamily(*self.OPS, labels=["op", "code"])
        for key, n in list(self.counts.items()):
            ops.add_metric(list(key), n, created=self._created[key] if created else None)
        yield ops
        latency = HistogramMetricFamily(*self.LATENCY, labels=["op"])
        for op, hist in list(self.hists.items()):
            buckets, total = [], 0
            for bound, n in zip(_BOUNDS, hist, strict=False):
                total += n
                buckets.append((floatToGoString(bound), total))
            latency.add_metric([op], buckets, hist[-1])
            if created:
                latency.samples.append(Sample(f"{latency.name}_created", {"op": op},
                                              self._created[op]))
        yield latency


class _Aggregated(Collector):
    """``inner``'s families with the ``tenant`` label summed away, unless per tenant."""

    def __init__(self, inner: Collector, metrics: Metrics) -> None:
        self._inner = inner
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        for family in self._inner.collect():
            if self._metrics.per_tenant or not any(
                    "tenant" in sample.labels for sample in family.samples):
                yield family
                continue
            sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items()
                                      if k != "tenant"))
                key = (sample.name, labels)
                if sample.name.endswith("_created"):  # when the first began, not a sum
                    sums[key] = min(sums.get(key, sample.value), sample.value)
                else:
                    sums[key] = sums.get(key, 0.0) + sample.value
            out = Metric(family.name, family.documentation, family.type)
            for (name, labels), value in sums.items():
                out.add_sample(name, dict(labels), value)
            yield out
