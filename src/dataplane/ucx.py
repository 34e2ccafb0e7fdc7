"""Everything UCX, behind one module: environment defaults, the process-wide
context, listeners, endpoints, and the translation of UCX's exceptions.

Defaults (each overridable by the user's own environment variable, because we
only ``setdefault``): blocking progress (no busy polling: an idle daemon uses
no CPU; lowest small-message latency measured here), ``auto`` rendezvous
(``put_zcopy`` was faster over tcp but needs the tcp PUT that ``UCX_FORCED``
turns off) and 2 MiB TCP segments, and host bounce buffers for rendezvous
fragments (ucxx's own default, ``cuda``, needs a GPU).  ``UCX_FORCED`` is set
whatever the environment says.

With CUDA memory in use (a daemon with a ``cuda:N`` arena; a client whose
process already imported CuPy or a CUDA-enabled torch, or that sets
``RPCBUF_UCX_CUDA=1``; ``RPCBUF_UCX_CUDA=0`` forces host settings) the
defaults change in this one place, ``CUDA_DEFAULTS``: rendezvous fragments in
host and device memory (``UCX_RNDV_FRAG_MEM_TYPE=host,cuda``: UCX 1.19+ reads
this name as the list ``RNDV_FRAG_MEM_TYPES``, and it is the name ucxx looks
for before it sets ``cuda`` alone, which would leave tcp no host bounce
buffers to stage device memory through), UCP's own choice of rendezvous
scheme (``UCX_RNDV_SCHEME=auto``: ``put_zcopy`` excludes the staged
pipeline protocols that carry device memory where cuda_ipc cannot, e.g.
over tcp or into VMM memory without a FABRIC handle, leaving "no protocol"
or a slow path; it is process-wide, so host transfers of a CUDA process
lose it too), and a ``UCX_TLS`` that the user restricted (``tcp`` in CI,
say) gains ``cuda_copy,cuda_ipc`` (without them UCX cannot move device
memory at all).  An unset ``UCX_TLS`` means all transports, which includes
both.  Every value the user set is kept.

The process-wide context is built here, not by ucxx: ucxx's own turns on
UCP RMA and active messages, and over tcp UCP emulates put/get with active
messages that read and write whatever address the peer names (the tcp
remote key is empty; nothing checks a registration).  A peer that merely
reaches the UCX port could then read and write any byte of the process,
the node's signing keys included.  ``FEATURES`` is all rpcbuf uses: tagged
messages, wakeup (blocking progress) and streams (ucxx's endpoint handshake,
``exchange_peer_info``).  Without RMA, AM and atomics the worker installs no
handler for those messages, so a peer's put or get never completes; the
context's features are checked once it exists and a context with any of
them on is refused (``UnsafeContext``).

Both sides of a connection bind their UCX endpoint to an authenticated control
session with a small handshake on the reserved tag ``BIND_TAG``: the client
sends the 16-byte nonce it got in ``hello``; the daemon answers one byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import re
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

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

CUDA_DEFAULTS: dict[str, str] = {
    "UCX_RNDV_SCHEME": "auto",
    "UCX_RNDV_FRAG_MEM_TYPE": "host,cuda",
}
CUDA_TLS = ("cuda_copy", "cuda_ipc")

_log = logging.getLogger("rpcbuf.ucx")

BIND_TAG = 0  # request ids start at 1, so tag 0 never carries a payload
NONCE_BYTES = 16

_ucxx: Any = None

FEATURES = ("TAG", "WAKEUP", "STREAM")
FORBIDDEN_FEATURES = ("RMA", "AMO32", "AMO64", "AM")


class UnsafeContext(RuntimeError):
    """The UCX context has a feature on that lets a peer reach this process's
    memory (RMA, atomics or active messages)."""


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
    """Import ucxx after the defaults are in place (UCX reads them at import)."""
    global _ucxx
    if _ucxx is None:
        apply_defaults()
        import ucxx as _mod

        _install_adaptive_progress()
        _install_context(_mod)
        _ucxx = _mod
    return _ucxx


def _install_context(mod: Any) -> None:
    """Make ucxx's one process-wide context ours, with ``FEATURES`` only.

    ``ApplicationContext.__init__`` builds ``UCXContext(config)`` with UCX's
    default features (RMA and AM among them) and takes no flags, so this is
    its body with the context made first.  Installed as ``ucxx.core._ctx``
    before any ucxx call creates the default one."""
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
    """Raise ``UnsafeContext`` unless ``context`` has none of
    ``FORBIDDEN_FEATURES`` on."""
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


_PROGRESS: dict[asyncio.AbstractEventLoop, Any] = {}


def _install_adaptive_progress() -> None:
    """Replace ucxx's blocking progress mode with an adaptive one.

    ucxx 0.52's ``BlockingMode`` arms the worker once; its epoll callback then
    progresses but never re-arms, so after the first event the fd stays
    readable and the event loop spins for ever (an idle daemon that had
    served one client burned a core).  Purely event-driven progress (re-arm
    after every event, as ucx-py did) fixes the idle CPU but not the speed:
    over tcp each rendezvous step then waits for a UCX timer, and a 1 MiB
    transfer took 16 ms instead of 0.3 ms (measured; same with am/get_zcopy
    schemes and signal async mode).  So this mode polls only while this
    process has transfers in flight (``busy()``, entered by every
    ``DataEndpoint`` send/recv) and for ``GRACE`` after the last activity,
    and otherwise arms the worker and sleeps on its epoll fd: polling speed
    while working, no CPU when idle.  A short grace (1 ms) measured worse
    than 10 ms in back-to-back traffic (each lull re-armed the worker and
    the next message waited on a UCX timer again), so the grace covers the
    gaps of a busy client.  A 1 s guard wakes it in case an event is ever
    missed.
    """
    from ucxx._lib_async import application_context, continuous_ucx_progress

    class AdaptiveProgress(continuous_ucx_progress.ProgressTask):
        GRACE = 0.01  # seconds of polling after the last sign of activity
        DRAIN = DRAIN_CALLS  # progress calls per loop turn, at most
        DRAIN_SECONDS = DRAIN_BUDGET  # and about this long

        def __init__(self, worker: Any, event_loop: asyncio.AbstractEventLoop) -> None:
            super().__init__(worker, event_loop)
            worker.init_blocking_progress_mode()
            self.busy = 0
            self.stopped = False
            self._until = 0.0
            self.poll_task: asyncio.Task[None] | None = None
            fd = worker.epoll_file_descriptor
            event_loop.add_reader(fd, self._on_fd)
            weakref.finalize(self, event_loop.remove_reader, fd)
            self.guard_task: asyncio.Task[None] | None = event_loop.create_task(self._guard())
            _PROGRESS[event_loop] = self
            self._wake()

        @property
        def _tasks(self) -> tuple[asyncio.Task[None], ...]:
            return tuple(t for t in (self.poll_task, self.guard_task) if t is not None)

        def _clear_tasks(self) -> None:
            self.stopped = True
            self.poll_task = self.guard_task = None
            _PROGRESS.pop(self.event_loop, None)

        def stop(self) -> None:
            """Cancel the progress tasks (the loop is about to end)."""
            self.stopped = True
            for task in self._tasks:
                task.cancel()
            _PROGRESS.pop(self.event_loop, None)

        def begin(self) -> None:
            self.busy += 1
            self._wake()

        def end(self) -> None:
            self.busy -= 1
            self._wake()

        def _on_fd(self) -> None:
            # While polling, the fd (not armed) stays readable and this fires
            # on every loop turn: it must not extend the grace, or we never sleep.
            if self.poll_task is None or self.poll_task.done():
                self._wake()

        def _wake(self, grace: float | None = None) -> None:
            self._until = time.monotonic() + (self.GRACE if grace is None else grace)
            if self.stopped or self.event_loop.is_closed():
                return
            if self.poll_task is None or self.poll_task.done():
                self.poll_task = self.event_loop.create_task(self._poll())

        async def _poll(self) -> None:
            try:
                await self._poll_until_armed()
            except asyncio.CancelledError:
                # Only the loop's shutdown cancels us: start nothing new after it,
                # or a task created while the loop winds down is left pending.
                self.stopped = True
                raise

        async def _poll_until_armed(self) -> None:
            worker = self.worker
            while worker is not None and not self.stopped:
                try:
                    if drain(worker, self.DRAIN, self.DRAIN_SECONDS):
                        self._until = time.monotonic() + self.GRACE
                    elif not self.busy and time.monotonic() >= self._until:
                        if worker.arm():
                            return  # armed: the epoll fd calls _on_fd on the next event
                        continue  # events arrived meanwhile: progress them first
                except Exception:  # an endpoint's error surfaced here: its requests see it
                    _log.debug("UCX progress raised", exc_info=True)
                await asyncio.sleep(0)  # let completed requests' tasks run (and post more)
                worker = self.worker

        async def _guard(self) -> None:
            while self.worker is not None and not self.stopped:
                try:
                    await asyncio.sleep(1.0)
                except asyncio.CancelledError:
                    self.stopped = True
                    raise
                if self.poll_task is None or self.poll_task.done():
                    self._wake(grace=0.0)  # one progress-and-arm, no polling

    application_context.BlockingMode = AdaptiveProgress


DRAIN_CALLS = 64
DRAIN_BUDGET = 0.001  # seconds


def drain(worker: Any, most: int = DRAIN_CALLS, seconds: float = DRAIN_BUDGET) -> bool:
    """Progress ``worker`` until it has nothing more to do, ``most`` calls
    at most, and no new call once ``seconds`` have passed (one call may
    itself take longer); whether anything progressed.

    One turn of the event loop per ``progress_once`` (what the polling loop
    did before) cost 11-13 % of a 64 MiB tcp transfer against ucxx's own
    mode, whose ``progress()`` drains without any bound (docs/performance.md
    "Progress per loop turn"); the bounds keep one busy endpoint from
    holding the daemon's loop."""
    if not worker.progress_once():
        return False
    until = time.monotonic() + seconds
    for _ in range(most - 1):
        if time.monotonic() >= until or not worker.progress_once():
            break
    return True


