"""Everything UCX, behind one module: environment defaults, the process-wide
context, listeners, endpoints, and the translation of UCX's exceptions.

Defaults (each overridable by the user's own environment variable, because we
only ``setdefault``): blocking progress (no busy polling: an idle daemon uses
no CPU; lowest small-message latency measured here), one-sided ``put_zcopy``
rendezvous and 2 MiB TCP segments (together 3-6x faster than ucxx's defaults
over tcp in the brief's measurements), and host bounce buffers for
rendezvous fragments (ucxx's own default, ``cuda``, needs a GPU).

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

Both sides of a connection bind their UCX endpoint to an authenticated control
session with a small handshake on the reserved tag ``BIND_TAG``: the client
sends the 16-byte nonce it got in ``hello``; the daemon answers one byte.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Any

UCX_DEFAULTS: dict[str, str] = {
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_RNDV_SCHEME": "put_zcopy",
    "UCX_TCP_TX_SEG_SIZE": "2m",
    "UCX_TCP_RX_SEG_SIZE": "2m",
    "UCX_RNDV_FRAG_MEM_TYPE": "host",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
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
    return dict(target)


def ucxx() -> Any:
    """Import ucxx after the defaults are in place (UCX reads them at import)."""
    global _ucxx
    if _ucxx is None:
        apply_defaults()
        import ucxx as _mod

        _install_adaptive_progress()
        _ucxx = _mod
    return _ucxx


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

        self._listener: Any = ucxx().create_listener(_accept, port=port)

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
