"""Mooncake Store's sides of ``bench_kv_store.py``, run by its venv's python
inside a network namespace of its own (the parent starts it under
``unshare -n``: some of Mooncake's listeners bind 0.0.0.0 whatever they are
asked, so only ``lo`` may exist where it runs).

Set up as Mooncake's own docs set up a store on one machine, from the
``mooncake-transfer-engine-non-cuda`` wheel:

* ``mooncake_master --rpc_address=127.0.0.1 --rpc_port=50051`` (metrics
  reporting off);
* ``mooncake_client`` (the standalone "real client") holding the one global
  segment: ``--protocol=tcp --metadata_server=P2PHANDSHAKE --port=50052``;
* the **tcp client**: ``MooncakeDistributedStore().setup("127.0.0.1",
  "P2PHANDSHAKE", 0, ...,"tcp", "", master)`` (a segment of 0: it holds
  nothing, the bytes go over the transfer engine's tcp transport to the
  real client's segment), with ``register_buffer`` on both regions and
  ``put_from``/``get_into``, ``batch_put_from``/``batch_get_into``;
* the **same-host client**: ``setup_dummy(pool, local, "127.0.0.1:50052")``
  (an RPC to the real client, which maps the dummy's shared memory: the
  bytes are copied in the real client's process), its regions from
  ``alloc_from_mem_pool`` then ``register_buffer``.

Both clients use the one real client, one after the other.  Mooncake checks
no content: a put is stored as it arrives and a get returns what is there
(the rows check every get byte for byte).  Keys are removed after each row
with ``remove_all(force=True)`` (a fresh key per put, as the other sides).
Writes the two sides' rows, the processes' logs' last lines on failure, and
the real client's resident memory to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import _bench_kv_store_rows as rows

HOST = "127.0.0.1"
MASTER_PORT, CLIENT_PORT = 50051, 50052


def progress(msg: str) -> None:
    print(f"[bench_kv_store mooncake] {msg}", file=sys.stderr, flush=True)


def lo_up() -> None:
    """Bring ``lo`` up (a new network namespace starts with it down), by
    ioctl: no ``ip`` binary needed."""
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        got = fcntl.ioctl(s, siocgifflags, struct.pack("16sH14x", b"lo", 0))
        flags = struct.unpack("16sH14x", got)[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex((HOST, port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port} in {timeout:.0f} s")


def _fds(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return None


def _rss_mib(pid: int) -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


class Store:
    """One ``MooncakeDistributedStore`` as a ``rows.Side``."""

    def __init__(self, name: str, store: Any, holder_pid: int, dummy: bool) -> None:
        self.name, self.store, self.pid, self.dummy = name, store, holder_pid, dummy
        self.checks = "nothing: a get returns what is there"

    def _region(self, nbytes: int) -> np.ndarray:
        if self.dummy:
            ptr = int(self.store.alloc_from_mem_pool(nbytes))
            if not ptr:
                raise RuntimeError(f"alloc_from_mem_pool({nbytes}) returned 0")
            arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        else:
            arr = np.zeros(nbytes, np.uint8)
        ret = self.store.register_buffer(arr.ctypes.data, nbytes)
        if ret != 0:
            raise RuntimeError(f"register_buffer returned {ret}")
        return arr

    def regions(self, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        self.kept = (self._region(nbytes), self._region(nbytes))
        return self.kept

    def put(self, keys: list[str], blocks: list[np.ndarray]) -> None:
        if len(keys) == 1:
            ret = self.store.put_from(keys[0], blocks[0].ctypes.data, blocks[0].nbytes)
            if ret != 0:
                raise RuntimeError(f"put_from returned {ret}")
            return
        res = self.store.batch_put_from(keys, [b.ctypes.data for b in blocks],
                                        [b.nbytes for b in blocks])
        bad = [r for r in res if r != 0]
        if bad:
            raise RuntimeError(f"batch_put_from: {len(bad)} of {len(keys)} failed "
                               f"(first {bad[0]})")

    def get(self, keys: list[str], out: list[np.ndarray]) -> list[bool]:
        if len(keys) == 1:
            got = self.store.get_into(keys[0], out[0].ctypes.data, out[0].nbytes)
            return [got == out[0].nbytes]
        res = self.store.batch_get_into(keys, [o.ctypes.data for o in out],
                                        [o.nbytes for o in out])
        return [r == o.nbytes for r, o in zip(res, out, strict=True)]

    def remove(self, keys: list[str]) -> None:
        self.store.remove_all(True)

    def server_fds(self) -> int | None:
        return _fds(self.pid)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True, help="the venv's bin directory")
    p.add_argument("--out", required=True)
    p.add_argument("--logs", required=True)
    p.add_argument("--hold-n", type=int, default=250_000)
    p.add_argument("--hold-s", type=float, default=90.0)
    p.add_argument("--segment-gb", type=int, default=6)
    p.add_argument("--sides", default="tcp,same-host")
    args = p.parse_args()
    from mooncake.store import MooncakeDistributedStore

    lo_up()
    logs = Path(args.logs)
    out: dict[str, Any] = {"sides": {}, "notes": []}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(logs / "mooncake_master.log", "ab") as f:
            master = subprocess.Popen(
                [f"{args.bin}/mooncake_master", f"--rpc_address={HOST}",
                 f"--rpc_port={MASTER_PORT}", "--enable_metric_reporting=false"],
                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        procs.append(master)
        wait_port(MASTER_PORT, master, "mooncake_master")
        with open(logs / "mooncake_client.log", "ab") as f:
            holder = subprocess.Popen(
                [f"{args.bin}/mooncake_client", f"--host={HOST}", f"--port={CLIENT_PORT}",
                 "--protocol=tcp", "--metadata_server=P2PHANDSHAKE",
                 f"--master_server_address={HOST}:{MASTER_PORT}",
                 f"--global_segment_size={args.segment_gb} GB"],
                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        procs.append(holder)
        wait_port(CLIENT_PORT, holder, "mooncake_client")
        out["holder_rss_mib_at_start"] = _rss_mib(holder.pid)
        out["segment_gb"] = args.segment_gb
        for which in args.sides.split(","):
            store = MooncakeDistributedStore()
            if which == "tcp":
                ret = store.setup(HOST, "P2PHANDSHAKE", 0, 256 * rows.MiB, "tcp", "",
                                  f"{HOST}:{MASTER_PORT}")
                name = "Mooncake tcp"
            else:
                ret = store.setup_dummy(2 * rows.REGION + 64 * rows.MiB, 64 * rows.MiB,
                                        f"{HOST}:{CLIENT_PORT}")
                name = "Mooncake same-host"
            if ret != 0:
                out["sides"][name] = {"error": f"setup returned {ret}"}
                continue
            side = Store(name, store, holder.pid, dummy=which != "tcp")
            out["sides"][name] = rows.run_side(side, f"mc{which}", args.hold_n, args.hold_s,
                                               progress)
            out["sides"][name]["holder_rss_mib"] = _rss_mib(holder.pid)
            store.remove_all(True)
            store.close()
    except Exception as exc:
        out["notes"].append(f"Mooncake: {type(exc).__name__}: {exc}")
    finally:
        finish(procs, out, args.out)
    sys.stdout.flush()
    os._exit(0)  # Mooncake's threads must not keep the process alive


def finish(procs: list[subprocess.Popen[Any]], out: dict[str, Any], path: str) -> None:
    """Stop the master and the holders (bounded), then write ``out`` to ``path``."""
    for proc in reversed(procs):
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    Path(path).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