async def stop_progress() -> None:
    """Stop driving UCX progress on the running loop (call last, before the
    loop ends, so no progress task is left pending when it closes)."""
    progress = _PROGRESS.get(asyncio.get_running_loop())
    if progress is not None:
        tasks = progress._tasks
        progress.stop()
        await asyncio.gather(*tasks, return_exceptions=True)


class busy:
    """Marks a transfer in flight so the progress mode polls meanwhile; code
    that drives a ucxx endpoint directly (benchmarks) wraps its calls in it."""

    __slots__ = ("_p",)

    def __enter__(self) -> None:
        self._p = _PROGRESS.get(asyncio.get_running_loop())
        if self._p is not None:
            self._p.begin()

    def __exit__(self, *exc: object) -> None:
        if self._p is not None:
            self._p.end()


class TransferError(Exception):
    """A data-plane transfer failed; the endpoint may be unusable."""


class Truncated(TransferError):
    """The peer sent more bytes than the receive buffer holds (or a refusal drained it)."""


class PeerGone(TransferError):
    """The endpoint is closed or its peer vanished."""


def _translate(exc: BaseException) -> TransferError:
    ex = ucxx().exceptions
    if isinstance(exc, ex.UCXMessageTruncatedError):
        return Truncated(str(exc))
    if isinstance(exc, (ex.UCXCanceled, ex.UCXCloseError, ex.UCXConnectionResetError,
                        ex.UCXNotConnectedError, ex.UCXEndpointTimeoutError)):
        return PeerGone(str(exc) or type(exc).__name__)
    return TransferError(f"{type(exc).__name__}: {exc}")


