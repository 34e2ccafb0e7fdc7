"""Everything UCX, behind one module: environment defaults, the process-wide
context, listeners, endpoints, and the one translation of ucxx's exceptions
into this module's ``TransferError``s (``control/ucx_errors.py`` maps those
to wire errors).

* Defaults are only ``setdefault`` (the user's environment wins): blocking
  progress (an idle daemon uses no CPU), ``auto`` rendezvous, 2 MiB TCP
  segments, host bounce buffers.  With CUDA memory in use (``cuda_wanted``)
  ``CUDA_DEFAULTS`` adds device bounce buffers (``UCX_RNDV_FRAG_MEM_TYPE``,
  the name ucxx checks before it sets ``cuda`` alone), and a restricted
  ``UCX_TLS`` gains ``cuda_copy,cuda_ipc``, without which UCX cannot move
  device memory.  ``UCX_FORCED`` is set whatever the environment says.
* The context is built here with ``FEATURES`` only: over tcp UCP emulates
  RMA with active messages that read and write any address the peer names
  (the tcp remote key is empty), so a peer that merely reached the UCX port
  could read the node's signing keys.  With no RMA, AM or atomics the worker
  has no handler for them; a context with any on is refused (``UnsafeContext``).
* An endpoint binds to an authenticated control session on ``BIND_TAG``:
  the client sends the nonce it got in ``hello``, the daemon answers a byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import re
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rpcbuf.dataplane import progress, ucxlib
from rpcbuf.dataplane.progress import busy
from rpcbuf.dataplane.ucxlib import UnusableUCX as UnusableUCX

UCX_DEFAULTS: dict[str, str] = {
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_RNDV_SCHEME": "auto",
    "UCX_TCP_TX_SEG_SIZE": "2m",
    "UCX_TCP_RX_SEG_SIZE": "2m",
    "UCX_RNDV_FRAG_MEM_TYPE": "host",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}

# Set whatever the user's environment says (see ``FEATURES`` below): UCX's tcp
# transport writes an incoming PUT to the address its header names, checked
# against nothing, and a peer's UCP uses it whenever this side advertises it.
UCX_FORCED: dict[str, str] = {
    "UCX_TCP_PUT_ENABLE": "n",
}

CUDA_DEFAULTS: dict[str, str] = {  # (UCX_RNDV_SCHEME=auto is every process's default)
    "UCX_RNDV_FRAG_MEM_TYPE": "host,cuda",
}
CUDA_TLS = ("cuda_copy", "cuda_ipc")

_log = logging.getLogger("rpcbuf.ucx")

BIND_TAG = 0  # request ids start at 1, so tag 0 never carries a payload
NONCE_BYTES = 16

_ucxx: Any = None
_library: dict[str, Any] | None = None  # ``library()``, once UCX has started

FEATURES = ("TAG", "WAKEUP", "STREAM")
FORBIDDEN_FEATURES = ("RMA", "AMO32", "AMO64", "AM")


class UnsafeContext(RuntimeError):
    """The UCX context has RMA, atomics or active messages on."""


def cuda_wanted(env: Any = None) -> bool:
    """Whether this process moves CUDA memory: ``RPCBUF_UCX_CUDA`` if set,
    else whether CuPy, or torch with a GPU, is already imported."""
    env = os.environ if env is None else env
    forced = env.get("RPCBUF_UCX_CUDA")
    if forced is not None:
        return forced.strip().lower() in ("1", "true", "yes", "on")
    import sys

    if "cupy" in sys.modules:
        return True
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:
        return False


def with_cuda_tls(tls: str) -> str:
    """``tls`` plus cuda_copy and cuda_ipc, unless it already names CUDA
    transports, is ``all``, or is an exclusion list (``^...``)."""
    names = [t.strip() for t in tls.split(",") if t.strip()]
    if not names or tls.startswith("^") or "all" in names or any(
            t.startswith("cuda") for t in names):
        return tls
    return ",".join(names + [t for t in CUDA_TLS if t not in names])


def apply_defaults(env: dict[str, str] | None = None, cuda: bool | None = None) -> dict[str, str]:
    """Put rpcbuf's UCX defaults into ``env`` (os.environ by default) where
    unset; ``cuda`` (default: ``cuda_wanted()``) picks the CUDA ones."""
    target: Any = os.environ if env is None else env
    forced = target.get("RPCBUF_UCX_CUDA")
    if forced is not None:
        cuda = forced.strip().lower() in ("1", "true", "yes", "on")
    elif cuda is None:
        cuda = cuda_wanted(target)
    if cuda:
        for key, value in CUDA_DEFAULTS.items():
            target.setdefault(key, value)
        if "UCX_TLS" in target:
            tls = with_cuda_tls(target["UCX_TLS"])
            if tls != target["UCX_TLS"]:
                _log.info("UCX_TLS=%s gains %s for CUDA memory", target["UCX_TLS"],
                          ",".join(CUDA_TLS))
                target["UCX_TLS"] = tls
    for key, value in UCX_DEFAULTS.items():
        target.setdefault(key, value)
    for key, value in UCX_FORCED.items():
        if target.get(key, value) != value:
            _log.warning("%s=%s ignored: rpcbuf runs with %s (a peer could write any address "
                         "of this process)", key, target[key], value)
        target[key] = value
    return dict(target)


def ucxx() -> Any:
    """ucxx, imported after the defaults are in place (UCX reads them then)."""
    global _ucxx, _library
    if _ucxx is None:
        apply_defaults()
        ucxlib.select()  # RPCBUF_UCX's library, or UnusableUCX before ucxx loads any
        import ucxx as _mod

        progress.install_adaptive_progress()
        _install_context(_mod)
        _ucxx = _mod
        lib = _library = _describe(None)
        _log.info("UCX %s at %s (%s=%s): modules %s; verbs %s; resources %s", lib["version"],
                  lib["path"], ucxlib.ENV, ucxlib.choice(), ",".join(lib["modules"]) or "-",
                  "yes" if lib["verbs"] else "no (no RDMA)", " ".join(lib["resources"]))
    return _ucxx


def _install_context(mod: Any) -> None:
    """Make ucxx's process-wide context ours, with ``FEATURES`` only: the body
    of ``ApplicationContext.__init__`` (which takes no feature flags), set as
    ``ucxx.core._ctx`` before any ucxx call creates the default one."""
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib_async import application_context as ac

    class Context(ac.ApplicationContext):
        def __init__(self) -> None:
            self.notifier_thread_q = None
            self.notifier_thread = None
            self.progress_mode = None  # each of these three reads ucxx's env variable
            self.enable_delayed_submission = None
            self.enable_python_future = None
            self.connect_timeout = float(os.environ.get("UCXPY_CONNECT_TIMEOUT", 5))
            self.context = ucx_api.UCXContext(
                {}, feature_flags=tuple(getattr(ucx_api.Feature, f) for f in FEATURES))
            check_features(self.context)
            self.worker = ucx_api.UCXWorker(
                self.context, enable_delayed_submission=self.enable_delayed_submission,
                enable_python_future=self.enable_python_future)
            self.start_notifier_thread()
            weakref.finalize(self, ac.clear_progress_tasks)
            self.continuous_ucx_progress()

    core = mod.core
    if core._ctx is not None:
        check_features(core._ctx.context)
        return
    core._ctx = Context()


def check_features(context: Any) -> None:
    """``UnsafeContext`` if ``context`` has any ``FORBIDDEN_FEATURES`` on."""
    import ucxx._lib.libucxx as ucx_api

    flags = int(context.feature_flags)
    on = [f for f in FORBIDDEN_FEATURES if flags & getattr(ucx_api.Feature, f).value]
    if on:
        raise UnsafeContext(
            f"the UCX context has {', '.join(on)} on: a peer could read and write this "
            "process's memory; rpcbuf needs only " + ", ".join(FEATURES))


def features() -> list[str]:
    """The features of this process's UCX context, by name (for stats/doctor)."""
    import ucxx._lib.libucxx as ucx_api

    flags = int(ucxx().core._get_ctx().context.feature_flags)
    return [f.name for f in ucx_api.Feature if flags & f.value]


