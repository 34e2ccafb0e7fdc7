"""``rpcbufd``'s command line: every flag, its type (a checker that names what it
wants) and its help; ``--config`` supplies defaults under the same names.
"""

from __future__ import annotations

import argparse

from rpcbuf.control.daemon.accounting.registry import Quota
from rpcbuf.control.daemon.service.server import Limits
from rpcbuf.control.flagparse import Parser
from rpcbuf.control.wire.membership import (
    DEFAULT_CLUSTER,
    DEFAULT_TTL,
    RecordError,
    check_name,
    check_node_id,
    parse_registry,
)
from rpcbuf.control.wire.units import (
    check_port,
    format_size,
    parse_duration,
    parse_size,
    split_host_port,
)
from rpcbuf.control.wire.version import describe
from rpcbuf.dataplane.allocators import ALLOCATORS

GPU_KINDS = ("cuda", "gpu")
# --gpu-backing -> CudaArena(vmm=...): None is VMM where the probe works, else CuPy
GPU_BACKINGS: dict[str, bool | None] = {"auto": None, "vmm": True, "cupy": False}


def _host_port(text: str, default_port: int) -> tuple[str, int]:
    try:
        return split_host_port(text, default_port)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad address {text!r}: {exc} (want HOST:PORT)"
                                         ) from None


def _port(text: str) -> int:
    try:
        return check_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration(text: str) -> float:
    """A duration above zero (``parse_duration``: 90s, 30m, 24h)."""
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be longer than 0")
    return value


def _listen(text: str) -> tuple[str, int]:
    return _host_port(text, 7700)


def _ucx_listen(text: str) -> tuple[str, int]:
    return _host_port(text, 7701)


def _metrics_addr(text: str) -> tuple[str, int]:
    return _host_port(text, 9700)


def _size_or_zero(text: str) -> int:
    """A size (``parse_size``), or 0."""
    return 0 if text.strip() == "0" else parse_size(text)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _registry(text: str) -> str:
    try:
        return str(parse_registry(text))
    except RecordError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _node_id(text: str) -> str:
    try:
        return check_node_id("--node-id", text)
    except RecordError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cluster_name(text: str) -> str:
    try:
        return check_name("cluster", text)
    except RecordError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _device(text: str) -> tuple[str, int, int]:
    """'cpu:1GiB' -> ('cpu', 0, size); 'cpu:1:1GiB' -> ('cpu', 1, size)."""
    parts = text.split(":")
    try:
        if len(parts) == 2:
            return parts[0].lower(), 0, parse_size(parts[1])
        if len(parts) == 3:
            return parts[0].lower(), int(parts[1]), parse_size(parts[2])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--device {text!r}: {exc}") from None
    raise argparse.ArgumentTypeError(f"--device {text!r}: want cpu:SIZE or cuda:N:SIZE")


