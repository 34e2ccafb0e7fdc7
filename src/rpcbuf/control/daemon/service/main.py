"""``rpcbufd``: parse flags (over ``--config``), build the pools, serve until
SIGTERM/SIGINT (drain within ``--drain-timeout``, exit 0). SIGHUP re-reads the keys
and the config's quotas and log level; clients stay connected. Under systemd the
daemon says READY=1 once both listeners are up and pings the watchdog.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import gc
import logging
import os
import resource
import signal
import ssl
import sys
from typing import Any

from rpcbuf.control.daemon.accounting.registry import Pool, Quota, Registry
from rpcbuf.control.daemon.content.diskcache import DiskCache
from rpcbuf.control.daemon.content.modeldirs import ModelFiles
from rpcbuf.control.daemon.observe import logs
from rpcbuf.control.daemon.service import config
from rpcbuf.control.daemon.service.announce import Announcer
from rpcbuf.control.daemon.service.flags import GPU_BACKINGS, GPU_KINDS, build_parser
from rpcbuf.control.daemon.service.sdnotify import Notifier
from rpcbuf.control.daemon.service.server import Daemon, Limits, binding
from rpcbuf.control.fleet.etcd import Etcd, EtcdOptions
from rpcbuf.control.formats.keyfile import load_keys
from rpcbuf.control.wire.membership import (
    parse_registry,
)
from rpcbuf.control.wire.units import format_size, join_host_port
from rpcbuf.dataplane import progress, sockets, ucx, ucxlib
from rpcbuf.dataplane.arena import HostArena, host_memory, host_ram

GC_GEN0 = 20_000  # allocations between young-generation collections (CPython: 700)
log = logging.getLogger("rpcbuf.daemon")


def make_arenas(devices: list[tuple[str, int, int]], gpu_backing: str = "auto") -> list[Any]:
    """One arena per ``--device``. ``DeviceUnavailable`` (a ValueError: exit 2) names a
    device that cannot be served."""
    vmm = GPU_BACKINGS[gpu_backing]
    arenas: list[Any] = []
    for kind, index, size in devices or [("cpu", 0, 1 << 30)]:
        if kind == "cpu":
            arenas.append(HostArena(size, device=index))
        elif kind in GPU_KINDS:
            from rpcbuf.dataplane.cuda_arena import CudaArena, DeviceUnavailable

            try:
                arenas.append(CudaArena(size, device=index, vmm=vmm))
            except DeviceUnavailable as exc:
                raise DeviceUnavailable(f"--device: {exc}") from None
        else:
            raise ValueError(f"--device {kind}:{index}: unknown device kind {kind!r} "
                             "(want cpu or cuda)")
    return arenas


def _more_than_ram(devices: list[tuple[str, int, int]]) -> None:
    """Warn when host arenas add up to more than this machine's memory (they reserve
    address space, and fail only when used)."""
    host = sum(size for kind, _, size in devices or [("cpu", 0, 1 << 30)] if kind == "cpu")
    ram = host_ram()
    if ram and host > ram:
        log.warning("--device: the host arenas add up to %s, more than this machine's %s of "
                    "memory: clients will run out of memory before the arenas are full",
                    format_size(host), format_size(ram))


def _tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not args.tls_cert:
        return None
    # Each file named the way the user gave it: a flag, or the config
    # file's key (a missing tls.cert was reported as --tls-cert).
    names = {d: config.setting(args, d, f"--{d.replace('_', '-')}", getattr(args, d))
             for d in ("tls_cert", "tls_key")}
    for dest, name in names.items():
        path = getattr(args, dest)
        if not os.path.isfile(path):
            raise OSError(f"{name}: " + ("no such file" if not os.path.exists(path)
                                         else "not a file"))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(args.tls_cert, args.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise OSError(f"{names['tls_cert']} / {names['tls_key']}: cannot load: {exc}") from None
    return ctx


def _reload_keys(args: argparse.Namespace, daemon: Daemon) -> None:
    """SIGHUP: the keys from the secret file; an unreadable file keeps the running keys."""
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
    """SIGHUP: the keys, quotas and log level; sessions stay up (but a removed key's)."""
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
        books = daemon.registry.books
        books.quotas = dict(args.quota)
        books.default_quota = args.default_quota[1] if args.default_quota else Quota()
        logs.set_level(args.log_level)
        log.warning("reloaded %s: quotas for %d tenants%s, log level %s", args.config,
                    len(books.quotas), " and a default" if args.default_quota else "",
                    args.log_level)
        if restart:
            log.warning("changed in %s, applied only after a restart: %s", args.config,
                        ", ".join(restart))
    notifier.notify(READY=1, STATUS=daemon.status_line())


def registry_password(args: argparse.Namespace) -> str | None:
    """The etcd password: the file's first line, else the environment (never a flag)."""
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
    """Keep UCX's tcp transport on ``host``'s interface (else it listens on every
    interface); a user's UCX_NET_DEVICES wins."""
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
    """``--ready-file``: it exists exactly while this daemon listens.

    - A killed daemon's file goes first; the line is written (0644, renamed into
      place) once both listeners are up, and removed at exit: only our inode.
    - Liveness is a ``flock`` held for life on ``PATH.lock``, a 0600 file of its own
      (never the world-readable ready file, which any reader could lock). A lock
      file someone else owns is refused by name; it is unlinked at exit while still
      locked, and a lock on an unlinked file is taken again."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock: int | None = None  # PATH.lock, open and locked while we live
        self._written: os.stat_result | None = None  # the ready file we wrote

    def _error(self, exc: OSError, path: str | None = None) -> OSError:
        return OSError(f"--ready-file {path or self.path}: {exc.strerror or exc}")

    def clear(self) -> None:
        """Take the lock and remove a killed daemon's file; OSError while one runs."""
        if not self.path:
            return
        self._take_lock(f"{self.path}.lock")
        try:
            os.unlink(self.path)  # no daemon holds the lock: this one is a dead one's
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._error(exc) from None

    def _take_lock(self, lock: str) -> None:
        while True:
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600)
            except OSError as exc:
                raise self._error(exc, lock) from None
            try:
                st = os.fstat(fd)
                if st.st_uid != os.geteuid():
                    raise OSError(f"--ready-file {self.path}: its lock file {lock} belongs "
                                  f"to uid {st.st_uid}, not this daemon's ({os.geteuid()}): "
                                  "remove it, or give the daemon a directory of its own")
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _same_file(lock, fd):
                    self._lock = fd
                    return
            except BlockingIOError:
                os.close(fd)
                raise OSError(f"--ready-file {self.path}: a running rpcbufd wrote it (give "
                              "each daemon a ready file of its own)") from None
            except FileNotFoundError:
                pass  # unlinked by the daemon that held it, as it exited: try again
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def write(self, line: str) -> None:
        if not self.path:
            return
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise self._error(exc) from None
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o644)  # whatever the umask: pollers of any user read it
                f.write(line)
                f.flush()
                self._written = os.fstat(f.fileno())
            os.replace(tmp, self.path)  # atomic: a poller never sees half a line
        except OSError as exc:
            self._written = None
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise self._error(exc) from None

    def remove(self) -> None:
        """Remove the file this daemon wrote, if still there, and its lock (idempotent)."""
        written, self._written = self._written, None
        lock, self._lock = self._lock, None
        if not self.path:
            return
        with contextlib.suppress(OSError):
            if written is not None:
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) == (written.st_dev, written.st_ino):
                    os.unlink(self.path)
        if lock is not None:
            try:
                with contextlib.suppress(OSError):
                    if _same_file(f"{self.path}.lock", lock):
                        os.unlink(f"{self.path}.lock")  # still locked: see _take_lock
            finally:
                os.close(lock)  # the lock goes with it


