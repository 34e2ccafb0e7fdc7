"""The client's side of the keyed block tier: put, get, lookup, remove and
list blocks by key, many keys a call.

- Same host, in place (docs/kvcache.md): a put asks for its slots
  (``block_place``), copies each array into this session's mapping of the
  tenant's segment, hashes it and commits; a get locates (pins), copies out
  and unpins (not waited for).  A failure between a put's halves aborts it.
  ``RPCBUF_BLOCKS_IN_PLACE=0`` turns this off.
- Otherwise blocks travel as a batch's items over the session's path, one
  UCX message per block.  Every put carries each block's xxh3-64; the
  daemon commits only if all match.
- A get names each key once on the wire (a key asked twice is read once and
  copied).  The daemon's get is all or nothing: here it is asked again for
  the keys that were there, at most ``GET_TRIES`` times.
- Answers are checked before use: ``list_all`` always moves forward and
  stops at its key, character and time bounds whatever the daemon says of
  "more"; ``get_block`` allocates at most ``max_nbytes``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rpcbuf.control.client.answers import (
    MAX_BLOCK_NBYTES,
    parse_block_list,
    parse_block_lookup,
    parse_removed,
)
from rpcbuf.control.client.arrays import host_data
from rpcbuf.control.client.attach import SegmentMaps
from rpcbuf.control.client.connection import Caller
from rpcbuf.control.client.datapath import BufferPlace, DataPaths, Transfer
from rpcbuf.control.client.handles import Handles
from rpcbuf.control.client.tensors import XXH3
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, ConnectionLost, NotFound

log = logging.getLogger("rpcbuf.client")
HOST = BufferPlace(gpu=False, checksum_kind="xxh3")  # blocks live in host memory
GET_TRIES = 3
# What ``list_all`` (LMCache's ``list``) gathers at most: 262,144 keys name
# 1 TiB of LMCache's 4 MiB chunks; the characters bound keys of any length.
LIST_MAX_KEYS = 1 << 18
LIST_MAX_CHARS = 32 << 20


def check_keys(keys: Any) -> list[str]:
    """``keys`` as a list the daemon takes.  Raises BAD_REQUEST."""
    if isinstance(keys, str):
        raise BadRequest("keys must be a sequence of strings, not one string")
    try:
        out = list(keys)
    except TypeError:
        raise BadRequest("keys must be a sequence of strings") from None
    if not P.block_keys_ok(out):
        raise BadRequest(f"keys must be 1 to {P.MAX_BLOCK_KEYS} printable strings of 1 to "
                         f"{P.MAX_BLOCK_KEY} characters")
    return out


def put_pairs(blocks: Mapping[str, Any] | Sequence[tuple[str, Any]]
              ) -> tuple[list[str], list[np.ndarray]]:
    """The keys and host bytes of a put, checked.  Raises BAD_REQUEST."""
    pairs = list(blocks.items()) if isinstance(blocks, Mapping) else list(blocks)
    try:
        keys, arrays = [k for k, _ in pairs], [a for _, a in pairs]
    except (TypeError, ValueError):
        raise BadRequest("blocks must be a mapping or (key, array) pairs") from None
    keys = check_keys(keys)
    if len(set(keys)) != len(keys):
        raise BadRequest("put_blocks names each key once")
    datas = host_data(arrays, "put_blocks takes host arrays (blocks live in host memory)")
    if any(d.nbytes == 0 for d in datas):
        raise BadRequest("every block holds at least one byte")
    return keys, datas


def get_targets(keys: Sequence[str], out: Sequence[Any]) -> tuple[list[str], list[np.ndarray]]:
    """The keys of a get and the host bytes they are read into, checked.
    Raises BAD_REQUEST."""
    keys = check_keys(keys)
    if len(out) != len(keys):
        raise BadRequest(f"{len(keys)} keys and {len(out)} arrays to read into")
    return keys, host_data(list(out), "get_blocks takes host arrays (blocks live in host "
                           "memory)", writable=True)


class BlockOps:
    """The block verbs of one context; ``check_open`` first, as every verb."""

    def __init__(self, caller: Caller, paths: DataPaths, check_open: Callable[[], None],
                 handles: Handles | None = None, inline: bool = False) -> None:
        self._call, self._paths, self._check_open = caller.call, paths, check_open
        self._caller = caller
        self._inline = inline  # the daemon takes a small put's or get's bytes in frames
        in_place = os.environ.get("RPCBUF_BLOCKS_IN_PLACE", "1").strip() not in ("0", "no")
        # This session's mappings of its tenant's segments (same host only).
        self.segments = SegmentMaps(handles) if handles is not None and in_place else None

    def close(self) -> None:
        if self.segments is not None:
            self.segments.close()

    async def put(self, blocks: Mapping[str, Any] | Sequence[tuple[str, Any]],
                  ttl: float | None, metas: Sequence[bytes] | None, device_type: str,
                  device: int) -> dict[str, Any]:
        self._check_open()
        keys, datas = put_pairs(blocks)
        sizes = np.fromiter((d.nbytes for d in datas), dtype=np.uint64, count=len(datas))
        if self.segments is not None:
            try:
                return await self._put_in_place(keys, datas, sizes, metas, ttl, device_type,
                                                device)
            except BadRequest as exc:
                if exc.details.get("reason") != "segments":
                    raise  # else: too many segments to map at once; the path below
        sums = np.fromiter(map(XXH3, datas), dtype=np.uint64, count=len(datas))
        req = P.BlockPut(keys=keys, sizes=P.pack_u64(sizes), checksums=P.pack_u64(sums),
                         metas=None if metas is None else list(metas), ttl=ttl,
                         device_type=device_type, device=device)

        return await self._paths.run("", HOST, _transfer(req, datas, self._inline))

    async def _put_in_place(self, keys: list[str], datas: list[np.ndarray], sizes: np.ndarray,
                            metas: Sequence[bytes] | None, ttl: float | None,
                            device_type: str, device: int) -> dict[str, Any]:
        assert self.segments is not None
        answer = await self._call(P.BlockPlace(keys=keys, sizes=P.pack_u64(sizes),
                                               device_type=device_type, device=device))
        lease = answer.get("lease")
        if type(lease) is not int:
            raise ConnectionLost("the daemon's block placement names no lease")
        try:
            slots = await self.segments.views(answer, sizes.tolist(), self._caller.timeout)
            sums = np.empty(len(datas), dtype=np.uint64)
            for i, (slot, data) in enumerate(zip(slots, datas, strict=True)):
                src = _bytes(data)
                np.copyto(slot, src)  # the one copy
                sums[i] = XXH3(src)
            del slots
        except BaseException:
            self._forget(P.BlockCommit(lease=lease, checksums=P.pack_u64([]), abort=True))
            raise
        return await self._call(P.BlockCommit(lease=lease, checksums=P.pack_u64(sums),
                                              metas=None if metas is None else list(metas),
                                              ttl=ttl))

    async def _get_in_place(self, keys: list[str], targets: list[np.ndarray]) -> None:
        """One try of a get on the same host: locate (pinned), copy out, unpin.
        Raises NOT_FOUND."""
        assert self.segments is not None
        sizes = [a.nbytes for a in targets]
        answer = await self._call(P.BlockLocate(keys=keys, sizes=P.pack_u64(sizes)))
        lease = answer.get("lease")
        if type(lease) is not int:
            raise ConnectionLost("the daemon's block location names no lease")
        try:
            blocks = await self.segments.views(answer, sizes, self._caller.timeout)
            for block, target in zip(blocks, targets, strict=True):
                np.copyto(_bytes(target), block)  # the one copy
            del blocks
        finally:
            self._forget(P.BlockUnpin(lease=lease))

    async def _get_in_place_halves(self, keys: list[str], targets: list[np.ndarray]) -> None:
        """``_get_in_place`` in halves while the blocks lie in more new segments
        than one answer maps (BAD_REQUEST ``segments``)."""
        try:
            return await self._get_in_place(keys, targets)
        except BadRequest as exc:
            if exc.details.get("reason") != "segments" or len(keys) < 2:
                raise
        half = len(keys) // 2
        missing: list[Any] = []
        sizes: list[Any] = []
        for lo, hi in ((0, half), (half, len(keys))):
            try:
                await self._get_in_place_halves(keys[lo:hi], targets[lo:hi])
            except NotFound as exc:
                m, z = exc.details.get("missing"), exc.details.get("sizes")
                if not isinstance(m, list) or not m:
                    raise
                missing += [j + lo if type(j) is int else j for j in m]
                sizes += z if isinstance(z, list) and len(z) == len(m) else [None] * len(m)
        if missing:
            raise NotFound(f"{len(missing)} of {len(keys)} blocks are not here (or of another "
                           "size)", {"missing": missing, "sizes": sizes})

    def _forget(self, req: P.Request) -> None:
        """Send ``req`` and drop its answer; it goes out before any later request."""
        conn = self._caller.conn
        if conn.lost is None:
            req_id = conn.next_id()
            conn.submit(req_id, req)
            conn.forget(req_id)

    async def get(self, keys: Sequence[str], out: Sequence[Any], strict: bool = False
                  ) -> list[bool]:
        self._check_open()
        return await self._get(keys, out, strict)

    async def get_one(self, key: str, out: Any, max_nbytes: int = MAX_BLOCK_NBYTES
                      ) -> np.ndarray | None:
        self._check_open()
        if out is None:
            (info,) = await self.lookup([key], False, None)
            if info is None:
                return None
            nbytes = int(info["nbytes"])
            if nbytes > max_nbytes:  # the daemon's word, before we allocate it
                raise BadRequest(f"block {key!r:.80} is {nbytes} bytes, more than max_nbytes "
                                 f"({max_nbytes}): pass out= or a larger max_nbytes",
                                 {"nbytes": nbytes, "max_nbytes": max_nbytes,
                                  "reason": "too_big"})
            out = np.empty(nbytes, dtype=np.uint8)
        (hit,) = await self._get([key], [out])
        return out if hit else None

    async def _get(self, keys: Sequence[str], out: Sequence[Any], strict: bool = False
                   ) -> list[bool]:
        keys, targets = get_targets(keys, out)
        first: dict[str, int] = {}  # each key's first index
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        if len(first) < len(keys):
            return await self._get_twice(keys, targets, first, strict)
        found = [False] * len(keys)
        want = list(range(len(keys)))
        for _ in range(GET_TRIES):
            ask = [targets[i] for i in want]
            req = P.BlockGet(keys=[keys[i] for i in want],
                             sizes=P.pack_u64([a.nbytes for a in ask]))

            try:
                if self.segments is not None:
                    await self._get_in_place_halves(req.keys, ask)
                else:
                    await self._paths.run("", HOST, _transfer(req, ask, self._inline),
                                          receive=True)
            except NotFound as exc:
                missing = exc.details.get("missing")
                if not isinstance(missing, list) or not missing:
                    raise
                _other_sizes(keys, want, ask, missing, exc.details.get("sizes"), strict)
                gone = set(missing)
                want = [k for j, k in enumerate(want) if j not in gone]
                if not want:
                    break
                continue
            for i in want:
                found[i] = True
            break
        return found

    async def _get_twice(self, keys: list[str], targets: list[np.ndarray],
                         first: dict[str, int], strict: bool) -> list[bool]:
        """Each block read once into its first array, then copied into the others."""
        for i, key in enumerate(keys):
            if targets[i].nbytes != targets[first[key]].nbytes:
                raise BadRequest(f"key {key!r} is named twice with arrays of different sizes")
        once = list(first.values())
        got = await self._get([keys[i] for i in once], [targets[i] for i in once], strict)
        hit = {keys[i]: h for i, h in zip(once, got, strict=True)}
        for i, key in enumerate(keys):
            j = first[key]
            if i != j and hit[key]:
                np.copyto(_bytes(targets[i]), _bytes(targets[j]))
        return [hit[k] for k in keys]

    async def lookup(self, keys: Sequence[str], meta: bool,
                     timeout: float | None) -> list[dict[str, Any] | None]:
        self._check_open()
        keys = check_keys(keys)
        result = await self._call(P.BlockLookup(keys=keys, meta=meta or None), timeout)
        out: list[dict[str, Any] | None] = []
        for info in parse_block_lookup(result, len(keys)):
            if info is None:
                out.append(None)
            elif meta:
                out.append({"nbytes": info.nbytes, "meta": info.meta,
                            "expires_at": info.expires_at})
            else:
                out.append({"nbytes": info.nbytes})
        return out

    async def exist(self, keys: Sequence[str], timeout: float | None) -> list[bool]:
        return [b is not None for b in await self.lookup(keys, False, timeout)]

    async def remove(self, keys: Sequence[str], timeout: float | None) -> int:
        self._check_open()
        keys = check_keys(keys)
        return parse_removed(await self._call(P.BlockRemove(keys=keys), timeout), len(keys))

    async def list(self, prefix: str | None, start_after: str | None, limit: int,
                   timeout: float | None) -> tuple[list[str], bool]:
        self._check_open()
        result = await self._call(P.BlockList(prefix=prefix, start_after=start_after,
                                              limit=limit), timeout)
        return parse_block_list(result, limit, prefix, start_after)


Page = Callable[[str | None], Awaitable[tuple[list[str], bool]]]


async def list_all(page: Page, timeout: float, max_keys: int = LIST_MAX_KEYS,
                   max_chars: int = LIST_MAX_CHARS) -> tuple[list[str], bool]:
    """Every key, page after page, and whether the listing is complete: it
    stops at ``max_keys`` keys, ``max_chars`` characters or ``timeout``
    seconds, whatever the daemon says of more.  Raises what ``page`` raises."""
    keys: list[str] = []
    chars = 0
    after: str | None = None
    deadline = time.monotonic() + timeout
    while True:
        got, more = await page(after)
        keys += got
        chars += sum(map(len, got))
        if not more:
            return keys, True
        if len(keys) >= max_keys or chars >= max_chars or time.monotonic() >= deadline:
            return keys, False
        after = got[-1]


def _transfer(req: P.BlockPut | P.BlockGet, arrays: list[np.ndarray],
              inline: bool = False) -> Transfer:
    """Blocks as a transfer: one message per block; with ``inline``, one
    small block of a network session in the frames."""
    return Transfer(req, arrays, lambda: arrays, inline)


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def _other_sizes(keys: list[str], want: list[int], ask: list[np.ndarray], missing: list[Any],
                 sizes: Any, strict: bool) -> None:
    """A miss because the block is of another size than its array: a debug
    line per key, and with ``strict`` BAD_REQUEST ``size_mismatch``."""
    if not isinstance(sizes, list):
        return
    for j, size in zip(missing, sizes, strict=False):
        if not (isinstance(j, int) and 0 <= j < len(want)) or type(size) is not int:
            continue
        key, nbytes = keys[want[j]], ask[j].nbytes
        if strict:
            raise BadRequest(f"block {key!r:.80} is {size} bytes here; the array to read it "
                             f"into is {nbytes} bytes (get_blocks reads whole blocks)",
                             {"key": key, "nbytes": size, "array_nbytes": nbytes,
                              "reason": "size_mismatch"})
        log.debug("get_blocks: block %.80r is %d bytes, its array %d: counted a miss",
                  key, size, nbytes)
