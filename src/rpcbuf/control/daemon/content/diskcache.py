"""A bounded on-disk cache of tensor contents by hash, per tenant (``--cache-dir``),
so a restarted daemon still deduplicates.

- Layout: ``DIR/<tenant key>/<2 hex>/<32 hex of xxh3-128>.bin``; the tenant key
  hashes the name (dedup stays per tenant). A file is a 40-byte header (magic,
  nbytes, xxh3-64, xxh3-128) and the bytes, written under a temporary name and renamed.
- Nothing read is trusted: the header, size and xxh3-64 of what was read are
  checked against the file and the client's checksum; a file that does not match
  itself is logged, deleted and reported missing. LRU-bounded (``--cache-size``).
- Nothing found is trusted, links least of all (a planted symlink could make the
  daemon delete, overwrite or serve files elsewhere): the dir must be ours and
  not group/other-writable (else exit 2), and everything below it is reached
  relative to its parent's descriptor with ``O_NOFOLLOW`` (``O_NONBLOCK`` against
  FIFOs), new files ``O_CREAT | O_EXCL``. Only the configured path may be a link.
- Blocking file I/O: called in worker threads; a lock guards the shared LRU.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import stat
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from rpcbuf.dataplane.checksum import checksum, digest128

log = logging.getLogger("rpcbuf.daemon")
MAGIC = b"RPCBUFC1"
HEADER = struct.Struct("<8sQQQQ")  # magic, nbytes, xxh3-64, xxh3-128 low, high
MASK64 = (1 << 64) - 1
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def tenant_key(tenant: str) -> str:
    return hashlib.sha256(b"rpcbuf-tenant\0" + tenant.encode()).hexdigest()[:32]


def _private(st: os.stat_result) -> str:
    """Why a directory is not safe to hold the cache in, or ''."""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not this daemon's user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def _open_root(root: Path) -> int:
    """The cache dir, made if missing, as a descriptor. ValueError (exit 2) when not
    safe, OSError when unusable."""
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise OSError(f"--cache-dir {root}: {exc.strerror or exc}") from None
    why = _private(os.fstat(fd))
    if why:
        os.close(fd)
        raise ValueError(f"--cache-dir {root}: {why}; refusing it (another user could plant "
                         "links or files there)")
    return fd


def _open_dir(parent: int, name: str, create: bool = False) -> int:
    """``name`` in ``parent``, never through a link; only a private directory of ours."""
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            pass
    fd = os.open(name, _DIR, dir_fd=parent)  # ELOOP / ENOTDIR: a link or not a directory
    why = _private(os.fstat(fd))
    if why:
        os.close(fd)
        raise PermissionError(f"cache directory {name}: {why}")
    return fd


def _check(f: io.BufferedReader, digest: int, out: np.ndarray) -> tuple[str, int]:
    """Read a cache file into ``out``: (what is wrong with it or '', its xxh3-64)."""
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        return "not a regular file", 0
    head = f.read(HEADER.size)
    if len(head) != HEADER.size:
        return "short header", 0
    magic, n, csum, lo, hi = HEADER.unpack(head)
    if magic != MAGIC or n != out.nbytes or (hi << 64 | lo) != digest:
        return "header does not match", csum
    if f.readinto(out.data.cast("B")) != n or f.read(1):
        return "wrong length", csum
    if checksum(out) != csum:
        return "contents do not match their checksum", csum
    return "", csum


def _scan_leaf(xfd: int, tkey: str, found: list[tuple[float, tuple[str, int], int]]) -> int:
    """Add one leaf's content files to ``found``, delete torn writes; the count skipped."""
    skipped = 0
    with os.scandir(xfd) as files:
        for f in files:
            if not f.is_file(follow_symlinks=False):
                skipped += 1
                continue
            if f.name.endswith(".tmp"):
                try:
                    os.unlink(f.name, dir_fd=xfd)  # removes the entry only
                except OSError:
                    pass
                continue
            stem, _, ext = f.name.partition(".")
            if ext != "bin" or len(stem) != 32:
                continue
            try:
                digest = int(stem, 16)
            except ValueError:
                continue
            st = f.stat(follow_symlinks=False)
            found.append((st.st_mtime, (tkey, digest), st.st_size))
    return skipped


