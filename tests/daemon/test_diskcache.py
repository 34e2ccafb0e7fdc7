"""The disk cache (``--cache-dir``) against links and files planted in it.

Whoever can write into the cache directory could make the daemon delete,
overwrite or serve files outside it through a symlink: the start-up scan
followed a planted directory link and deleted a ``*.tmp`` file in the
target, writes followed a planted file link.  The daemon refuses a cache
dir another user owns or that group/others may write, and within it opens
every directory and file relative to its parent with ``O_NOFOLLOW``, so a
link is never followed, whatever it points at.  Tests run as root, as the
daemon may: root's permission checks would not stop any of this.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT
from rpcbuf.control.daemon.content.diskcache import HEADER, MAGIC, MASK64, DiskCache, tenant_key
from rpcbuf.dataplane.checksum import checksum, digest128


def entry(data: np.ndarray) -> tuple[int, int, bytes]:
    """``(digest, checksum, a sound cache file's bytes)`` for ``data``."""
    digest, csum = digest128(data), checksum(data)
    blob = HEADER.pack(MAGIC, data.nbytes, csum, digest & MASK64, digest >> 64) + data.tobytes()
    return digest, csum, blob


def place(root: Path, tenant: str, digest: int) -> Path:
    """Where the cache keeps ``digest`` of ``tenant`` (its directories made)."""
    name = f"{digest:032x}"
    leaf = root / tenant_key(tenant) / name[:2]
    leaf.mkdir(parents=True, exist_ok=True, mode=0o700)
    return leaf / f"{name}.bin"


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    cache.mkdir(mode=0o700)
    (outside / "ab").mkdir(parents=True)
    return cache, outside


def test_startup_scan_neither_follows_nor_deletes_through_links(dirs: tuple[Path, Path]) -> None:
    cache, outside = dirs
    victims = [outside / "ab" / "precious.tmp", outside / "ab" / ("c" * 32 + ".bin"),
               outside / "lone.tmp"]
    for v in victims:
        v.write_bytes(b"not the cache's")
    (cache / "tenant-link").symlink_to(outside)  # DIR/<tenant> -> outside
    (cache / "t2").mkdir(mode=0o700)
    (cache / "t2" / "ab").symlink_to(outside / "ab")  # DIR/<tenant>/<xx> -> outside/ab
    (cache / "t3" / "ab").mkdir(parents=True, mode=0o700)
    (cache / "t3" / "ab" / "x.tmp").symlink_to(outside / "lone.tmp")  # a file link
    (cache / "t3" / "ab" / ("d" * 32 + ".bin")).symlink_to(victims[1])
    c = DiskCache(cache, 1 << 20)
    assert all(v.read_bytes() == b"not the cache's" for v in victims)
    assert c.stats()["files"] == 0 and c.used == 0  # nothing outside was indexed
    c.close()


def test_writes_do_not_follow_links(dirs: tuple[Path, Path]) -> None:
    import threading

    cache, outside = dirs
    victim = outside / "victim"
    victim.write_bytes(b"keep me")
    c = DiskCache(cache, 1 << 20)
    a, b, d = (np.full(256, i, np.uint8) for i in range(3))
    # The temporary file's name, planted as a link to the victim.
    da, ca, _ = entry(a)
    path = place(cache, "t", da)
    path.with_name(f"{path.stem}.{threading.get_ident()}.tmp").symlink_to(victim)
    assert not c.write("t", da, ca, a)
    # The final name, planted as a link: replaced by the cache's own file.
    db, cb, _ = entry(b)
    link = place(cache, "t", db)
    link.symlink_to(victim)
    assert c.write("t", db, cb, b)
    assert not link.is_symlink() and link.read_bytes()[HEADER.size:] == b.tobytes()
    # The tenant's directory planted as a link to a directory outside.
    (cache / tenant_key("u")).symlink_to(outside)
    dd, cd, _ = entry(d)
    assert not c.write("u", dd, cd, d)
    assert victim.read_bytes() == b"keep me"
    assert sorted(p.name for p in outside.rglob("*")) == ["ab", "victim"]
    c.close()


@pytest.mark.timeout(30)
def test_reads_do_not_follow_links_or_block_on_a_fifo(dirs: tuple[Path, Path]) -> None:
    cache, outside = dirs
    c = DiskCache(cache, 1 << 20)
    a, b, d = (np.full(256, i + 7, np.uint8) for i in range(3))
    out = np.empty(256, np.uint8)
    # A sound entry outside, reached through a file link: not served, not deleted.
    da, ca, blob = entry(a)
    (outside / "sound.bin").write_bytes(blob)
    place(cache, "t", da).symlink_to(outside / "sound.bin")
    assert not c.read_into("t", da, ca, out)
    # ... through a tenant directory link.
    db, cb, blob = entry(b)
    name = f"{db:032x}"
    (outside / name[:2]).mkdir(exist_ok=True)
    (outside / name[:2] / f"{name}.bin").write_bytes(blob)
    (cache / tenant_key("u")).symlink_to(outside)
    assert not c.read_into("u", db, cb, out)
    # A FIFO where a file should be: refused at once, not waited on.
    dd, cd, _ = entry(d)
    os.mkfifo(place(cache, "t", dd))
    assert not c.read_into("t", dd, cd, out)
    assert (outside / "sound.bin").read_bytes() == entry(a)[2]
    assert (outside / name[:2] / f"{name}.bin").exists()
    assert c.stats()["hits"] == 0
    c.close()


@pytest.mark.parametrize("why", ["group-writable", "other-writable", "other-owner"])
def test_unsafe_cache_dir_is_refused(dirs: tuple[Path, Path], why: str) -> None:
    cache, _ = dirs
    if why == "group-writable":
        cache.chmod(0o770)
    elif why == "other-writable":
        cache.chmod(0o707)
    else:
        os.chown(cache, 65534, 65534)
    fragment = "owned by uid 65534" if why == "other-owner" else "writable by group or others"
    with pytest.raises(ValueError, match=fragment):
        DiskCache(cache, 1 << 20)
    args = [sys.executable, "-m", "rpcbuf.control.daemon", "--listen", "127.0.0.1:0", "--ucx-port",
            "0", "--device", "cpu:1MiB", "--secret-file", str(cache.parent / "secret"),
            "--cache-dir", str(cache)]
    res = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert "Traceback" not in res.stderr and fragment in lines[-1] and str(cache) in lines[-1]


def test_sound_entries_still_round_trip_and_survive_a_restart(dirs: tuple[Path, Path]) -> None:
    cache, _ = dirs
    c = DiskCache(cache, 1 << 20)
    a = np.arange(1000, dtype=np.float32)
    da, ca, _ = entry(a)
    assert c.write("t", da, ca, a) and c.has("t", da, a.nbytes)
    c.close()
    again = DiskCache(cache, 1 << 20)
    out = np.empty_like(a)
    assert again.stats()["files"] == 1 and again.read_into("t", da, ca, out)
    np.testing.assert_array_equal(out, a)
    again.close()
