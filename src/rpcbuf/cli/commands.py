"""The operator commands of ``rpcbuf``: status, ls, blocks, release, put, get,
bench.  Each is one async function over one connected ``RpcContext`` returning
a JSON-able result; errors are left to the caller (a daemon's: exit 1, a local
``OSError``/``ValueError``: exit 2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.text import Text

from rpcbuf.cli import tables
from rpcbuf.cli.errors import count_between
from rpcbuf.cli.locate import Found
from rpcbuf.control.client.tensors import calculate_buffer_size
from rpcbuf.control.wire.errors import NotFound, VerifyFailed
from rpcbuf.control.wire.units import format_size, parse_duration, parse_size
from rpcbuf.dataplane.checksum import checksum

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from rpcbuf.control.client.context import RpcContext

BAR = 20
CHUNK = 64 << 20  # get reads a big array in pieces of this size (its progress bar's steps)


def register_operator_commands(sub: Any,
                               client_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    st = sub.add_parser("status", help="node, uptime, devices, sessions and buffers",
                        epilog="example: rpcbuf status --endpoint 127.0.0.1:7700")
    client_flags(st)
    ls = sub.add_parser("ls", help="list this tenant's buffers",
                        epilog="example: rpcbuf ls --endpoint 127.0.0.1:7700 --json")
    client_flags(ls)
    bl = sub.add_parser("blocks", help="this tenant's keyed block tier: blocks, bytes, hits, "
                        "misses, evictions (--keys lists keys; rm KEY... removes keys, "
                        "rm --prefix P --yes every key starting with P)",
                        epilog="example: rpcbuf blocks --keys --prefix vllm@ --limit 20; "
                        "rpcbuf blocks rm k1 k2; rpcbuf blocks rm --prefix vllm@ --yes")
    bl.add_argument("action", nargs="?", choices=["rm"], metavar="rm",
                    help="remove the KEYs named, or with --prefix every key starting with it")
    bl.add_argument("rm_keys", nargs="*", metavar="KEY", help="keys to remove (with rm)")
    bl.add_argument("--keys", action="store_true", help="also list the keys (sorted)")
    bl.add_argument("--prefix", help="only keys starting with this (with rm and --yes: "
                    "remove them)")
    bl.add_argument("--yes", action="store_true",
                    help="rm --prefix: remove without asking (a flush of every key is "
                    "refused without it)")
    bl.add_argument("--limit", type=count_between(1, 4096), default=100,
                    help="keys to list, 1..4096 [100]")
    client_flags(bl)
    rl = sub.add_parser("release", help="release a buffer by id or by name, on whichever "
                        "node holds it (--prefix P --yes: every buffer whose name starts "
                        "with P; --all --yes: every buffer of this tenant)",
                        epilog="example: rpcbuf release b-XXXX   or   rpcbuf release weights"
                        "   or   rpcbuf release --prefix llama/ --yes")
    rl.add_argument("buffer", metavar="ID|NAME", nargs="?")
    rl.add_argument("--prefix", help="release every buffer whose name starts with this "
                    "(needs --yes)")
    rl.add_argument("--all", action="store_true",
                    help="release every buffer of this tenant, named or not (needs --yes)")
    rl.add_argument("--yes", action="store_true", help="--prefix/--all: release without asking")
    client_flags(rl)
    put = sub.add_parser("put", help="store a .npy file in a new buffer; prints its id",
                         epilog="example: rpcbuf put x.npy --name x --ttl 1h   "
                                "(without --name or --ttl the name is the file's stem)")
    put.add_argument("file", metavar="FILE.npy")
    put.add_argument("--name", help="buffer name [the file's stem, unless --ttl is given]")
    put.add_argument("--ttl", type=parse_duration, help="lease, e.g. 1h (default: no expiry)")
    client_flags(put)
    get = sub.add_parser("get", help="read a buffer stored by 'put', or one tensor of a "
                         "loaded model, into a .npy file (from whichever node holds it)",
                         epilog="example: rpcbuf get x   (writes ./x.npy; --out picks the "
                                "file, --force overwrites)   or   rpcbuf get tiny --tensor "
                                "model.norm.weight")
    get.add_argument("buffer", metavar="ID|NAME|MODEL")
    get.add_argument("--tensor", metavar="NAME",
                     help="the tensor to read: of this buffer, or of this loaded model "
                          "(in whichever of its slots holds it) [data, what put stores]")
    get.add_argument("-o", "--out", metavar="FILE.npy", help="where to write [./ID|NAME.npy]")
    get.add_argument("--force", action="store_true", help="overwrite FILE.npy if it exists")
    client_flags(get)
    bn = sub.add_parser("bench", help="quick store/read throughput and latency",
                        epilog="example: rpcbuf bench --sizes 4KiB,1MiB,16MiB --duration 3s")
    bn.add_argument("--sizes", default="4KiB,1MiB,16MiB",
                    type=_sizes, metavar="SIZES",
                    help="comma-separated payload sizes [4KiB,1MiB,16MiB]")
    bn.add_argument("--duration", type=parse_duration, default=3.0,
                    help="total time budget, split between sizes and store/read [3s]")
    client_flags(bn)


def _sizes(text: str) -> list[int]:
    try:
        return [parse_size(s) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


async def status(ctx: RpcContext) -> dict[str, Any]:
    path = {"path": "same-host" if ctx.same_host else "ucx"}
    if ctx.hello.get("same_host_why"):
        path["same_host_why"] = ctx.hello["same_host_why"]
    return {**await ctx.stats(), **path}


async def ls(ctx: RpcContext) -> list[dict[str, Any]]:
    now = time.time()
    out = []
    for b in await ctx.list_buffers():
        exp = b.get("expires_at")
        out.append({"buffer_id": b["buffer_id"], "name": b["name"], "size": b["size"],
                    "alloc_size": b.get("alloc_size", b["size"]),
                    "device": device_key(b["device_type"], b["device"]),
                    "ttl_left": None if exp is None else max(0.0, exp - now),
                    "tensors": b.get("tensor_count", 0) - b.get("reserved_count", 0),
                    "session_scoped": b.get("session_scoped", False)})
    return out


async def blocks(ctx: RpcContext, keys: bool, prefix: str | None,
                 limit: int) -> dict[str, Any]:
    """The tier's figures, and with ``keys`` up to ``limit`` of its keys."""
    out: dict[str, Any] = dict((await ctx.stats())["blocks"])
    if keys or prefix is not None:
        out["keys"], out["more"] = await ctx.list_blocks(prefix=prefix, limit=limit)
    return out


