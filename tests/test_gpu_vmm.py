"""GPU buffers on CUDA VMM on a real device (marked ``gpu``; skipped, with the
reason, without CuPy, a CUDA device, cuda-bindings or VMM with POSIX-fd
handles, or where the probe at arena creation fails).  ``scripts/gpu_check.sh``
runs them first: ``pytest -m gpu``.

One process (this one) holds a VMM arena, as the daemon does; the buffer's
fd travels over a Unix socketpair (``socket.send_fds``) to a second process,
``tests/gpu_vmm_child.py``, which imports it.  The same logic over a fake
driver, on any machine: tests/dataplane/test_cuda_vmm.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "gpu_vmm_child.py"
MiB = 1 << 20


@pytest.fixture(scope="module")
def cp() -> Any:
    from test_gpu import _cupy

    cupy = _cupy()
    from rpcbuf.dataplane.cuda_arena import CudaArena

    # What the daemon would pick: the device's attributes and the probe (one
    # granule created, mapped, given access, exported and released).
    probe = CudaArena(2 * MiB, 0, vmm=None)
    try:
        if probe.backing != "vmm":
            pytest.skip(f"no CUDA VMM here: {probe.backing_why}")
        d = probe.describe()
        record(vmm_fabric=d["fabric"], vmm_fabric_why=d.get("fabric_why", ""))
        print(f"\nCUDA VMM: granularity {d['granularity']}, FABRIC handles "
              f"{d['fabric']}{'' if d['fabric'] else ' (' + d['fabric_why'] + ')'}")
    finally:
        probe.close()
    return cupy


@pytest.fixture
def arena(cp: Any) -> Iterator[Any]:
    from rpcbuf.dataplane.cuda_arena import CudaArena

    a = CudaArena(1 << 30, 0, vmm=True)
    yield a
    a.close()


def record(**figures: Any) -> None:
    """Add ``figures`` to the JSON file ``$RPCBUF_GPU_FIGURES`` names, if it
    does (scripts/gpu_check.sh puts them into its report, beside printing)."""
    path = os.environ.get("RPCBUF_GPU_FIGURES")
    if not path:
        return
    try:
        with open(path) as f:
            seen = json.load(f)
    except (OSError, ValueError):
        seen = {}
    seen.update(figures)
    with open(path, "w") as f:
        json.dump(seen, f, indent=1, default=str)


def pattern(cp: Any, nbytes: int, seed: int) -> Any:
    return cp.asarray(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))


class Child:
    """The importing process, with its end of a socketpair."""

    def __init__(self, mode: str) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(120)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, str(CHILD), mode, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        theirs.close()

    def send_fd(self, fd: int, **msg: Any) -> None:
        try:
            socket.send_fds(self.sock, [json.dumps(msg).encode()], [fd])
        finally:
            os.close(fd)  # the exporter's copy: sent, so closed

    def send(self, msg: Any) -> None:
        self.sock.send(json.dumps(msg).encode())

    def recv(self) -> Any:
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            data = b""
        if not data:
            raise AssertionError(f"the child said nothing more; its output:\n{self.output()}")
        return json.loads(data)

    def output(self) -> str:
        try:
            out, _ = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out or ""

    def close(self) -> int:
        self.sock.close()
        self.output()
        return self.proc.returncode


def _exported(cp: Any, arena: Any, nbytes: int, seed: int, mode: str) -> tuple[Any, int]:
    """A backed buffer of ``nbytes`` holding a pattern, its handle sent to a
    child in ``mode``: (the child, the pattern's devsum)."""
    from rpcbuf.dataplane.devsum import device_devsum

    arena.back(0, nbytes)
    data = pattern(cp, nbytes, seed)
    arena.view(0, nbytes)[...] = data
    arena.synchronize()
    child = Child(mode)
    child.send_fd(arena.export(0, nbytes), nbytes=nbytes, device=0)
    return child, device_devsum(data)


def test_vmm_arena_on_the_gpu(cp: Any, arena: Any) -> None:
    from rpcbuf.dataplane import devsum as D
    from rpcbuf.dataplane.checksum import xxh3
    from rpcbuf.dataplane.cuda_arena import copy_device
    from rpcbuf.dataplane.cuda_vmm import open_driver

    g = arena.granularity
    rec = open_driver(0).granularity(recommended=True)
    print(f"\nVMM granularity: minimum {g}, recommended {rec}")
    record(vmm_granularity=g, vmm_granularity_recommended=rec)
    d = arena.describe()
    assert d["backing"] == "vmm" and d["granularity"] == g and g % 4096 == 0
    from rpcbuf.dataplane.cuda_arena import CudaArena

    auto = CudaArena(64 * MiB, 0, vmm=None)  # where VMM works, it is what auto picks
    assert auto.backing == "vmm", auto.describe()
    auto.close()
    with pytest.raises(IndexError, match="not inside one backed buffer"):
        arena.view(0, 1)
    arena.back(0, g)
    arena.back(4 * g, 2 * g)
    data = pattern(cp, 2 * g, 1)
    arena.view(4 * g, 2 * g)[...] = data
    arena.view(0, 1000)[...] = data[:1000]
    assert arena.checksum(4 * g, 2 * g) == D.device_devsum(data)
    assert arena.checksums([0], [1000]) == [xxh3(cp.asnumpy(data[:1000]).data)]
    copy_device(arena, 4 * g, arena, 0, 1000)
    assert bool((arena.view(0, 1000) == data[:1000]).all())
    arena.unback(0, g)
    arena.unback(4 * g, 2 * g)


def test_read_only_import_in_another_process(cp: Any, arena: Any) -> None:
    """A second process attaches a buffer read-only and sees its bytes; the
    memory stays while it is attached, even after the arena unbacked it."""
    nbytes = 2 * arena.granularity
    child, want = _exported(cp, arena, nbytes, 2, "read")
    got = child.recv()
    assert got == {"imported": True, "devsum": want}, got
    arena.unback(0, nbytes)  # the importer still holds the allocation
    child.send("again")
    assert child.recv() == {"devsum": want}
    assert child.recv() == {"closed": True}
    assert child.close() == 0


def test_write_through_a_read_only_import_fails(cp: Any, arena: Any) -> None:
    nbytes = arena.granularity
    child, want = _exported(cp, arena, nbytes, 3, "write")
    assert child.recv() == {"imported": True, "devsum": want}
    try:
        answer = child.recv()
    except AssertionError:  # died without a word: the fault took the process
        answer = {"write": "failed", "error": "the child died"}
    rc = child.close()
    print(f"\nwrite through a read-only import: {answer}, exit status {rc}")
    record(vmm_read_only_write=answer, vmm_read_only_write_exit=rc)
    assert answer.get("write") == "failed" and rc != 0, answer
    assert arena.checksum(0, nbytes) == want  # unchanged, and this context still works
    arena.unback(0, nbytes)


def test_copy_bandwidth_into_an_imported_buffer(cp: Any, arena: Any) -> None:
    """The same-host store: the client imports read-write and copies device to
    device itself.  Bandwidth against a plain CuPy copy, printed, not asserted."""
    from rpcbuf.dataplane.devsum import device_devsum

    nbytes = 256 * MiB
    arena.back(0, nbytes)
    child = Child("bandwidth")
    child.send_fd(arena.export(0, nbytes), nbytes=nbytes, device=0, rounds=20)
    assert child.recv()["imported"] is True
    got = child.recv()
    assert child.close() == 0
    assert arena.checksum(0, nbytes) == got["devsum"]  # the bytes landed in the arena's buffer
    src = cp.random.randint(0, 256, nbytes, dtype=cp.uint8)
    plain = cp.empty_like(src)
    own = {}
    from gpu_vmm_child import copy_gbps

    for name, dst in (("arena view", arena.view(0, nbytes)), ("plain", plain)):
        own[name] = copy_gbps(cp, src, dst, 20)
    assert device_devsum(arena.view(0, nbytes)) == device_devsum(src)
    record(vmm_import_copy_gbps=got["import_gbps"], vmm_import_plain_gbps=got["plain_gbps"],
           vmm_view_copy_gbps=own["arena view"], vmm_view_plain_gbps=own["plain"])
    print(f"\n256 MiB D2D copy, GB/s (median of 20): into an imported buffer "
          f"{got['import_gbps']:.0f} vs plain cupy {got['plain_gbps']:.0f} "
          f"(ratio {got['import_gbps'] / got['plain_gbps']:.2f}, other process); "
          f"into the arena's own VMM view {own['arena view']:.0f} vs plain {own['plain']:.0f} "
          f"(this process)")
    del plain, src
    arena.unback(0, nbytes)


def test_back_unback_1000_buffers_leaks_nothing(cp: Any) -> None:
    from rpcbuf.dataplane.cuda_arena import CudaArena
    from rpcbuf.dataplane.cuda_vmm import open_driver

    drv = open_driver(0)
    g = drv.granularity()
    n = 1000
    arena = CudaArena(n * g, 0, vmm=True)
    try:
        free0, _ = drv.mem_info()
        t = time.perf_counter()
        for i in range(n):
            arena.back(i * g, g)
        t_back = (time.perf_counter() - t) / n
        free1, _ = drv.mem_info()
        assert free0 - free1 >= n * g, (free0, free1)  # the measure sees the buffers
        t = time.perf_counter()
        for i in range(n):
            arena.unback(i * g, g)
        t_unback = (time.perf_counter() - t) / n
        for _ in range(n):  # one buffer, 1000 times
            arena.back(0, g)
            arena.unback(0, g)
        free2, _ = drv.mem_info()
        sizes = {}
        for size in (g, 64 * MiB, 512 * MiB):
            t = time.perf_counter()
            arena.back(0, size)
            mid = time.perf_counter()
            arena.unback(0, size)
            sizes[size] = (mid - t, time.perf_counter() - mid)
    finally:
        arena.close()
    free3, _ = drv.mem_info()
    record(vmm_cycles=n, vmm_back_us=t_back * 1e6, vmm_unback_us=t_unback * 1e6,
           vmm_free_before=free0, vmm_free_all_backed=free1, vmm_free_after_cycles=free2,
           vmm_free_arena_closed=free3,
           vmm_sizes_us={s >> 20: [b * 1e6, u * 1e6] for s, (b, u) in sizes.items()})
    print(f"\n{n} x {g}: back {t_back * 1e6:.0f} us, unback {t_unback * 1e6:.0f} us each; "
          f"free before {free0}, all backed {free1}, after {free2}, arena closed {free3}; "
          + "; ".join(f"{s >> 20} MiB back {b * 1e6:.0f} us unback {u * 1e6:.0f} us"
                      for s, (b, u) in sizes.items()))
    assert free0 - free2 < 4 * g, (free0, free2)  # fewer than 4 granules unaccounted
    assert free0 - free3 < 4 * g, (free0, free3)
