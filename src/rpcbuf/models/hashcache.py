"""Client-side cache of tensors' content hashes, so a re-upload of an unchanged
file reads only what the daemon asks for.

Keyed by the file's identity ``(st_dev, st_ino, st_size, st_mtime_ns,
st_ctime_ns)`` plus the tensor's name, offset and size: a changed file gets
another identity.  The daemon never trusts these hashes: it verifies what it
places and hashes what is sent.  One JSON file, ``$RPCBUF_CACHE_DIR/hashes.json``
(default ``~/.cache/rpcbuf``), written atomically, at most ``MAX_FILES`` files
(LRU); an unreadable file is ignored, a failed save loses only time.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("rpcbuf.client")
VERSION = 1
MAX_FILES = 256
FILE_NAME = "hashes.json"


def cache_dir() -> Path:
    env = os.environ.get("RPCBUF_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "rpcbuf"


def file_key(path: Path) -> str:
    """The identity of a file's current contents, as far as its metadata tells."""
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def tensor_key(name: str, offset: int, nbytes: int) -> str:
    return f"{offset}:{nbytes}:{name}"


class HashCache:
    """``{file key: {tensor key: (xxh3-128, xxh3-64)}}``, loaded once, saved once."""

    def __init__(self, root: Path | None = None) -> None:
        self.path = (root or cache_dir()) / FILE_NAME
        self._files: dict[str, dict[str, Any]] = self._load()
        self._dirty = False

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("version") != VERSION \
                    or not isinstance(data.get("files"), dict):
                raise ValueError("not a hash cache of this version")
            files: dict[str, dict[str, Any]] = {}
            for key, entry in data["files"].items():
                if isinstance(entry, dict) and isinstance(entry.get("tensors"), dict):
                    files[str(key)] = entry
            return files
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.warning("hash cache %s is unusable, ignoring it: %s", self.path, exc)
            return {}

    def get(self, fkey: str, tkey: str) -> tuple[int, int] | None:
        entry = self._files.get(fkey)
        if entry is None:
            return None
        got = entry["tensors"].get(tkey)
        try:
            long, short = got
            out = (int(long, 16), int(short))
        except (TypeError, ValueError):
            return None
        if not (0 <= out[0] < 1 << 128 and 0 <= out[1] < 1 << 64):
            return None
        return out

    def put(self, fkey: str, tkey: str, hashes: tuple[int, int]) -> None:
        entry = self._files.setdefault(fkey, {"tensors": {}})
        entry["tensors"][tkey] = [f"{hashes[0]:032x}", int(hashes[1])]
        entry["used"] = time.time()
        self._dirty = True

    def touch(self, fkey: str) -> None:
        if fkey in self._files:
            self._files[fkey]["used"] = time.time()
            self._dirty = True

    def save(self) -> None:
        """Merge with what is on disk now, write atomically; errors are logged,
        never raised."""
        if not self._dirty:
            return
        try:
            merged = {**self._load(), **self._files}
            keep = sorted(merged, key=lambda k: float(merged[k].get("used", 0) or 0))
            files = {k: merged[k] for k in keep[-MAX_FILES:]}
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(prefix=".hashes.", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"version": VERSION, "files": files}, f, separators=(",", ":"))
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
            self._dirty = False
        except (OSError, TypeError, ValueError) as exc:
            log.warning("cannot save hash cache %s: %s", self.path, exc)