class Abandoned(PeerGone):
    """We stopped waiting for the transfers: the session they belong to is gone."""


async def transfer_all(coros: Any, deadline: float, on_expired: Any,
                       abandon: asyncio.Future[Any] | None = None) -> None:
    """Await every transfer, even after one fails (UCX may touch its memory
    until each ends), then raise the first failure.  Past ``deadline``
    seconds ``on_expired()`` runs: it must abort the endpoint, which makes
    every outstanding transfer end.

    ``abandon`` (the session's "control connection lost" future) ends the
    wait at once when it completes, whatever state the transfers are in:
    they are cancelled and ``Abandoned`` is raised.  Aborting the endpoint
    is not enough on its own: a receive that ucxx re-posted on the worker
    after an endpoint error (its fallback for a message already queued) is
    owned by no endpoint, and one matched to a peer that died never ends.
    The caller keeps the transfers' memory referenced a while (UCX may still
    hold it) and must have aborted the endpoint (nothing arrives after)."""
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


class DataEndpoint:
    """A UCX endpoint with tagged send/recv that raise ``TransferError``s only."""

    def __init__(self, ep: Any) -> None:
        self._ep = ep

    @property
    def closed(self) -> bool:
        return self._ep is None or bool(self._ep.closed)

    async def send(self, buf: Any, tag: int) -> None:
        if self._ep is None:
            raise PeerGone("endpoint closed")
        try:
            with busy():
                await self._ep.send(buf, tag=tag)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise _translate(exc) from exc

    async def recv(self, buf: Any, tag: int) -> None:
        if self._ep is None:
            raise PeerGone("endpoint closed")
        try:
            with busy():
                await self._ep.recv(buf, tag=tag)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise _translate(exc) from exc

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
    try:
        async with asyncio.timeout(timeout):
            with busy():
                ep = await ucxx().create_endpoint(host, port)
    except TimeoutError as exc:
        raise PeerGone(f"UCX connect to {host}:{port} timed out") from exc
    except Exception as exc:
        raise _translate(exc) from exc
    return DataEndpoint(ep)


