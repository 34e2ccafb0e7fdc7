"""Which UCX library this process loads, chosen by ``RPCBUF_UCX`` before ucxx
is imported, and the refusal of one rpcbuf cannot run on.

``RPCBUF_UCX``: ``wheel`` (the default: the pip ``libucx`` wheel, no verbs
or rdmacm, so never RDMA); ``system`` (``libucp.so.0`` as the dynamic linker
finds it: Debian's ``libucx0``, MOFED/HPC-X); or an absolute path (a UCX
prefix, or its ``lib`` directory).

The wheel's own switch (``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY``) looks for
the unversioned names only a ``-dev`` package installs, so ``load`` replaces
``libucx.load_library``: it dlopens the chosen ``libucs``, ``libucs_signal``,
``libuct`` and ``libucp``, and ucxx's extensions then get that soname.

A library that cannot be loaded, is older than ``MIN_VERSION`` (ucxx 0.52
and the CUDA defaults need 1.19), or is mixed with another UCX's pieces in
this process is refused with ``UnusableUCX`` before anything of it runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
from typing import Any

from rpcbuf.dataplane import shm

MIN_VERSION = (1, 19, 0)
ENV = "RPCBUF_UCX"
# libucs first: libucm's symbols resolve against it, so libucm alone fails to load.
LIBS = ("libucs.so.0", "libucs_signal.so.0", "libuct.so.0", "libucp.so.0")
PIECES = ("libucm.so", "libucs.so", "libuct.so", "libucp.so")


class UnusableUCX(RuntimeError):
    """The UCX chosen by ``RPCBUF_UCX`` cannot be loaded or is one rpcbuf
    cannot run on; the message says which and why."""


def choice(env: Any = None) -> str:
    """``RPCBUF_UCX``: ``wheel``, ``system`` or an absolute directory."""
    env = os.environ if env is None else env
    value = str(env.get(ENV, "") or "wheel").strip()
    if value in ("wheel", "system"):
        return value
    if value.startswith("/") and "\0" not in value:
        return os.path.normpath(value)
    raise UnusableUCX(f"{ENV}={value!r}: expected wheel, system, or the absolute path of a "
                      "UCX install (its prefix or its lib directory)")


def lib_dir(chosen: str) -> str | None:
    """The directory to load ``chosen``'s libraries from; None: by soname,
    through the dynamic linker's search (``system``, or no wheel installed)."""
    if chosen == "system":
        return None
    if chosen == "wheel":
        try:
            import libucx
        except ImportError:  # ucxx built against a UCX on the linker's path
            return None
        return os.path.join(os.path.dirname(libucx.__file__), "lib")
    for sub in ("lib", "lib64", ""):
        d = os.path.join(chosen, sub) if sub else chosen
        if os.path.isfile(os.path.join(d, "libucp.so.0")):
            return d
    raise UnusableUCX(f"{ENV}={chosen}: no libucp.so.0 in {chosen}, {chosen}/lib or "
                      f"{chosen}/lib64")


