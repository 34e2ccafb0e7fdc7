"""What keeps UCX's registration cache coherent with the host arena's
remaps: every ``MAP_FIXED`` remap (``back``, ``unback``, ``share``,
``copy_out``) must reach UCM as ``UCM_EVENT_VM_UNMAPPED`` for the block's
range, the event an InfiniBand/RoCE memory domain's rcache invalidates a
registration on.  A remap UCM never sees leaves a registration of the old
pages in the cache, and the next zero-copy transfer into that buffer would
write the freed pages.

Each hook mode runs in its own process (UCM reads ``UCX_MEM_MMAP_HOOK_MODE``
when UCX loads): ``bistro`` (the default on x86_64 and aarch64: libc's
``mmap`` itself is patched) and ``reloc`` (call sites patched; a ctypes call
to libc's ``mmap`` is not one of them, so before ``shm.use_ucm`` this mode
saw none of the remaps).  The handler is registered through libucm's own
``ucm_set_event_handler``, as the rcache registers its own: tcp, the only
transport here, keeps no registration cache, so this is the part of the
chain that can run without RDMA hardware."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.ucx_path

CHILD = textwrap.dedent("""
    import ctypes, json, mmap
    from rpcbuf.dataplane import shm, ucx, ucxlib
    from rpcbuf.dataplane.arena import HostArena

    ucx.ucxx()
    ucm = ctypes.CDLL(sorted(ucxlib.mapped()["libucm.so"])[0])
    VM_UNMAPPED = 1 << 17

    class VM(ctypes.Structure):
        _fields_ = [("address", ctypes.c_void_p), ("size", ctypes.c_size_t)]

    seen = []

    @ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(VM), ctypes.c_void_p)
    def on_event(kind, event, arg):
        seen.append((event.contents.address or 0, event.contents.size))

    assert ucm.ucm_set_event_handler(VM_UNMAPPED, -1, on_event, None) == 0
    P = mmap.PAGESIZE
    arena = HostArena(64 * P)
    steps = {}

    def step(name, fn, offset, nbytes):
        del seen[:]
        fn()
        lo, hi = arena.address + offset, arena.address + offset + nbytes
        steps[name] = any(a <= lo and a + s >= hi for a, s in seen)

    step("back", lambda: arena.back(4 * P, 8 * P), 4 * P, 8 * P)
    step("share", lambda: arena.clones.share(4 * P, 16 * P, 8 * P), 16 * P, 8 * P)
    fd = []
    step("copy_out", lambda: fd.append(arena.clones.copy_out(16 * P, 8 * P)), 16 * P, 8 * P)
    arena.clones.adopt(16 * P, fd[0])
    step("unback", lambda: arena.unback(4 * P, 8 * P), 4 * P, 8 * P)
    # No Python callback may outlive the interpreter (munmaps at exit reach it)
    ucm.ucm_unset_event_handler(VM_UNMAPPED, on_event, None)
    print(json.dumps({"steps": steps, "ucm": shm.ucm_path}), flush=True)
""")


@pytest.mark.parametrize("mode", ["bistro", "reloc"])
def test_every_remap_of_a_block_reaches_ucm_as_vm_unmapped(mode: str) -> None:
    env = {**os.environ, "UCX_MEM_MMAP_HOOK_MODE": mode, "UCX_MEM_EVENTS": "yes"}
    env.pop("UCX_LOG_LEVEL", None)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["steps"] == {"back": True, "share": True, "copy_out": True, "unback": True}
    assert got["ucm"] and "libucm.so" in got["ucm"]  # through UCM, whatever the mode
