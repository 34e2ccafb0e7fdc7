"""The ``--model-dir`` directories: which files a node-local load may read.

A name is opened only if it lies inside a model directory, checked before a byte
is read: (1) no empty, ``.`` or ``..`` component, printable; an absolute name must
start with a directory's path, a relative one is tried in each in order; (2) the
``realpath`` must lie inside a directory (links between or within are fine: the
Hugging Face cache is made of them); (3) opened with ``O_NOFOLLOW | O_NONBLOCK |
O_NOCTTY``, a regular file; (4) checked again through the descriptor
(``/proc/self/fd/N``, else ``fstat`` against the path), catching a swapped directory.

Refusals are FORBIDDEN and name only what the tenant named (never the directory);
a file in none of them is NOT_FOUND. Files are opened and read in pool threads
(at most one load per tenant), and their tensor layouts cached by file identity
(device, inode, size, mtime, ctime).
"""

from __future__ import annotations

import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from rpcbuf.control.formats.modelheaders import (
    Malformed,
    Ranges,
    gguf_ranges,
    safetensors_length,
    safetensors_parse,
    safetensors_ranges,
)
from rpcbuf.control.wire.errors import BadRequest, Forbidden, NotFound, VerifyFailed
from rpcbuf.dataplane.copypool import CopyPool

FILE_THREADS = 2  # loads read at once on a node; one per tenant
LAYOUTS = 64  # file headers remembered
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@dataclass(frozen=True)
class ModelDir:
    given: str  # as the operator wrote it, made absolute
    real: str  # resolved


@dataclass
class OpenedFile:
    """A model file opened for a load: close ``fd`` when done."""

    fd: int
    name: str  # what the tenant asked for (what messages and the audit say)
    real: str  # where it is (the audit trail)
    size: int
    ident: tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns


class ModelFiles:
    """The node's model directories, their reader threads, their files' layouts."""

    def __init__(self, dirs: Sequence[str], threads: int = FILE_THREADS) -> None:
        """Raises ValueError naming a directory that does not exist or is none."""
        self.dirs: list[ModelDir] = []
        for d in dirs:
            given = os.path.abspath(d)
            real = os.path.realpath(given)
            if not os.path.isdir(real):
                raise ValueError(f"--model-dir {d}: not a directory")
            self.dirs.append(ModelDir(given, real))
        self.pool = CopyPool(threads, per_tenant=1)
        self._layouts: OrderedDict[tuple[int, ...], Ranges] = OrderedDict()
        self._lock = threading.Lock()  # the layouts are looked up from the pool's threads

    def close(self) -> None:
        self.pool.close()

    # -- opening (run in a pool thread: file systems may block) -----------------------

    def candidates(self, name: str) -> list[str]:
        """Where ``name`` may lie, in order (no file system access). FORBIDDEN when outside."""
        if not name.startswith("/"):
            return [os.path.join(d.real, name) for d in self.dirs]
        for d in self.dirs:
            for root in (d.given, d.real):
                if _inside(name, root) and name != root:
                    return [d.real + name[len(root):]]
        raise Forbidden(f"{name!r} is outside this node's model directories (--model-dir)",
                        {"path": name, "reason": "outside_model_dirs"})

    def open(self, name: str) -> OpenedFile:
        """Open model file ``name``, confined (see the module). FORBIDDEN, NOT_FOUND."""
        for path in self.candidates(name):
            try:
                real = os.path.realpath(path)
            except OSError:  # a link on the way became a file between its lstat and readlink
                raise _changed(name) from None
            if not self._within(real):
                raise Forbidden(f"{name!r} leads outside this node's model directories "
                                "(a symlink out of them)",
                                {"path": name, "reason": "outside_model_dirs"})
            try:
                fd = os.open(real, _FLAGS)
            except FileNotFoundError:
                continue
            except OSError as exc:  # ELOOP: a symlink appeared; EACCES; EISDIR ...
                raise Forbidden(f"{name!r} cannot be opened on this node: "
                                f"{exc.strerror or type(exc).__name__}", {"path": name}) from None
            try:
                return self._check(fd, name, real)
            except OSError:  # the re-check's stat: the path is gone or another file now
                os.close(fd)
                raise _changed(name) from None
            except BaseException:
                os.close(fd)
                raise
        raise NotFound(f"this node has no file {name!r} in its model directories",
                       {"path": name, "reason": "missing_file"})

    def _within(self, real: str) -> bool:
        return any(_inside(real, d.real) and real != d.real for d in self.dirs)

    def _check(self, fd: int, name: str, real: str) -> OpenedFile:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Forbidden(f"{name!r} is not a regular file on this node", {"path": name})
        try:
            really = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc: the path must still name this very file
            now = os.stat(real, follow_symlinks=False)
            really = real if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino) else ""
        if not self._within(really.removesuffix(" (deleted)")):
            raise Forbidden(f"{name!r} leads outside this node's model directories "
                            "(it changed while it was opened)",
                            {"path": name, "reason": "outside_model_dirs"})
        os.set_blocking(fd, True)
        return OpenedFile(fd, name, really, st.st_size,
                          (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))

    def prepare(self, name: str, size: int) -> tuple[OpenedFile, Ranges]:
        """``open``, check its size (VERIFY_FAILED), then its ``layout``, in one pool trip.
        The caller closes the descriptor; on failure it is closed here."""
        f = self.open(name)
        try:
            if f.size != size:
                raise VerifyFailed(f"{name}: this node's copy is {f.size} bytes, the driver's "
                                   f"is {size}", {"path": name, "size": f.size,
                                                  "expected": size, "reason": "size"})
            return f, self.layout(f)
        except BaseException:
            os.close(f.fd)
            raise

    # -- what is in a file -------------------------------------------------------------

    def layout(self, f: OpenedFile) -> Ranges:
        """Where each tensor of the opened file lies, its header checked against the file;
        cached by identity. BAD_REQUEST naming the file."""
        with self._lock:
            got = self._layouts.get(f.ident)
            if got is not None:
                self._layouts.move_to_end(f.ident)
                return got
        try:
            got = _ranges(f.fd, f.size)
        except Malformed as exc:
            raise BadRequest(f"{f.name!r} on this node is not a valid safetensors or GGUF "
                             f"file: {exc}", {"path": f.name}) from None
        with self._lock:
            self._layouts[f.ident] = got
            while len(self._layouts) > LAYOUTS:
                self._layouts.popitem(last=False)
        return got


def _changed(name: str) -> Forbidden:
    """FORBIDDEN for a file whose path changed while resolved or opened (naming
    only what the tenant asked for)."""
    return Forbidden(f"{name!r} changed on this node while it was opened (try again)",
                     {"path": name, "reason": "changed_while_opened"})


def _ranges(fd: int, size: int) -> Ranges:
    """The opened file's layout, read with ``pread`` on the checked descriptor (never a
    memory map, which a truncating publisher turns into SIGBUS)."""
    if os.pread(fd, 4, 0) == b"GGUF":
        return gguf_ranges(lambda offset, n: os.pread(fd, n, offset), size)
    n = safetensors_length(os.pread(fd, 8, 0), size)
    raw = os.pread(fd, n, 8)
    if len(raw) != n:
        raise Malformed("the file shrank while it was read")
    base, header = safetensors_parse(raw, size, {})
    return safetensors_ranges(base, header)