def rdma_devices() -> list[str]:
    """The RDMA devices this host's kernel knows (``/sys/class/infiniband``):
    what UCX could use besides tcp.  At most 64 names."""
    path = Path("/sys/class/infiniband")
    return sorted(p.name for p in path.iterdir())[:64] if path.is_dir() else []


class Janitor:
    """Drops tagged messages that nobody asked for, once they are old.

    UCP keeps every tagged message that arrives before a matching receive is
    posted (worker-wide, its payload included for eager messages) until one
    is: a peer that never authenticated, or a tenant sending with tags no
    request expects, grew a daemon by hundreds of MiB that were never freed.
    Tags cannot be traced to their sender (they are 64-bit values the peer
    chooses), so age is the test.  Every ``period`` seconds the janitor sends
    itself a *sentinel* (a tagged message on an endpoint to its own worker,
    with a fresh random tag); a round later every unexpected message ahead
    of that sentinel has waited at least ``period``, and is received into a
    one-byte scratch buffer and so dropped (an eager message's payload is
    freed; a rendezvous one's never moves), up to the sentinel.

    A legitimate payload waits unexpected only between its arrival and the
    daemon posting its receive: a store's payload travels beside its
    request, and the request may wait for its buffer's lock.  So a round is
    skipped while ``claimable(since)`` says a request dispatched before
    ``since`` is still in flight (its payload might be in the queue), but at
    most ``patience`` seconds in a row: then the round drops all the same.
    """

    def __init__(self, period: float, patience: float,
                 claimable: Any = None, on_drop: Any = None) -> None:
        self.period, self.patience = period, patience
        self._claimable = claimable or (lambda since: False)
        self._on_drop = on_drop or (lambda count, nbytes: None)
        self._ep: Any = None
        self._scratch: Any = None
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0  # messages dropped so far (``stats``)

    async def start(self) -> bool:
        """Connect to our own worker and start; False (logged) if UCX
        cannot make that endpoint: unexpected messages are then unbounded."""
        mod = ucxx()
        try:
            async with asyncio.timeout(10):
                with busy():
                    self._ep = await mod.create_endpoint_from_worker_address(
                        mod.get_worker_address())
        except Exception as exc:
            _log.warning("UCX janitor off (no endpoint to our own worker: %s): tagged messages "
                         "nobody asked for are kept until a receive matches them", exc)
            return False
        self._task = asyncio.get_running_loop().create_task(self._run())
        return True

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # Bounded: a shutdown never waits on the janitor (it holds nothing).
            await asyncio.wait([task], timeout=2.0)
            if not task.done():
                _log.warning("UCX janitor did not stop within 2 s: left behind")
        ep, self._ep = self._ep, None
        if ep is not None:
            with contextlib.suppress(Exception):
                ep.abort()

    async def _run(self) -> None:
        while True:
            sentinel = int.from_bytes(os.urandom(8), "little") | 1  # never tag 0 (BIND_TAG)
            marked = time.monotonic()
            try:
                with busy():
                    await self._ep.send(np.zeros(1, dtype=np.uint8), tag=sentinel,
                                        force_tag=True)
            except Exception as exc:  # our own endpoint broke: nothing more to do
                _log.warning("UCX janitor stopped: %s", exc)
                return
            while True:
                await asyncio.sleep(self.period)
                if time.monotonic() - marked >= self.period + self.patience or \
                        not self._claimable(marked):
                    break
            try:
                count, nbytes = await self.sweep(sentinel)
            except Exception:  # a bug: say so, keep the daemon serving, try next round
                _log.exception("UCX janitor: a sweep failed")
                continue
            if count:
                self.dropped += count
                self._on_drop(count, nbytes)

    async def sweep(self, sentinel: int) -> tuple[int, int]:
        """Drop every unexpected message ahead of ``sentinel`` (oldest
        first), then the sentinel; (messages, bytes) dropped."""
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMask

        worker = ucxx().core._get_ctx().worker
        if self._scratch is None:  # one for good: a receive that outlives its wait may write it
            self._scratch = Array(np.zeros(1, dtype=np.uint8))
        scratch = self._scratch
        count = nbytes = 0
        while True:
            for _ in range(256):  # then let the loop breathe
                got = worker.tag_probe(Tag(0), TagMask(0), remove=True)  # the oldest
                if not got.matched:
                    return count, nbytes  # nothing at all, not even the sentinel: a race
                tag = int(got.sender_tag.value)
                req = worker.tag_recv_with_handle(scratch, got)
                with contextlib.suppress(Exception), busy():
                    # Truncated, as meant: what matters is that it left the queue.  An
                    # eager message ends at once; a rendezvous one once its sender hears.
                    await asyncio.wait_for(req.wait(), 5.0)
                if tag == sentinel:
                    return count, nbytes
                count += 1
                nbytes += int(got.length)
            await asyncio.sleep(0)


_RESOURCE = re.compile(r"resource \d+\s*:\s*md \d+\s+dev \d+\s+flags \S*\s+(\S+)")


def library() -> dict[str, Any]:
    """Which UCX this process runs on and what it can do, for ``stats`` and
    ``rpcbuf doctor``: ``path`` of the libucp it loaded (from
    ``/proc/self/maps``: what is mapped, not what was asked for), its
    ``version``, the transport ``modules`` beside it (``ib`` means built with
    verbs, ``rdmacm``, ``cuda``), and the ``resources`` (transport/device)
    this process's context found, its ``features`` (``FEATURES``);
    ``error``: why UCX would not start here
    (a UCX_NET_DEVICES naming no device, say).  The pip wheel has no ``ib``:
    no RDMA."""
    error = None
    try:
        ucxx()
    except Exception as exc:  # what UCX says, for doctor to show: not a crash
        error = f"{type(exc).__name__}: {exc}"
    path = None
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            if "/libucp.so" in line:
                path = line.split()[-1]
                break
    version = None
    if path is not None:
        with contextlib.suppress(OSError, AttributeError):
            fn = ctypes.CDLL(path).ucp_get_version_string
            fn.restype = ctypes.c_char_p
            version = fn().decode()
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