class DiskCache:
    def __init__(self, root: str | Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[str, int], int] = OrderedDict()  # key -> file bytes
        self.used = 0
        self.counters = {"hits": 0, "misses": 0, "corrupt": 0, "written": 0, "evicted": 0}
        self._fd = _open_root(self.root)
        self._scan()

    def close(self) -> None:
        """Idempotent; only while no method runs (a thread could reach a reused number)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def _scan(self) -> None:
        """Index what is on disk, oldest first, removing torn writes; links are skipped."""
        found: list[tuple[float, tuple[str, int], int]] = []
        skipped = 0
        for tkey, tfd in self._subdirs(self._fd):
            try:
                for _, xfd in self._subdirs(tfd):
                    try:
                        skipped += _scan_leaf(xfd, tkey, found)
                    except OSError:
                        continue
                    finally:
                        os.close(xfd)
            finally:
                os.close(tfd)
        for _, key, size in sorted(found):
            self._lru[key] = size
            self.used += size
        self._evict(0)
        if skipped:
            log.warning("disk cache %s: skipped %d entries that are not plain files or "
                        "directories (links are never followed)", self.root, skipped)
        log.info("disk cache %s: %d files, %d bytes (limit %d)", self.root, len(self._lru),
                 self.used, self.max_bytes)

    def _subdirs(self, parent: int) -> Iterator[tuple[str, int]]:
        """``(name, descriptor)`` of each real, private directory; the caller closes them."""
        try:
            with os.scandir(parent) as entries:
                names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError:
            return
        for name in names:
            try:
                fd = _open_dir(parent, name)
            except OSError as exc:
                log.warning("disk cache %s: skipping %s: %s", self.root, name, exc)
                continue
            yield name, fd

    def _path(self, tkey: str, digest: int) -> Path:
        """For messages: the file's path (files are opened through ``_leaf``)."""
        name = f"{digest:032x}"
        return self.root / tkey / name[:2] / f"{name}.bin"

    @contextmanager
    def _leaf(self, tkey: str, digest: int, create: bool = False) -> Iterator[tuple[int, str]]:
        """``(dir descriptor, file name)`` of a content's file, opened without following
        links. OSError (FileNotFoundError: not there)."""
        name = f"{digest:032x}"
        tfd = _open_dir(self._fd, tkey, create)
        try:
            xfd = _open_dir(tfd, name[:2], create)
            try:
                yield xfd, f"{name}.bin"
            finally:
                os.close(xfd)
        finally:
            os.close(tfd)

    def _unlink(self, tkey: str, digest: int) -> None:
        try:
            with self._leaf(tkey, digest) as (dfd, name):
                os.unlink(name, dir_fd=dfd)  # a link: the link goes, its target stays
        except OSError:
            pass

    def accepts(self, nbytes: int) -> bool:
        return 0 < nbytes and HEADER.size + nbytes <= self.max_bytes

    def has(self, tenant: str, digest: int, nbytes: int) -> bool:
        key = (tenant_key(tenant), digest)
        with self._lock:
            size = self._lru.get(key)
            if size is None or size == HEADER.size + nbytes:
                return size is not None
            self._drop(key)  # one content, one size: this file was cut or grown
        log.warning("disk cache: ignoring and deleting corrupt file %s (%d bytes, not %d)",
                    self._path(*key), size, HEADER.size + nbytes)
        self.counters["corrupt"] += 1
        self._unlink(*key)
        return False

    def read_into(self, tenant: str, digest: int, expected_checksum: int,
                  out: np.ndarray) -> bool:
        """Fill ``out``; True only if the bytes hash to ``digest`` and ``expected_checksum``.
        A file that does not match itself, or is no regular file, is deleted."""
        tkey = tenant_key(tenant)
        path = self._path(tkey, digest)
        try:
            with self._leaf(tkey, digest) as (dfd, name):
                fd = os.open(name, _READ, dir_fd=dfd)
                with open(fd, "rb") as f:
                    why, csum = _check(f, digest, out)
                    if not why and csum == expected_checksum:
                        try:
                            os.utime(fd)  # survives a restart as recency
                        except OSError:
                            pass
        except FileNotFoundError:
            with self._lock:
                self._drop((tkey, digest))
            self.counters["misses"] += 1
            return False
        except OSError as exc:  # ELOOP: a link where a file or directory should be
            why = f"unreadable: {exc}"
        if why:
            log.warning("disk cache: ignoring and deleting corrupt file %s (%s)", path, why)
            self.counters["corrupt"] += 1
            with self._lock:
                self._drop((tkey, digest))
            self._unlink(tkey, digest)
            return False
        if csum != expected_checksum:  # sound, but not the bytes the caller means
            self.counters["misses"] += 1
            return False
        with self._lock:
            if (tkey, digest) in self._lru:
                self._lru.move_to_end((tkey, digest))
        self.counters["hits"] += 1
        return True

    def write(self, tenant: str, digest: int, csum: int, data: np.ndarray) -> bool:
        """Store ``data`` if it still hashes to ``digest``; evict to stay within the limit."""
        nbytes = int(data.nbytes)
        if not self.accepts(nbytes):
            return False
        tkey = tenant_key(tenant)
        if self.has(tenant, digest, nbytes):
            return True
        path = self._path(tkey, digest)
        try:
            with self._leaf(tkey, digest, create=True) as (dfd, name):
                tmp = f"{name[:-4]}.{threading.get_ident()}.tmp"
                fd = os.open(tmp, _CREATE, 0o600, dir_fd=dfd)  # EEXIST even for a link
                try:
                    with open(fd, "wb") as f:
                        f.write(HEADER.pack(MAGIC, nbytes, csum, digest & MASK64, digest >> 64))
                        f.write(data.data.cast("B"))
                    if digest128(data) != digest or checksum(data) != csum:  # changed under us
                        os.unlink(tmp, dir_fd=dfd)
                        return False
                    # rename replaces whatever has the name (a link too), never its target
                    os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                except BaseException:
                    try:
                        os.unlink(tmp, dir_fd=dfd)
                    except OSError:
                        pass
                    raise
        except OSError as exc:
            log.warning("disk cache: cannot write %s: %s", path, exc)
            return False
        with self._lock:
            self._evict(HEADER.size + nbytes)
            self._lru[(tkey, digest)] = HEADER.size + nbytes
            self.used += HEADER.size + nbytes
        self.counters["written"] += 1
        return True

    def _drop(self, key: tuple[str, int]) -> None:
        size = self._lru.pop(key, None)
        if size is not None:
            self.used -= size

    def _evict(self, room: int) -> None:
        """Remove least recently used files until ``room`` more bytes fit (lock held)."""
        while self._lru and self.used + room > self.max_bytes:
            (tkey, digest), _ = next(iter(self._lru.items()))
            self._drop((tkey, digest))
            self.counters["evicted"] += 1
            self._unlink(tkey, digest)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"files": len(self._lru), "bytes": self.used, "max_bytes": self.max_bytes,
                    **self.counters}