class TransferError(Exception):
    """A data-plane transfer failed; the endpoint may be unusable."""


class Truncated(TransferError):
    """The peer sent more bytes than the receive buffer holds (or a refusal drained it)."""


class PeerGone(TransferError):
    """The endpoint is closed or its peer vanished."""


class Dropped(TransferError):
    """The janitor dropped the message this receive was for (it waited
    unexpected too long); the receive is not posted."""


class Abandoned(PeerGone):
    """We stopped waiting for the transfers: the session they belong to is gone."""


@contextlib.contextmanager
def _transfer_errors() -> Iterator[None]:
    """ucxx's failures inside the block as ``TransferError``s (ours and
    cancellation pass as they are)."""
    try:
        yield
    except TransferError:
        raise
    except Exception as exc:
        ex = ucxx().exceptions
        if isinstance(exc, ex.UCXMessageTruncatedError):
            raise Truncated(str(exc)) from exc
        if isinstance(exc, (ex.UCXCanceled, ex.UCXCloseError, ex.UCXConnectionResetError,
                            ex.UCXNotConnectedError, ex.UCXEndpointTimeoutError)):
            raise PeerGone(str(exc) or type(exc).__name__) from exc
        raise TransferError(f"{type(exc).__name__}: {exc}") from exc


async def transfer_all(coros: Any, deadline: float, on_expired: Any,
                       abandon: asyncio.Future[Any] | None = None) -> None:
    """Await every transfer, even after one fails (UCX may touch its memory
    until each ends), then raise the first failure.  Past ``deadline``
    seconds ``on_expired()`` must abort the endpoint (every transfer ends).

    ``abandon`` done (the control connection lost) ends the wait at once,
    cancelling the transfers, with ``Abandoned``: an aborted endpoint is not
    enough (a receive ucxx re-posted on the worker after an endpoint error
    belongs to no endpoint, and one matched to a dead peer never ends).  The
    caller must have aborted the endpoint and keeps the memory referenced a
    while (UCX may still hold it)."""
    timer = asyncio.get_running_loop().call_later(deadline, on_expired)
    gathered = asyncio.gather(*coros, return_exceptions=True)

    def _stop(_: Any) -> None:
        gathered.cancel()

    if abandon is not None:
        if abandon.done():
            gathered.cancel()
        else:
            abandon.add_done_callback(_stop)
    try:
        results = await gathered
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if abandon is None or not abandon.done() or (task is not None and task.cancelling()):
            raise  # our caller was cancelled, not the session lost
        raise Abandoned("the session's control connection was lost") from None
    finally:
        timer.cancel()
        if abandon is not None:
            abandon.remove_done_callback(_stop)
    for r in results:
        if isinstance(r, BaseException):
            raise r


