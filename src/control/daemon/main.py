"""``rpcbufd``: parse flags (over ``--config``), build the pools, serve until
SIGTERM/SIGINT.

SIGTERM stops accepting new sessions and requests, lets in-flight transfers
finish (bounded by ``--drain-timeout``), closes every session and exits 0.
SIGHUP re-reads the node's keys from the secret file (sessions whose key was
removed end; see ``auth``) and quotas and the log level from the config file;
other clients stay connected.  Under systemd (``Type=notify``) the daemon says READY=1 once
both listeners are up and pings the watchdog from its event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import resource
import signal
import ssl
import sys
from typing import Any

from control.daemon import config, logs
from control.daemon.announce import Announcer
from control.daemon.diskcache import DiskCache
from control.daemon.modeldirs import ModelFiles
from control.daemon.registry import Pool, Quota, Registry
from control.daemon.sdnotify import Notifier
from control.daemon.server import Daemon, Limits, binding
from control.fleet.etcd import Etcd, EtcdOptions
from control.wire.auth import load_keys
from control.wire.membership import (
    DEFAULT_CLUSTER,
    DEFAULT_TTL,
    RecordError,
    check_name,
    check_node_id,
    parse_registry,
)
from control.wire.units import format_size, parse_duration, parse_size, split_host_port
from control.wire.version import describe
from dataplane import progress, sockets, ucx, ucxlib
from dataplane.allocators import ALLOCATORS
from dataplane.arena import HostArena

GC_GEN0 = 20_000  # allocations between young-generation collections (CPython: 700)
log = logging.getLogger("rpcbuf.daemon")


def _host_port(text: str, default_port: int) -> tuple[str, int]:
    try:
        return split_host_port(text, default_port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad address {text!r} (want HOST:PORT)") from None


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
    p = argparse.ArgumentParser(
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
    p.add_argument("--ucx-port", type=int, default=7701, help="UCX listener port (0 = any) "
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
    p.add_argument("--hello-timeout", type=parse_duration, default=Limits.hello_timeout,
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
    p.add_argument("--copy-threads", type=_positive_int, default=Limits.copy_threads,
                   help="threads for same-host copies; one tenant may use at most half of "
                        "them at once [%(default)s]")
    p.add_argument("--transfer-timeout", type=parse_duration, default=Limits.transfer_timeout,
                   help="deadline of one data transfer, e.g. 300s [%(default)s]")
    p.add_argument("--drain-timeout", type=parse_duration, default=Limits.drain_timeout,
                   help="how long SIGTERM waits for in-flight transfers [%(default)s]")
    p.add_argument("--node-id", type=_node_id, default=None,
                   help="this daemon's name in hello, stats and the registry; unique in its "
                        "cluster [this host's name and the --listen port: HOST:PORT]")
    p.add_argument("--ready-file", help="write 'HOST:PORT UCX_PORT' here once listening; "
                   "removed when the daemon exits (and at start, if a killed one left it)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="the normal log on stderr: text lines or JSON objects [%(default)s]")
    p.add_argument("--audit-log", metavar="PATH",
                   help="write the audit trail (one JSON line per memory op) here instead of "
                        "into the normal log")
    p.add_argument("--metrics", type=_metrics_addr, metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics")
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


GPU_KINDS = ("cuda", "gpu")
# --gpu-backing -> CudaArena(vmm=...): None is VMM where the probe works, else CuPy
GPU_BACKINGS: dict[str, bool | None] = {"auto": None, "vmm": True, "cupy": False}


def make_arenas(devices: list[tuple[str, int, int]], gpu_backing: str = "auto") -> list[Any]:
    """One arena per ``--device``, GPU ones backed as ``--gpu-backing`` says.
    A device that cannot be served (no CuPy, no such GPU, not enough memory,
    no VMM under ``vmm``) raises ``DeviceUnavailable`` (a ValueError:
    ``main`` prints it and exits 2) naming the device."""
    vmm = GPU_BACKINGS[gpu_backing]
    arenas: list[Any] = []
    for kind, index, size in devices or [("cpu", 0, 1 << 30)]:
        if kind == "cpu":
            arenas.append(HostArena(size, device=index))
        elif kind in GPU_KINDS:
            from dataplane.cuda_arena import CudaArena, DeviceUnavailable

            try:
                arenas.append(CudaArena(size, device=index, vmm=vmm))
            except DeviceUnavailable as exc:
                raise DeviceUnavailable(f"--device: {exc}") from None
        else:
            raise ValueError(f"--device {kind}:{index}: unknown device kind {kind!r} "
                             "(want cpu or cuda)")
    return arenas


def _tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not args.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(args.tls_cert, args.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise OSError(f"--tls-cert {args.tls_cert} / --tls-key {args.tls_key}: "
                      f"cannot load: {exc}") from None
    return ctx


def _reload_keys(args: argparse.Namespace, daemon: Daemon) -> None:
    """SIGHUP: the node's keys from the secret file, so rotating a key needs
    no restart; a file that cannot be read keeps the running keys."""
    try:
        keys = load_keys(args.secret_file, create=False)
    except (OSError, ValueError) as exc:
        log.error("SIGHUP: keeping the running keys: %s", exc)
        return
    ended = daemon.set_keys(keys)
    log.warning("SIGHUP: re-read %s: keys %s (new tokens: %s)%s", args.secret_file,
                ", ".join(keys.kids), keys.newest,
                f"; ended {ended} sessions of removed keys" if ended else "")


def _reload(args: argparse.Namespace, daemon: Daemon, notifier: Notifier) -> None:
    """SIGHUP: the keys, and quotas and log level from the config file;
    sessions stay up (but those of a removed key)."""
    _reload_keys(args, daemon)
    if not args.config:
        log.warning("SIGHUP: started without --config, nothing to reload but the secret file")
        return
    notifier.notify(RELOADING=1, STATUS=f"reloading {args.config}")
    try:
        restart = config.reload(args, build_parser())
    except config.ConfigError as exc:
        log.error("reload failed, keeping the running settings: %s", exc)
    else:
        daemon.registry.quotas = dict(args.quota)
        daemon.registry.default_quota = args.default_quota[1] if args.default_quota else Quota()
        logs.set_level(args.log_level)
        log.warning("reloaded %s: quotas for %d tenants%s, log level %s", args.config,
                    len(daemon.registry.quotas), " and a default" if args.default_quota else "",
                    args.log_level)
        if restart:
            log.warning("changed in %s, applied only after a restart: %s", args.config,
                        ", ".join(restart))
    notifier.notify(READY=1, STATUS=daemon.status_line())


def registry_password(args: argparse.Namespace) -> str | None:
    """The etcd user's password: the file's first line, else the environment
    (never a flag: a flag shows in ``ps``)."""
    if not args.registry_user:
        return None
    if args.registry_password_file:
        try:
            with open(args.registry_password_file) as f:
                return f.readline().rstrip("\n")
        except OSError as exc:
            raise OSError(f"--registry-password-file {args.registry_password_file}: "
                          f"{exc.strerror or exc}") from None
    password = os.environ.get("RPCBUF_REGISTRY_PASSWORD")
    if password is None:
        raise ValueError("--registry-user needs --registry-password-file or "
                         "$RPCBUF_REGISTRY_PASSWORD")
    return password


def _announcer(args: argparse.Namespace, daemon: Daemon) -> Announcer | None:
    if not args.registry:
        return None
    options = EtcdOptions(ca=args.registry_ca, cert=args.registry_cert, key=args.registry_key,
                          user=args.registry_user, password=registry_password(args))
    etcd = Etcd(parse_registry(args.registry), options)
    return Announcer(daemon, etcd, args.cluster, advertise=args.advertise,
                     ttl=args.registry_ttl)


def _ucx_interface(host: str) -> None:
    """Keep UCX's tcp transport on the interface that holds ``host``: UCX
    opens a listening socket on every interface it uses (UCX_NET_DEVICES,
    all by default), so a daemon told to listen on 127.0.0.1 exposed its
    data plane on every network it was on.  A user's UCX_NET_DEVICES wins."""
    if os.environ.get("UCX_NET_DEVICES"):
        return
    name = sockets.interface_of(host)
    if name is None:
        log.warning("UCX uses every network interface: %s names none of this host's IPv4 "
                    "addresses (set UCX_NET_DEVICES, or --ucx-listen HOST:PORT)", host)
        return
    os.environ["UCX_NET_DEVICES"] = name
    log.info("UCX_NET_DEVICES=%s (the interface of %s)", name, host)


