"""The daemon's state as Prometheus gauges, read at scrape time on the event loop
from the daemon's own objects (never copies). Aggregates by kind name no tenant.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rpcbuf.dataplane.arena import host_memory

if TYPE_CHECKING:
    from rpcbuf.control.daemon.accounting.admission import Pending
    from rpcbuf.control.daemon.accounting.registry import Registry
    from rpcbuf.control.daemon.content.blocks import BlockStore
    from rpcbuf.control.daemon.ops.node import Limits


class StateCollector(Collector):
    def __init__(self, registry: Registry, blocks: BlockStore, counters: Mapping[str, int],
                 sessions: Mapping[str, Any], limits: Limits, unauthenticated: Pending[Any],
                 pending_endpoints: Pending[Any]) -> None:
        self.registry, self.blocks, self.counters = registry, blocks, counters
        self.sessions, self.limits = sessions, limits
        self.unauthenticated, self.pending_endpoints = unauthenticated, pending_endpoints

    def collect(self) -> Iterator[Any]:
        c, reg, sessions = self.counters, self.registry, self.sessions
        for name, doc, value in (
            ("rpcbuf_bytes_stored", "Bytes received into buffers", c["bytes_stored"]),
            ("rpcbuf_bytes_read", "Bytes sent out of buffers", c["bytes_read"]),
            ("rpcbuf_bytes_loaded_local", "Bytes read into buffers from --model-dir files",
             c["bytes_loaded_local"]),
            ("rpcbuf_verify_failures", "Stores whose checksum did not match",
             c["verify_failures"]),
            ("rpcbuf_sessions_opened", "Control connections accepted", c["sessions_total"]),
            ("rpcbuf_lease_expiries", "Buffers released because their lease ran out",
             reg.expired_total),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("rpcbuf_sessions", "Open control connections",
                                value=len(sessions))
        yield GaugeMetricFamily("rpcbuf_sessions_limit", "--max-sessions",
                                value=self.limits.max_sessions)
        yield GaugeMetricFamily("rpcbuf_buffers_mapped_writable",
                                "Buffers a same-host client holds a write grant of "
                                "(written in place)",
                                value=sum(s.ops.write_grants.mapped() for s in sessions.values()))
        yield GaugeMetricFamily("rpcbuf_transfers_in_flight", "Data transfers running",
                                value=sum(len(s.ops.transfers) for s in sessions.values()))
        pools = {k: GaugeMetricFamily(f"rpcbuf_pool_{k}", doc, labels=["device"]) for k, doc in (
            ("size_bytes", "Arena size"),
            ("used_bytes", "Bytes handed out (whole allocator blocks)"),
            ("largest_free_bytes", "Largest block that can be allocated now"),
            ("buffers", "Buffers held"),
            ("waiters", "Requests waiting for memory"),
            ("kept_bytes", "Released host memory kept backed, zeroed, for the next buffer "
                           "of the same block (--keep-freed)"),
            ("zeroing_bytes", "Kept host memory not zeroed yet (the zeroer's backlog)"),
        )}
        reused = CounterMetricFamily("rpcbuf_pool_reused_blocks",
                                     "New buffers given a kept block (no fresh memory)",
                                     labels=["device"])
        for key, pool in reg.pools.items():
            st = pool.allocator.stats()
            pools["size_bytes"].add_metric([key], st.total)
            pools["used_bytes"].add_metric([key], st.used)
            pools["largest_free_bytes"].add_metric([key], st.largest_free)
            pools["buffers"].add_metric([key], st.count)
            pools["waiters"].add_metric([key], reg.waiting(pool))
            host = host_memory(pool.arena)
            kept = None if host is None else host.kept
            pools["kept_bytes"].add_metric([key], 0 if kept is None else kept.nbytes)
            pools["zeroing_bytes"].add_metric([key], 0 if kept is None else kept.zeroing_bytes)
            reused.add_metric([key], 0 if kept is None else kept.reused)
        yield from pools.values()
        yield reused
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
        yield from _block_families(self.blocks.totals())
        yield from self._held_families()

    def _held_families(self) -> Iterator[Any]:
        """What tenants and unauthenticated peers make the node hold, by kind."""
        fams = {k: GaugeMetricFamily(f"rpcbuf_held{k}", doc, labels=["kind"]) for k, doc in (
            ("", "What all tenants (or unauthenticated peers) make the node hold, by kind"),
            ("_limit", "The node's limit of a kind (absent: none but the per-tenant one)"),
            ("_per_owner_limit", "The limit of a kind for one tenant (or one source)"),
            ("_largest_owner", "What the one tenant (or source) holding most of a kind holds"),
        )}
        refused = CounterMetricFamily("rpcbuf_held_refusals", "Requests refused with "
                                      "QUOTA_EXCEEDED at a kind's limit", labels=["kind"])
        rows = dict(self.registry.charges.totals())
        lim = self.limits
        for kind, pending, node, per in (
                ("unauthenticated_connections", self.unauthenticated, lim.max_unauthenticated,
                 lim.max_unauthenticated_per_source),
                ("unbound_endpoints", self.pending_endpoints, lim.max_unauthenticated, None)):
            rows[kind] = {"held": len(pending), "limit": node, "per_owner_limit": per,
                          "largest_owner": pending.largest_source(), "refused": None}
        for kind, row in sorted(rows.items()):
            fams[""].add_metric([kind], row["held"])
            fams["_largest_owner"].add_metric([kind], row["largest_owner"])
            for key in ("limit", "per_owner_limit"):
                if row[key] is not None:
                    fams[f"_{key}"].add_metric([kind], row[key])
            if row["refused"] is not None:
                refused.add_metric([kind], row["refused"])
        yield from fams.values()
        yield refused


def _block_families(totals: Mapping[str, Mapping[str, Any]]) -> Iterator[Any]:
    gauges = {k: GaugeMetricFamily(f"rpcbuf_{k}", doc, labels=["tenant"]) for k, doc in (
        ("blocks", "Keyed blocks a tenant holds"),
        ("block_bytes", "Bytes of a tenant's keyed blocks"),
        ("block_segments", "Segments (one fd and mapping each) a tenant's blocks are "
                           "carved from"),
        ("block_segment_bytes", "Bytes of a tenant's block segments (charged to its "
                                "quota; its blocks are slots of them)"))}
    counters = {k: CounterMetricFamily(f"rpcbuf_block_{k}", doc, labels=["tenant"])
                for k, doc in (
        ("hits", "Blocks served by block_get"),
        ("misses", "Blocks block_get asked for that were not there"),
        ("puts", "Blocks committed by block_put"),
        ("evictions", "Blocks evicted (least recently used) to make room"),
        ("expired", "Blocks dropped because their ttl ran out"),
        ("removed", "Blocks removed by block_remove"))}
    for tenant, st in totals.items():
        gauges["blocks"].add_metric([tenant], st["blocks"])
        gauges["block_bytes"].add_metric([tenant], st["bytes"])
        gauges["block_segments"].add_metric([tenant], st["segments"])
        gauges["block_segment_bytes"].add_metric([tenant], st["segment_bytes"])
        for k, fam in counters.items():
            fam.add_metric([tenant], st[k])
    yield from gauges.values()
    yield from counters.values()