def wire_tag(key: int, tag: Any) -> int:
    """The 64-bit UCX tag of ``tag`` (an int or a tuple of ints) under tag
    key ``key``: ucxx's own mix, computed here so the janitor knows a dropped
    message's tag and both sides agree without ucxx's handshake."""
    h = hashlib.sha1(repr((key, hash(tag))).encode()).digest()
    return int.from_bytes(h[:8], "big")


def _never_dropped(wire: int) -> bool:
    return False


class DataEndpoint:
    """A UCX endpoint whose tagged send/recv raise ``TransferError``s only.
    ``dropped(wire)`` (the janitor's) is asked in the same loop step as a
    receive's post: a message dropped earlier fails it at once (``Dropped``)
    instead of at the transfer deadline."""

    def __init__(self, ep: Any, keys: tuple[int, int] | None = None,
                 dropped: Any = _never_dropped) -> None:
        self._ep = ep
        if keys is None:
            tags = ep._tags  # ucxx's listener handshake: (msg_send, msg_recv)
            keys = (int(tags["msg_send"]), int(tags["msg_recv"]))
        self._send_key, self._recv_key = keys
        self.dropped = dropped

    @property
    def closed(self) -> bool:
        return self._ep is None or bool(self._ep.closed)

    def _live(self) -> Any:
        if self._ep is None:
            raise PeerGone("endpoint closed")
        return self._ep

    def recv_tag(self, tag: Any) -> int:
        """The UCX tag a receive for ``tag`` matches (what the janitor sees)."""
        return wire_tag(self._recv_key, tag)

    async def send(self, buf: Any, tag: Any) -> None:
        ep = self._live()
        with _transfer_errors(), busy():
            await ep.send(buf, tag=wire_tag(self._send_key, tag), force_tag=True)

    async def recv(self, buf: Any, tag: Any) -> None:
        ep = self._live()
        wire = wire_tag(self._recv_key, tag)
        if self.dropped(wire):  # (no await between this check and the post below)
            raise Dropped(f"the message of tag {tag!r} waited too long unexpected and was "
                          "dropped")
        with _transfer_errors(), busy():
            await ep.recv(buf, tag=wire, force_tag=True)

    def abort(self) -> None:
        """Close at once; UCX cancels every request still posted on it."""
        ep, self._ep = self._ep, None
        if ep is not None:
            try:
                ep.abort()
            except Exception:  # already broken: nothing left to close
                pass

    async def close(self) -> None:
        ep, self._ep = self._ep, None
        if ep is not None:
            try:
                await ep.close()
            except Exception:
                ep.abort()


