"""A bounded on-disk cache of tensor contents by hash, per tenant (``--cache-dir``).

It lets a restarted daemon still deduplicate: contents stored before the
restart are copied from local disk instead of crossing the network again.

Layout: ``DIR/<tenant key>/<2 hex>/<32 hex of xxh3-128>.bin``.  The tenant key
is a hash of the tenant name, so one tenant's contents are never looked up
for another (dedup stays per tenant) and names need no escaping.  Each file
is a 40-byte header (magic, nbytes, xxh3-64, xxh3-128 as two words) and the
bytes.  A file is written under a temporary name and renamed when complete.

Nothing read from disk is trusted: ``read_into`` checks the header against
the hash asked for and the size, then recomputes the xxh3-64 of what it read
and compares it with the header's and with the checksum the client expects
(so the xxh3-128 need not be recomputed: 64 bits of the client's own
checksum already pin the contents); a file that does not match itself (a
torn write, a flipped bit, a file cut short) is logged, deleted and reported
as missing — a corrupt file is never served.  The cache is bounded
(``--cache-size``): least recently used files are evicted first (use = a
write or a verified read).

The methods do blocking file I/O: the daemon calls them in worker threads.
A lock guards the in-memory LRU, which threads and the event loop share.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from dataplane.checksum import checksum

log = logging.getLogger("rpcbuf.daemon")
MAGIC = b"RPCBUFC1"
HEADER = struct.Struct("<8sQQQQ")  # magic, nbytes, xxh3-64, xxh3-128 low, high
MASK64 = (1 << 64) - 1


def digest128(data: Any) -> int:
    """xxh3-128 of a contiguous buffer, as an int (what dedup keys on)."""
    return xxhash.xxh3_128_intdigest(memoryview(data).cast("B"))


def tenant_key(tenant: str) -> str:
    return hashlib.sha256(b"rpcbuf-tenant\0" + tenant.encode()).hexdigest()[:32]


class DiskCache:
    def __init__(self, root: str | Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[str, int], int] = OrderedDict()  # key -> file bytes
        self.used = 0
        self.counters = {"hits": 0, "misses": 0, "corrupt": 0, "written": 0, "evicted": 0}
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._scan()

    def _scan(self) -> None:
        """Index what is on disk, oldest first; remove leftovers of torn writes."""
        found: list[tuple[float, tuple[str, int], int]] = []
        for path in self.root.glob("*/*/*"):
            try:
                if path.suffix == ".tmp":
                    path.unlink()
                    continue
                if path.suffix != ".bin" or len(path.stem) != 32:
                    continue
                st = path.stat()
                found.append((st.st_mtime, (path.parent.parent.name, int(path.stem, 16)),
                              st.st_size))
            except (OSError, ValueError):
                continue
        for _, key, size in sorted(found):
            self._lru[key] = size
            self.used += size
        self._evict(0)
        log.info("disk cache %s: %d files, %d bytes (limit %d)", self.root, len(self._lru),
                 self.used, self.max_bytes)

    def _path(self, tkey: str, digest: int) -> Path:
        name = f"{digest:032x}"
        return self.root / tkey / name[:2] / f"{name}.bin"

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
        try:
            self._path(*key).unlink()
        except OSError:
            pass
        return False

    def read_into(self, tenant: str, digest: int, expected_checksum: int,
                  out: np.ndarray) -> bool:
        """Fill ``out`` with the cached bytes; True only if they hash to
        ``digest`` and their xxh3-64 is ``expected_checksum``.  A file that
        does not match itself (header, name, contents) is deleted; one that is
        sound but holds other bytes than the caller expects is kept."""
        tkey = tenant_key(tenant)
        path = self._path(tkey, digest)
        why = ""
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER.size)
                if len(head) != HEADER.size:
                    why = "short header"
                else:
                    magic, n, csum, lo, hi = HEADER.unpack(head)
                    if magic != MAGIC or n != out.nbytes or (hi << 64 | lo) != digest:
                        why = "header does not match"
                    elif f.readinto(out.data.cast("B")) != n or f.read(1):
                        why = "wrong length"
                    elif checksum(out) != csum:
                        why = "contents do not match their checksum"
        except FileNotFoundError:
            with self._lock:
                self._drop((tkey, digest))
            self.counters["misses"] += 1
            return False
        except OSError as exc:
            why = f"unreadable: {exc}"
        if why:
            log.warning("disk cache: ignoring and deleting corrupt file %s (%s)", path, why)
            self.counters["corrupt"] += 1
            with self._lock:
                self._drop((tkey, digest))
            try:
                path.unlink()
            except OSError:
                pass
            return False
        if csum != expected_checksum:  # sound, but not the bytes the caller means
            self.counters["misses"] += 1
            return False
        with self._lock:
            if (tkey, digest) in self._lru:
                self._lru.move_to_end((tkey, digest))
        self.counters["hits"] += 1
        try:
            os.utime(path)  # survives a restart as recency
        except OSError:
            pass
        return True

    def write(self, tenant: str, digest: int, csum: int, data: np.ndarray) -> bool:
        """Store ``data`` under ``digest`` if it still hashes to it (the arena
        may have changed since it was indexed); evict to stay within the limit."""
        nbytes = int(data.nbytes)
        if not self.accepts(nbytes):
            return False
        tkey = tenant_key(tenant)
        if self.has(tenant, digest, nbytes):
            return True
        path = self._path(tkey, digest)
        tmp = path.with_name(f"{path.stem}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, nbytes, csum, digest & MASK64, digest >> 64))
                f.write(data.data.cast("B"))
            if digest128(data) != digest or checksum(data) != csum:  # changed under us
                tmp.unlink()
                return False
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("disk cache: cannot write %s: %s", path, exc)
            try:
                tmp.unlink()
            except OSError:
                pass
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
            try:
                self._path(tkey, digest).unlink()
            except OSError:
                pass

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"files": len(self._lru), "bytes": self.used, "max_bytes": self.max_bytes,
                    **self.counters}