def parse_version(text: str) -> tuple[int, int, int]:
    """``"1.13.1"`` (or ``"1.21.0-rc1"``) -> ``(1, 13, 1)``."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if m is None:
        raise ValueError(f"not a UCX version: {text!r}")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))


def check_version(version: str, where: str) -> None:
    """Raise ``UnusableUCX`` for a UCX older than ``MIN_VERSION``."""
    need = ".".join(map(str, MIN_VERSION))
    try:
        got = parse_version(version)
    except ValueError:
        raise UnusableUCX(f"the UCX at {where} says its version is {version!r}: rpcbuf needs "
                          f"UCX {need} or newer") from None
    if got < MIN_VERSION:
        raise UnusableUCX(f"UCX {version} at {where} is too old: rpcbuf needs UCX {need} or "
                          f"newer (ucxx refuses older ones); set {ENV}=wheel, or {ENV} to the "
                          f"prefix of a UCX {need}+ build (docs/dataplane.md, \"Running on "
                          "InfiniBand/RoCE\")")


def mapped() -> dict[str, set[str]]:
    """Each UCX piece (``PIECES``) -> the files of it mapped in this process."""
    seen: dict[str, set[str]] = {}
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if line.count(" ") >= 5 else ""
            name = os.path.basename(path)
            for piece in PIECES:
                if name.startswith(piece):
                    seen.setdefault(piece, set()).add(path)
    return seen


def libucp() -> tuple[str | None, str | None]:
    """The libucp this process has mapped (its path: what is loaded, not what
    was asked for) and the version it says; None for what cannot be told."""
    paths = sorted(mapped().get("libucp.so", ()))
    if not paths:
        return None, None
    with contextlib.suppress(OSError, AttributeError):
        # ucxx imported before rpcbuf chose (``select``): dlopen of a mapped
        # library hands back that library, it loads nothing.
        return paths[0], _version(_loaded[-1] if _loaded else ctypes.CDLL(paths[0]))
    return paths[0], None


def _version(lib: Any) -> str:
    """What a loaded libucp says its version is (``ucp_get_version_string``)."""
    fn = lib.ucp_get_version_string
    fn.restype = ctypes.c_char_p
    return str(fn().decode(errors="replace"))


def check_single() -> str | None:
    """The directory every mapped UCX piece comes from; ``UnusableUCX``
    when two UCX installs are mixed in this process."""
    dirs = {os.path.dirname(p) for paths in mapped().values() for p in paths}
    if len(dirs) > 1:
        raise UnusableUCX("two UCX installs are loaded in this process (" + ", ".join(
            sorted(dirs)) + f"): something loaded UCX before rpcbuf chose it by {ENV}")
    return dirs.pop() if dirs else None


_loaded: list[Any] = []  # the handles, held for the process's life (never dlclosed)


def load(env: Any = None) -> list[Any]:
    """Load the chosen UCX (``RPCBUF_UCX``) and check it; the handles.
    Installed as ``libucx.load_library`` (``select``)."""
    if _loaded:
        return _loaded
    chosen = choice(env)
    d = lib_dir(chosen)
    handles = []
    for name in LIBS:
        target = name if d is None else os.path.join(d, name)
        try:
            handles.append(ctypes.CDLL(target, ctypes.RTLD_LOCAL))
        except OSError as exc:
            raise UnusableUCX(f"{ENV}={chosen}: cannot load {target}: {exc}") from None
    where = check_single() or chosen
    check_version(_version(handles[-1]), where)
    _loaded.extend(handles)
    _route_remaps()
    return _loaded


def _route_remaps() -> None:
    """The arenas' remaps go through this process's libucm from now on
    (``shm.use_ucm``: what keeps UCX's registration cache coherent)."""
    paths = sorted(mapped().get("libucm.so", ()))
    if paths:
        shm.use_ucm(paths[0])


def select(env: Any = None) -> None:
    """Make ``import ucxx`` load the UCX that ``RPCBUF_UCX`` chooses (call
    before it); ``UnusableUCX`` if that UCX is refused.  ucxx imported
    already: what it loaded is checked, as nothing can change it now."""
    if "ucxx" in sys.modules and not _loaded:
        chosen = choice(env)
        where = check_single()
        want = lib_dir(chosen)
        if where and want and os.path.realpath(want) != where:
            raise UnusableUCX(f"ucxx was imported before rpcbuf and loaded the UCX at {where}, "
                              f"not {ENV}={chosen}: import rpcbuf (or call "
                              "rpcbuf.dataplane.ucxlib.select()) before ucxx")
        _route_remaps()
        return
    load(env)
    try:
        import libucx
    except ImportError:
        return  # no wheel: ucxx's extensions find libucp.so.0 by soname, this one
    libucx.load_library = lambda: list(_loaded)


def main(argv: list[str] | None = None) -> int:
    """``python -m rpcbuf.dataplane.ucxlib [CHOICE]``: whether rpcbuf can run on
    that UCX (default ``$RPCBUF_UCX``), in one line; exit 1 if not (.ci/run)."""
    args = sys.argv[1:] if argv is None else argv
    env = {ENV: args[0]} if args else None
    try:
        load(env)
    except UnusableUCX as exc:
        print(f"unusable: {exc}")
        return 1
    print(f"usable: UCX {_version(_loaded[-1])} at {check_single()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