RM_BATCH = 4096  # keys one block_remove names (the protocol's MAX_BLOCK_KEYS)
RM_MOST = 1 << 20  # keys one `blocks rm --prefix` removes at most (then: run it again)


async def remove_blocks(ctx: RpcContext, keys: list[str], prefix: str | None) -> dict[str, Any]:
    """The keys named, or every key starting with ``prefix`` (a page at a time,
    at most ``RM_MOST``)."""
    removed = asked = 0
    if prefix is None:
        for i in range(0, len(keys), RM_BATCH):
            batch = keys[i:i + RM_BATCH]
            asked += len(batch)
            removed += await ctx.remove_blocks(batch)
        return {"removed": removed, "named": asked}
    more = True
    while more and asked < RM_MOST:
        page, more = await ctx.list_blocks(prefix=prefix, limit=RM_BATCH)
        if not page:
            break
        asked += len(page)
        removed += await ctx.remove_blocks(page)
    return {"removed": removed, "named": asked, "prefix": prefix, "more": more}


def blocks_tables(results: dict[str, Any], wide: bool = False) -> list[Any]:
    """One row of figures per node; the keys listed, if asked for."""
    rows, keys = [], []
    for addr, st in results.items():
        if isinstance(st, Exception):
            continue
        asked = st["hits"] + st["misses"]
        rate = "-" if not asked else f"{100 * st['hits'] / asked:.1f}%"
        rows.append([addr, str(st["blocks"]), format_size(st["bytes"]), str(st["hits"]),
                     str(st["misses"]), rate, str(st["puts"]), str(st["evictions"]),
                     str(st["expired"]), str(st["removed"])])
        keys += [[addr, k] for k in st.get("keys", ())]
        if st.get("more"):
            keys.append([addr, "... (more: --limit, --prefix)"])
    made = [tables.fit("rpcbuf blocks", [
        tables.Col("endpoint", key=True), tables.Col("blocks", right=True),
        tables.Col("bytes", right=True), tables.Col("hits", right=True),
        tables.Col("misses", right=True), tables.Col("hit rate", right=True, drop=4),
        tables.Col("puts", right=True, drop=3), tables.Col("evictions", right=True),
        tables.Col("expired", right=True, drop=2), tables.Col("removed", right=True, drop=1)],
        rows, wide=wide)]
    if keys:
        made.append(tables.fit("block keys", [tables.Col("endpoint", drop=1),
                                              tables.Col("key", key=True, wrap=True)],
                               keys, wide=wide))
    return made


