"""The other process of tests/test_gpu_vmm.py: it receives a GPU buffer's fd
over a Unix socket (``socket.recv_fds``), imports it with
``rpcbuf.dataplane.cuda_import.import_buffer`` and does what ``MODE`` says, answering
one JSON message per step on the same socket.

    python tests/gpu_vmm_child.py read|write|bandwidth SOCKET_FD

* ``read``: import read-only, answer the devsum of what it sees; on
  ``again``, answer it once more (the exporter has unbacked the buffer
  meanwhile), then close the import and answer ``closed``.
* ``write``: import read-only and write through it.  A kernel faulting on a
  read-only mapping poisons this process's CUDA context, which is why this
  runs in a throwaway process; it answers whether the write failed.
* ``bandwidth``: import read-write and time device-to-device copies into it
  against a plain CuPy copy (CUDA events), answering both and the devsum of
  what it copied.
"""

from __future__ import annotations

import json
import socket
import sys
from typing import Any


def copy_gbps(cp: Any, src: Any, dst: Any, rounds: int) -> float:
    """Device-to-device copy ``src`` -> ``dst``: GB/s at the median of
    ``rounds`` timed copies (CUDA events), after one warm-up."""
    dst[...] = src
    times = []
    for _ in range(rounds):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        dst[...] = src
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    times.sort()
    return float(src.nbytes / times[len(times) // 2] / 1e9)


def main() -> int:
    mode, sock = sys.argv[1], socket.socket(fileno=int(sys.argv[2]))
    sock.settimeout(120)

    def send(**msg: Any) -> None:
        sock.send(json.dumps(msg).encode())

    data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
    if len(fds) != 1:
        send(error=f"expected one fd, got {len(fds)}")
        return 2
    req = json.loads(data)
    import cupy as cp

    from rpcbuf.dataplane.cuda_import import import_buffer
    from rpcbuf.dataplane.devsum import devsum

    try:
        imp = import_buffer(fds[0], req["nbytes"], req["device"], writable=mode == "bandwidth")
    except Exception as exc:
        send(error=f"import failed: {type(exc).__name__}: {exc}")
        return 2
    send(imported=True, devsum=devsum(imp.array))
    if mode == "read":
        if json.loads(sock.recv(4096)) != "again":
            return 2
        send(devsum=devsum(imp.array))
        imp.close()
        send(closed=True)
        return 0
    if mode == "write":
        try:
            imp.array.fill(0xFF)
            cp.cuda.Device(req["device"]).synchronize()
        except Exception as exc:
            send(write="failed", error=f"{type(exc).__name__}: {exc}")
            return 3
        send(write="succeeded")
        return 0
    if mode == "bandwidth":
        n, rounds = req["nbytes"], req["rounds"]
        src = cp.random.randint(0, 256, n, dtype=cp.uint8)
        plain = cp.empty_like(src)
        out: dict[str, Any] = {}
        for name, dst in (("import", imp.array), ("plain", plain)):
            out[f"{name}_gbps"] = copy_gbps(cp, src, dst, rounds)
        send(devsum=devsum(src), **out)
        imp.close()
        return 0
    send(error=f"unknown mode {mode!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