class DataListener:
    """A UCX listener; ``on_endpoint(DataEndpoint)`` runs for each new peer."""

    def __init__(self, on_endpoint: Any, port: int = 0) -> None:
        async def _accept(ep: Any) -> None:
            await on_endpoint(DataEndpoint(ep))

        try:
            self._listener: Any = ucxx().create_listener(_accept, port=port)
        except ucxx().exceptions.UCXBusyError as exc:
            # UCX's word for a port that another socket holds: the caller
            # says which flag it came from.
            raise OSError(errno.EADDRINUSE, f"UCX port {port} is in use") from exc

    @property
    def port(self) -> int:
        return int(self._listener.port)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None


async def connect(host: str, port: int, timeout: float = 10.0) -> DataEndpoint:
    mod = ucxx()  # UnusableUCX as itself: no endpoint error
    with _transfer_errors():
        try:
            async with asyncio.timeout(timeout):
                with busy():
                    ep = await mod.create_endpoint(host, port)
        except TimeoutError as exc:
            raise PeerGone(f"UCX connect to {host}:{port} timed out") from exc
    return DataEndpoint(ep)


def rdma_devices() -> list[str]:
    """The RDMA devices the kernel knows (``/sys/class/infiniband``), at most 64."""
    path = Path("/sys/class/infiniband")
    return sorted(p.name for p in path.iterdir())[:64] if path.is_dir() else []


_RESOURCE = re.compile(r"resource \d+\s*:\s*md \d+\s+dev \d+\s+flags \S*\s+(\S+)")


def library() -> dict[str, Any]:
    """Which UCX this process runs on, for ``stats`` and ``doctor``: the
    ``path`` of the libucp mapped, its ``version``, the transport ``modules``
    beside it (``ib``: built with verbs; the pip wheel has none), the
    context's ``resources`` and ``features``, or ``error``: why UCX would not
    start.  Found once (do not change the dict); a failed start is retried."""
    if _library is not None:
        return _library
    try:
        ucxx()
    except Exception as exc:  # what UCX says, for doctor to show: not a crash
        return _describe(f"{type(exc).__name__}: {exc}")
    assert _library is not None  # ucxx() found it
    return _library


def _describe(error: str | None) -> dict[str, Any]:
    path, version = ucxlib.libucp()
    modules: list[str] = []
    if path is not None:
        with contextlib.suppress(OSError):
            names = os.listdir(os.path.join(os.path.dirname(path), "ucx"))
            modules = sorted({m.group(1) for n in names
                              if (m := re.fullmatch(r"libuct_(\w+)\.so(?:\.\d+)*", n))})
    resources: list[str] = []
    if error is None:
        info = ucxx().core._get_ctx().context.info
        resources = list(dict.fromkeys(m.group(1) for m in _RESOURCE.finditer(info)))[:64]
    return {"path": path, "version": version, "modules": modules, "verbs": "ib" in modules,
            "rdmacm": "rdmacm" in modules, "cuda": "cuda" in modules, "resources": resources,
            "features": features() if error is None else [], "error": error}