async def release(ctx: RpcContext, found: Found) -> dict[str, Any]:
    await ctx.release_buffer(found.buffer_id)
    return {"released": found.buffer_id, "name": found.name}


async def release_many(ctx: RpcContext, prefix: str | None) -> dict[str, Any]:
    """Release this tenant's buffers whose name starts with ``prefix`` (None:
    all, unnamed too); one gone meanwhile is not counted."""
    released = []
    for b in await ctx.list_buffers():
        name = b.get("name")
        if prefix is not None and not (isinstance(name, str) and name.startswith(prefix)):
            continue
        try:
            await ctx.release_buffer(b["buffer_id"])
        except NotFound:
            continue
        released.append(name or b["buffer_id"])
    return {"released": len(released), "buffers": released}


def device_key(device_type: str, device: int) -> str:
    """``cpu:0``, ``cuda:1``: the daemon's pool key, whatever the meta's case."""
    kind = str(device_type).lower()
    return f"{ {'gpu': 'cuda'}.get(kind, kind)}:{device}"


def load_npy(path: str) -> np.ndarray:
    """The array in ``path``, memory-mapped.  Raises ValueError (exit 2) with a
    sentence a user can act on."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, not a .npy file") from None
    except PermissionError:
        raise ValueError(f"{path}: permission denied") from None
    except (ValueError, EOFError, OSError):  # not an array NumPy saved (pickles included)
        raise ValueError(f"{path}: not a .npy file (put stores one array saved with "
                         "numpy.save)") from None
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{path}: not a single .npy array (an .npz holds several: "
                         "save each with numpy.save)")
    return arr


async def put(ctx: RpcContext, arr: np.ndarray, name: str | None,
              ttl: float | None) -> dict[str, Any]:
    size = max(1, calculate_buffer_size({"data": arr}, headroom=0))
    buffer_id = await ctx.request_buffer(size, name=name, ttl=ttl)
    try:
        await ctx.store_tensors(buffer_id, {"data": arr}, verify="checksum")
    except BaseException:
        await asyncio.shield(ctx.release_buffer(buffer_id))
        raise
    meta = await ctx.get_buffer_meta(buffer_id)
    return {"buffer_id": buffer_id, "name": name, "bytes": int(arr.nbytes),
            "dtype": arr.dtype.str, "shape": list(arr.shape), "size": size,
            "alloc_size": int(meta["alloc_size"]),
            "device": device_key(meta["device_type"], meta["device"])}


def rounding(size: int, alloc_size: int, device: str) -> str | None:
    """A sentence when a buffer takes much more memory than it asked for
    (buddy blocks are powers of two)."""
    if alloc_size <= size * 1.25:
        return None
    return (f"{format_size(size)} takes a block of {format_size(alloc_size)} on {device} "
            "(the node's buddy allocator rounds each buffer up to a power of two; "
            "rpcbufd --allocator linear does not)")


def get_target(ref: str, out: str | None, force: bool, tensor: str | None = None) -> str:
    """``--out``, else ``./REF.npy`` (``./TENSOR.npy`` with ``--tensor``).
    ValueError (exit 2, before connecting) when it exists without ``force``."""
    path = out or f"{Path(tensor or ref).name}.npy"
    if not path.endswith(".npy"):
        path += ".npy"  # np.save would add it: say the real name
    if Path(path).exists() and not force:
        raise ValueError(f"{path} exists: pass --force to overwrite it, or --out another file")
    where = Path(path).parent
    if not where.is_dir():  # (said before connecting, and not as the hidden .part file)
        raise ValueError(f"{path}: no such directory {where}")
    return path


async def get(ctx: RpcContext, found: Found, out: str, progress: bool = False) -> dict[str, Any]:
    """Read one tensor of ``found`` into ``out``, big arrays in ``CHUNK`` pieces,
    then checked against the manifest's checksum.  Raises NOT_FOUND
    (``reason: no_such_tensor``)."""
    buffer_id, name = found.buffer_id, found.tensor or "data"
    meta = await ctx.get_buffer_meta(buffer_id)
    manifest = meta.get("tensors") or {}
    entry = manifest.get(name)
    if entry is None:
        raise NotFound(_no_tensor(found, len(manifest)),
                       {"reason": "no_such_tensor", "missing": [name]})
    if int(entry["nbytes"]) < CHUNK:
        arr = (await ctx.load_tensors(buffer_id, [name]))[name]
    else:
        arr = await _read_chunked(ctx, buffer_id, name, entry, progress)
    tmp = Path(out).with_name(f".{Path(out).name}.part")
    with open(tmp, "wb") as f:  # a whole file or none: written aside, then renamed
        np.save(f, arr, allow_pickle=False)
    tmp.replace(out)
    return {"buffer_id": buffer_id, "name": found.name, "tensor": name, "out": out,
            "bytes": int(arr.nbytes), "dtype": arr.dtype.str, "shape": list(arr.shape)}


def _no_tensor(found: Found, count: int) -> str:
    if found.tensor is not None:
        return f"{found.name!r} holds no tensor {found.tensor!r}"
    return (f"{found.name!r} holds {count} tensor(s) and none called 'data' (what put "
            "stores): name one with --tensor NAME (`rpcbuf get MODEL --tensor NAME` "
            "finds it on whichever node holds it)")


async def _read_chunked(ctx: RpcContext, buffer_id: str, name: str, entry: dict[str, Any],
                        progress: bool) -> np.ndarray:
    arr = np.empty(entry["shape"], dtype=np.dtype(entry["dtype"]))
    flat = arr.reshape(-1).view(np.uint8)
    total, base = int(entry["nbytes"]), int(entry["offset"])
    with _bar(total, progress, "get") as advance:
        for at in range(0, total, CHUNK):
            n = min(CHUNK, total - at)
            await ctx.read_buffer(buffer_id, base + at, n, out=flat[at:at + n])
            advance(n)
    want = entry.get("checksum")
    if want is not None and checksum(flat) != int(want):
        raise VerifyFailed("the array read back does not match its stored checksum",
                           {"tensors": [name]})
    return arr


@contextlib.contextmanager
def _bar(total: int, show: bool, what: str) -> Iterator[Callable[[int], None]]:
    """A byte progress bar on stderr while the block runs (only on a terminal)."""
    if not (show and sys.stderr.isatty()):
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn

    from rpcbuf.control.client.progress import byte_columns

    with Progress(TextColumn(what), BarColumn(), *byte_columns(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.update(task, advance=n)


async def bench(ctx: RpcContext, sizes: list[int], duration: float) -> list[dict[str, Any]]:
    """Per size: store and read one buffer over and over for its share of
    ``duration`` (at most 2000 times); MiB/s and p50/p99 latency."""
    share = max(0.05, duration / max(1, 2 * len(sizes)))
    rows = []
    for size in sizes:
        data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        out = np.empty_like(data)
        buffer_id = await ctx.request_buffer(size)
        try:
            row: dict[str, Any] = {"size": size}
            for kind in ("store", "read"):
                lat: list[float] = []
                end = time.perf_counter() + share
                while len(lat) < 2000 and (not lat or time.perf_counter() < end):
                    t0 = time.perf_counter()
                    if kind == "store":
                        await ctx.store_tensor(buffer_id, data)
                    else:
                        await ctx.read_buffer(buffer_id, out=out)
                    lat.append(time.perf_counter() - t0)
                total = sum(lat)
                row[f"{kind}_mib_s"] = size * len(lat) / total / (1 << 20) if total else 0.0
                row[f"{kind}_p50_ms"] = float(np.percentile(lat, 50)) * 1e3
                row[f"{kind}_p99_ms"] = float(np.percentile(lat, 99)) * 1e3
                row[f"{kind}_ops"] = len(lat)
            if not np.array_equal(out, data):
                raise ValueError("bench: read-back differs from what was stored")
            rows.append(row)
        finally:
            await asyncio.shield(ctx.release_buffer(buffer_id))
    return rows


# -- rendering -------------------------------------------------------------------------


def bar(used: int, total: int) -> Text:
    n = round(BAR * used / total) if total else 0
    return Text.assemble(("█" * n, "red"), ("░" * (BAR - n), "green"))


def _dur(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + f"{h:02d}:{m:02d}:{s:02d}"


def status_tables(results: dict[str, Any], wide: bool = False) -> list[Any]:
    """The nodes that answered: one table of nodes, one of their devices."""
    ok = {a: st for a, st in results.items() if not isinstance(st, Exception)}
    nodes = tables.fit("rpcbuf status", [
        tables.Col("endpoint", key=True), tables.Col("node", key=True),
        tables.Col("uptime", drop=3), tables.Col("sessions", right=True, drop=2),
        tables.Col("buffers", right=True), tables.Col("blocks", right=True, drop=2),
        tables.Col("stored", right=True, drop=1),
        tables.Col("read", right=True, drop=1), tables.Col("path")],
        [[a, str(st["node_id"]), _dur(st["uptime"]), str(st["sessions"]), str(st["buffers"]),
          str(st.get("blocks", {}).get("blocks", 0)), format_size(st.get("bytes_stored", 0)),
          format_size(st.get("bytes_read", 0)),
          str(st.get("path", ""))] for a, st in ok.items()], wide=wide)
    devs = tables.fit("devices", [
        tables.Col("endpoint", key=True), tables.Col("device", key=True),
        tables.Col("used", right=True), tables.Col("free", right=True),
        tables.Col("total", right=True), tables.Col("usage", drop=1)],
        [[a, str(d["key"]), format_size(d["used"]), format_size(d["free"]),
          format_size(d["total"]), bar(d["used"], d["total"])]
         for a, st in ok.items() for d in st["devices"]], wide=wide)
    return [nodes, devs]


def ls_table(results: dict[str, Any], wide: bool = False) -> Any:
    rows = []
    rounded = False  # a buffer whose block is larger than it: "takes" stays longer
    for addr, bufs in results.items():
        if isinstance(bufs, Exception):
            continue
        for b in bufs:
            ttl = "-" if b["ttl_left"] is None else tables.duration(b["ttl_left"])
            if b["session_scoped"]:
                ttl = "session"
            rows.append([addr, b["name"] or "-", b["buffer_id"], format_size(b["size"]),
                         format_size(b["alloc_size"]), b["device"], ttl, str(b["tensors"])])
            rounded = rounded or b["alloc_size"] > b["size"] * 1.01
    one_node = len(results) == 1  # then the endpoint column goes first
    # A column that tells rows apart stays: any lease (a buffer that expires
    # must not look permanent), more than one device; one that says the
    # same for every row goes first when the terminal is narrow.
    leases = any(r[6] != "-" for r in rows)
    devices = len({r[5] for r in rows}) > 1
    return tables.fit("rpcbuf buffers", [
        tables.Col("endpoint", key=not one_node, drop=1 if one_node else 0),
        tables.Col("name", key=True, wrap=True), tables.Col("id", key=True),
        tables.Col("size", right=True), tables.Col("takes", right=True, drop=4 if rounded else 1),
        tables.Col("device", drop=6 if devices else 2),
        tables.Col("ttl left", drop=0 if leases else 3),
        tables.Col("tensors", right=True, drop=5)],
        rows, wide=wide)


def bench_table(results: dict[str, Any], wide: bool = False) -> Any:
    several = len(results) > 1
    rows = [([a] if several else []) + [
        format_size(r["size"]), f"{r['store_mib_s']:.1f}", f"{r['store_p50_ms']:.3f}",
        f"{r['read_mib_s']:.1f}", f"{r['read_p50_ms']:.3f}", str(r["store_ops"] + r["read_ops"])]
        for a, rs in results.items() if not isinstance(rs, Exception) for r in rs]
    cols = ([tables.Col("endpoint", key=True)] if several else []) + [
        tables.Col("size", right=True), tables.Col("store MiB/s", right=True),
        tables.Col("store p50 ms", right=True, drop=2), tables.Col("read MiB/s", right=True),
        tables.Col("read p50 ms", right=True, drop=2), tables.Col("ops", right=True, drop=1)]
    return tables.fit("rpcbuf bench", cols, rows, wide=wide)


def default_name(path: str, name: str | None, ttl: float | None) -> str | None:
    """Without --name and --ttl the buffer would die with the CLI's session."""
    if name is None and ttl is None:
        return Path(path).stem
    return name