def raise_fd_limit() -> None:
    """Open files up to the hard limit: each host buffer holds a memfd."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.debug("open files: %d -> %d", soft, hard)


class ReadyFile:
    """``--ready-file``: it exists exactly while this daemon listens.  A
    file left by a daemon that was killed goes before anything else (a
    poller must not take it for this daemon's), the line is written once
    both listeners are up, and goes again when the daemon exits, however
    it exits, unless another daemon has written its own there since."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.line: str | None = None

    def clear(self) -> None:
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise OSError(f"--ready-file {self.path}: {exc.strerror or exc}") from None

    def write(self, line: str) -> None:
        if not self.path:
            return
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(line)
            os.replace(tmp, self.path)  # atomic: a poller never sees half a line
        except OSError as exc:
            raise OSError(f"--ready-file {self.path}: {exc.strerror or exc}") from None
        self.line = line

    def remove(self) -> None:
        if not self.path or self.line is None:
            return
        with contextlib.suppress(OSError):
            with open(self.path) as f:
                if f.read() != self.line:
                    return  # another daemon's now
            os.unlink(self.path)


async def serve(args: argparse.Namespace, ready: ReadyFile) -> int:
    notifier = Notifier()
    notifier.notify(STATUS="starting")
    tls = _tls(args)
    ucx_host, ucx_port = args.ucx_listen or (args.listen[0], args.ucx_port)
    _ucx_interface(ucx_host)
    ucx.apply_defaults(cuda=any(kind in GPU_KINDS for kind, _, _ in args.device))
    # RPCBUF_UCX's library, loaded (or refused: UnusableUCX) before anything is
    # set up; its context is made later, as before (Daemon.start)
    ucxlib.select()
    keys = load_keys(args.secret_file)
    raise_fd_limit()  # one memfd per host buffer
    model_files = ModelFiles(args.model_dir) if args.model_dir else None  # ValueError: exit 2
    arenas = make_arenas(args.device, args.gpu_backing)
    for arena in arenas:  # each new buffer's pages, in a worker thread (controlops)
        if hasattr(arena, "prefault_range"):
            arena.prefault = bool(args.prefault)
        if hasattr(arena, "keep"):  # released, never-exported memfds kept zeroed (arena.py)
            arena.keep = arena.size // 4 if args.keep_freed is None else args.keep_freed
    pools = [Pool.create(a, args.allocator) for a in arenas]
    default = args.default_quota[1] if args.default_quota else None
    registry = Registry(pools, dict(args.quota), default)
    limits = Limits(max_frame=args.max_frame, max_inflight=args.max_inflight,
                    transfer_timeout=args.transfer_timeout, drain_timeout=args.drain_timeout,
                    max_sessions=args.max_sessions,
                    max_sessions_per_tenant=args.max_sessions_per_tenant,
                    hello_timeout=args.hello_timeout,
                    max_unauthenticated=args.max_unauthenticated,
                    max_unauthenticated_per_source=args.max_unauthenticated_per_source,
                    copy_threads=args.copy_threads)
    daemon = Daemon(registry, keys, node_id=args.node_id or "", cluster=args.cluster,
                    limits=limits, model_files=model_files)
    if model_files is not None:
        log.info("node-local loads may read %s",
                 ", ".join(d.real for d in model_files.dirs))
    if args.cache_dir:
        daemon.content.cache = DiskCache(args.cache_dir, args.cache_size)
    if args.metrics:
        mhost, mport = args.metrics
        with binding(config.setting(args, "metrics", "--metrics", f"{mhost}:{mport}"), mport):
            mhost, mport = await daemon.metrics.serve(*args.metrics)
        log.info("metrics at http://%s:%d/metrics", mhost, mport)
    host, port = args.listen
    local = None if args.local_socket == "none" else args.local_socket
    await daemon.start(host, port, ucx_port, tls=tls, local_socket=local)
    log.info("listening sockets (TCP, this process, UCX's own included): %s",
             " ".join(daemon.listening) or "none seen")
    # Everything imported and built so far lives as long as the daemon: keep it
    # out of every collection, and collect young objects less often (a
    # 10,000-tensor manifest makes ~10,000 dicts at once; the default threshold
    # of 700 ran collections in the middle of it, 15-20 ms each, measured).
    gc.freeze()
    gc.set_threshold(GC_GEN0, *gc.get_threshold()[1:])
    ready.write(f"{daemon.address[0]}:{daemon.address[1]} {daemon.ucx_port}\n")
    announcer = _announcer(args, daemon)
    if announcer is not None:
        announcer.start()  # its own task: serving never waits for etcd
    notifier.notify(READY=1, STATUS=daemon.status_line())
    notifier.start_heartbeat(daemon.status_line)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, _reload, args, daemon, notifier)
    await stop.wait()
    ready.remove()  # before the listeners close: it never names a port that is gone
    notifier.notify(STOPPING=1, STATUS=f"stopping: {len(daemon.sessions)} sessions")
    if announcer is not None:
        await announcer.stop()  # clients stop choosing this node before it drains
    await daemon.shutdown()
    await daemon.content.aclose(args.drain_timeout)  # finish disk-cache writes
    notifier.close()
    await progress.stop_progress()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = config.resolve(build_parser(), argv)
    except config.ConfigError as exc:
        print(f"rpcbufd: {exc}", file=sys.stderr)
        return 2
    try:
        logs.setup(args.log_level, args.log_format, args.audit_log)
    except OSError as exc:
        named = config.setting(args, "audit_log", "--audit-log", args.audit_log)
        print(f"rpcbufd: {named}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    import uvloop

    ready = ReadyFile(args.ready_file)
    try:
        ready.clear()
        return uvloop.run(serve(args, ready))
    except (OSError, ValueError, ucx.UnusableUCX) as exc:
        print(f"rpcbufd: {exc}", file=sys.stderr)
        return 2
    finally:
        ready.remove()


if __name__ == "__main__":
    sys.exit(main())