def _same_file(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    st, own = os.stat(path), os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


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
    _more_than_ram(args.device)
    arenas = make_arenas(args.device, args.gpu_backing)
    for arena in arenas:  # each new buffer's pages, in a worker thread (controlops)
        host = host_memory(arena)
        if host is not None:  # released, never-exported memfds kept zeroed (kept.py)
            host.prefault.always = bool(args.prefault)
            host.kept.limit = host.size // 4 if args.keep_freed is None else args.keep_freed
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
                    copy_threads=args.copy_threads,
                    max_fds_per_tenant=args.max_fds_per_tenant, fd_reserve=args.fd_reserve,
                    max_buffered_per_tenant=args.max_buffered_per_tenant,
                    frame_timeout=args.frame_timeout)
    daemon = Daemon(registry, keys, node_id=args.node_id or "", cluster=args.cluster,
                    limits=limits, model_files=model_files)
    if model_files is not None:
        log.info("node-local loads may read %s",
                 ", ".join(d.real for d in model_files.dirs))
    if args.cache_dir:
        daemon.content.cache = DiskCache(args.cache_dir, args.cache_size)
    metrics_port = None
    if args.metrics:
        mhost, mport = args.metrics
        daemon.metrics.per_tenant = bool(args.metrics_tenants)
        with binding(config.setting(args, "metrics", "--metrics", f"{mhost}:{mport}"), mport):
            mhost, mport = await daemon.metrics.serve(*args.metrics)
            metrics_port = f":{mport}"
        log.info("metrics at http://%s/metrics%s", join_host_port(mhost, mport),
                 " (labelled by tenant: keep the port the operator's)"
                 if args.metrics_tenants else "")
    host, port = args.listen
    local = None if args.local_socket == "none" else args.local_socket
    await daemon.start(host, port, ucx_port, tls=tls, local_socket=local)
    log.info("listening sockets (TCP, this process, UCX's own included): %s",
             " ".join(daemon.listening) or "none seen")
    # Tenants see the rest (``stats``, for ``rpcbuf doctor``), not where the
    # operator's metrics are (on whichever addresses "--metrics HOST" bound).
    if metrics_port is not None:
        daemon.listening = [a for a in daemon.listening if not a.endswith(metrics_port)]
    # Everything imported and built so far lives as long as the daemon: keep it
    # out of every collection, and collect young objects less often (a
    # 10,000-tensor manifest makes ~10,000 dicts at once; the default threshold
    # of 700 ran collections in the middle of it, 15-20 ms each, measured).
    gc.freeze()
    gc.set_threshold(GC_GEN0, *gc.get_threshold()[1:])
    # The signals are ours before anyone is told we are ready: a SIGTERM sent
    # as soon as the ready file appeared killed the daemon outright (-15, no
    # drain, the ready file left behind), once in a fresh-clone run.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, _reload, args, daemon, notifier)
    ready.write(f"{daemon.address[0]}:{daemon.address[1]} {daemon.ucx_port}\n")
    announcer = _announcer(args, daemon)
    if announcer is not None:
        announcer.start()  # its own task: serving never waits for etcd
    notifier.notify(READY=1, STATUS=daemon.status_line())
    notifier.start_heartbeat(daemon.status_line)
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