def _quota(text: str) -> tuple[str, Quota]:
    """'alice:1GiB:100' -> per-tenant bytes per device and buffer count ('-' = none)."""
    try:
        tenant, size, count = text.split(":")
        return tenant, Quota(None if size == "-" else parse_size(size),
                             None if count == "-" else int(count))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--quota {text!r}: want TENANT:BYTES:BUFFERS, e.g. alice:8GiB:1000 ({exc})"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="rpcbufd",
        description="rpcbuf node daemon: owns this node's buffer pool and serves it to "
                    "authenticated clients (control: msgpack over TCP; data: UCX).",
        epilog="example: rpcbufd --listen 127.0.0.1:7700 --ucx-port 7701 --device cpu:1GiB "
               "--secret-file /etc/rpcbuf/secret",
    )
    p.add_argument("--version", action="version", version=describe("rpcbufd"))
    p.add_argument("--listen", default=("127.0.0.1", 7700), type=_listen, metavar="HOST:PORT",
                   help="control address HOST:PORT "
                   "(port 0 picks a free one) [127.0.0.1:7700]")
    p.add_argument("--ucx-port", type=_port, default=7701, help="UCX listener port (0 = any) "
                   "[%(default)s]")
    p.add_argument("--ucx-listen", type=_ucx_listen, default=None, metavar="HOST:PORT",
                   help="the UCX data plane's address: UCX's tcp transport uses only the "
                   "interface that holds HOST (UCX_NET_DEVICES, unless set), and the listener "
                   "takes PORT [the --listen host, --ucx-port]")
    p.add_argument("--local-socket", default="auto", metavar="auto|none|@NAME|PATH",
                   help="the same-host path: a Unix control socket through which clients "
                        "on this host reconnect to, share memory with the daemon by "
                        "handle (a staging area, read-only attachments of their "
                        "buffers) and skip UCX; auto = an abstract socket named after "
                        "the daemon's pid, none = off [%(default)s]")
    p.add_argument("--device", action="append", type=_device, default=[], metavar="SPEC",
                   help="a device and its arena size, repeatable: cpu:SIZE (e.g. cpu:1GiB) "
                        "or cuda:N:SIZE (GPU N through CuPy, e.g. cuda:0:40GiB); "
                        "default cpu:1GiB")
    p.add_argument("--gpu-backing", choices=GPU_BACKINGS, default="auto",
                   help="GPU arenas' memory: vmm (a CUDA VMM allocation per buffer, which "
                        "attach shares by handle; start fails where it cannot), cupy (one "
                        "CuPy allocation: no attach, but UCX's cuda_ipc shares it by legacy "
                        "IPC handle) or auto (vmm where the start-up probe works, else cupy) "
                        "[%(default)s]")
    p.add_argument("--config", metavar="FILE.toml",
                   help="settings file (flags given here override it); SIGHUP re-reads its "
                        "quotas and log level")
    p.add_argument("--secret-file", help="the node's keys that tokens are signed with, one "
                   "'KEY_ID SECRET' a line (a bare secret is key 'default'; created 0600 with "
                   "one key if missing); SIGHUP re-reads it; required, here or in --config")
    p.add_argument("--allocator", default="buddy", choices=sorted(ALLOCATORS))
    p.add_argument("--quota", action="append", type=_quota, default=[], metavar="T:BYTES:N",
                   help="per-tenant quota: bytes per device and buffer count, repeatable")
    p.add_argument("--default-quota", type=_quota, metavar="*:BYTES:N",
                   help="quota for tenants without their own --quota")
    p.add_argument("--max-frame", type=parse_size, default=Limits.max_frame,
                   help=f"largest control frame accepted [{format_size(Limits.max_frame)}]")
    p.add_argument("--max-inflight", type=_positive_int, default=Limits.max_inflight,
                   help="requests one client may have in flight [%(default)s]")
    p.add_argument("--max-sessions", type=_positive_int, default=Limits.max_sessions,
                   help="authenticated control connections served at once; a hello beyond "
                        "it is refused with QUOTA_EXCEEDED [%(default)s]")
    p.add_argument("--max-sessions-per-tenant", type=_positive_int,
                   default=Limits.max_sessions_per_tenant,
                   help="authenticated sessions one tenant may have at once (of "
                        "--max-sessions); a hello beyond it is refused with QUOTA_EXCEEDED "
                        "[%(default)s]")
    p.add_argument("--hello-timeout", type=_duration, default=Limits.hello_timeout,
                   help="a connection must have said hello this long after it was accepted, "
                        "or it is closed (one deadline, however it trickles) [%(default)s]")
    p.add_argument("--max-unauthenticated", type=_positive_int,
                   default=Limits.max_unauthenticated,
                   help="connections that have not said hello yet, and (counted apart) UCX "
                        "endpoints not yet bound to a session, at once; beyond it the oldest "
                        "is closed to make room [%(default)s]")
    p.add_argument("--max-unauthenticated-per-source", type=_positive_int,
                   default=Limits.max_unauthenticated_per_source,
                   help="the same, per source address (per user on the Unix socket) "
                        "[%(default)s]")
    p.add_argument("--max-fds-per-tenant", type=_positive_int, default=None,
                   help="file descriptors (and memory mappings) one tenant's host buffers "
                        "and blocks may hold at once; past it QUOTA_EXCEEDED [half of the "
                        "node's: open files less --fd-reserve]")
    p.add_argument("--fd-reserve", type=_positive_int, default=None,
                   help="file descriptors kept for sessions, sockets and logs, never given "
                        "to buffers [3 per --max-sessions, 2 per --max-unauthenticated, +256]")
    p.add_argument("--max-buffered-per-tenant", type=parse_size,
                   default=Limits.max_buffered_per_tenant,
                   help="control bytes one tenant's sessions may have sent that are not yet "
                        "a whole frame; past it the session ends with QUOTA_EXCEEDED "
                        f"[{format_size(Limits.max_buffered_per_tenant)}]")
    p.add_argument("--frame-timeout", type=_duration, default=Limits.frame_timeout,
                   help="a control frame must arrive whole this long after its first byte, "
                        "or the session ends [%(default)s]")
    p.add_argument("--copy-threads", type=_positive_int, default=Limits.copy_threads,
                   help="threads for same-host copies; one tenant may use at most half of "
                        "them at once [%(default)s]")
    p.add_argument("--transfer-timeout", type=_duration, default=Limits.transfer_timeout,
                   help="deadline of one data transfer, e.g. 300s [%(default)s]")
    p.add_argument("--drain-timeout", type=_duration, default=Limits.drain_timeout,
                   help="how long SIGTERM waits for in-flight transfers [%(default)s]")
    p.add_argument("--node-id", type=_node_id, default=None,
                   help="this daemon's name in hello, stats and the registry; unique in its "
                        "cluster [this host's name and the --listen port: HOST:PORT]")
    p.add_argument("--ready-file", help="write 'HOST:PORT UCX_PORT' here once listening; "
                   "removed when the daemon exits (and at start, if a killed one left it; "
                   "a running one's: no start; told by its lock on FILE.lock, mode 0600)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="the normal log on stderr: text lines or JSON objects [%(default)s]")
    p.add_argument("--audit-log", metavar="PATH",
                   help="write the audit trail (one JSON line per memory op) here instead of "
                        "into the normal log")
    p.add_argument("--metrics", type=_metrics_addr, metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (no "
                        "authentication: node-wide figures, no tenant names)")
    p.add_argument("--metrics-tenants", action="store_true",
                   help="label the metrics' per-tenant series by tenant (then only the "
                        "operator may reach --metrics: it names every tenant)")
    p.add_argument("--tls-cert", metavar="PEM", help="TLS for the control channel: "
                   "certificate chain (with --tls-key)")
    p.add_argument("--tls-key", metavar="PEM", help="TLS private key (with --tls-cert)")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="keep stored tensor contents here by hash, so a restarted daemon "
                        "still deduplicates uploads (per tenant, checksummed, LRU)")
    p.add_argument("--cache-size", type=parse_size, default=8 << 30, metavar="SIZE",
                   help="bound of --cache-dir; least recently used contents go first [8GiB]")
    p.add_argument("--model-dir", action="append", default=[], metavar="DIR",
                   help="a directory whose model files (safetensors, GGUF) every tenant may "
                        "load from this node's own disk (rpcbuf load --from-node); "
                        "repeatable; nothing outside these is ever read (config: model_dirs)")
    reg = p.add_argument_group("fleet registry (docs/cluster.md, \"Running a fleet\")")
    reg.add_argument("--registry", type=_registry, metavar="etcd://HOST:PORT[,HOST:PORT]",
                     help="register this node in etcd (a key on a lease, kept alive; deleted "
                          "on SIGTERM) so that clients find it; losing etcd never stops serving")
    reg.add_argument("--advertise", metavar="HOST:PORT",
                     help="the control address clients should dial [the --listen address]")
    reg.add_argument("--cluster", default=DEFAULT_CLUSTER, type=_cluster_name,
                     help="the cluster this node is of: the key prefix it registers "
                          "under, and what a token's audience must name (or this node "
                          "in it; docs/tokens.md) [%(default)s]")
    reg.add_argument("--registry-ttl", type=_positive_int, default=DEFAULT_TTL, metavar="S",
                     help="seconds of the lease: a crashed node disappears this long after "
                          "[%(default)s]")
    reg.add_argument("--registry-ca", metavar="PEM", help="TLS to etcd: the CA to trust")
    reg.add_argument("--registry-cert", metavar="PEM",
                     help="TLS client certificate for etcd (with --registry-key)")
    reg.add_argument("--registry-key", metavar="PEM", help="its private key")
    reg.add_argument("--registry-user", help="etcd user (its password from "
                     "--registry-password-file or $RPCBUF_REGISTRY_PASSWORD)")
    reg.add_argument("--registry-password-file", metavar="FILE",
                     help="the etcd user's password, the file's first line")
    p.add_argument("--keep-freed", type=_size_or_zero, default=None, metavar="SIZE",
                   help="keep up to this much released host memory backed (zeroed) for the "
                        "next buffer of the same block, instead of giving it back to the "
                        "system; 0: never [a quarter of each host arena]")
    p.add_argument("--prefault", action="store_true",
                   help="back every new host buffer with memory before request_buffer "
                        "answers, whatever its size (without it: buffers of 8 MiB or more), "
                        "so first writes into it do not page-fault")
    return p

