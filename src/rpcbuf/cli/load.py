"""``rpcbuf load``, ``unload`` and ``hash``: flags parsed, a bad model file
refused before connecting (exit 2), results as a table or JSON, errors as
sentences per failing node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rpcbuf.cli import fleet, tables
from rpcbuf.cli.errors import EXIT_NODE, EXIT_OK, EXIT_USAGE, sentence, to_json
from rpcbuf.control.client.cluster import ClusterError
from rpcbuf.control.wire.errors import BadRequest, RpcBufError
from rpcbuf.control.wire.units import format_size, parse_size
from rpcbuf.models.hashfile import (
    HashedModel,
    describe,
    hash_model,
    manifest_path,
    write_manifest,
)
from rpcbuf.models.loader import (
    DEFAULT_BATCH,
    LoadResult,
    load_model,
    unload_model,
)
from rpcbuf.models.modelfile import ModelFile, open_model
from rpcbuf.models.nodeload import NODE_BATCH, NodeLoadResult, load_from_node


def register_load_commands(sub: Any, client_flags: Callable[[argparse.ArgumentParser], None]
                           ) -> None:
    ld = sub.add_parser("load", help="upload a safetensors/GGUF model across the nodes",
                        epilog='example: rpcbuf load llama.gguf --endpoints "h1:7700;h2:7700" '
                               '--placement "0:prolog,16;1:all,epilog"')
    ld.add_argument("model", help="a .gguf or .safetensors file, or a directory of shards")
    ld.add_argument("--placement", metavar="SPEC",
                    help='which slot gets what, e.g. "0:prolog,epilog;1:20;2:all" (slot i = '
                         "the i-th device of the endpoint list); default: by free memory")
    ld.add_argument("--name", help="model name; buffers are NAME/slotN [the file's stem]")
    ld.add_argument("--batch-size", type=parse_size, metavar="SIZE",
                    help="the most bytes read and sent per round trip [256MiB, the first "
                         "16MiB; with --from-node, read by a node per request: 256MiB]")
    ld.add_argument("--no-dedup", action="store_true",
                    help="send every tensor, even those the node already holds")
    ld.add_argument("--no-hash-cache", action="store_true",
                    help="hash every tensor, even of an unchanged file whose hashes are "
                         "remembered in $RPCBUF_CACHE_DIR (~/.cache/rpcbuf)")
    ld.add_argument("--from-node", metavar="PATH",
                    help="every node reads its share from its own copy at PATH (relative "
                         "to, or inside, its --model-dir) and verifies it; nothing is sent. "
                         "MODEL may then be the model's hash manifest (rpcbuf hash)")
    client_flags(ld)
    hs = sub.add_parser("hash", help="write a model's hash manifest beside it, so that "
                        "load --from-node reads no tensor here",
                        epilog="example: rpcbuf hash /srv/models/llama.safetensors   "
                               "(writes llama.safetensors.rpcbuf-hashes.json)")
    hs.add_argument("model", help="a .gguf or .safetensors file, or a directory of shards")
    hs.add_argument("--output", metavar="FILE",
                    help="write the manifest here [beside the model]")
    hs.add_argument("--no-hash-cache", action="store_true",
                    help="hash every tensor, even those remembered in $RPCBUF_CACHE_DIR")
    hs.add_argument("--json", action="store_true", help="print JSON for scripts")
    ul = sub.add_parser("unload", help="release a loaded model on every node",
                        epilog='example: rpcbuf unload llama --endpoints "h1:7700;h2:7700"')
    ul.add_argument("name")
    client_flags(ul)


def run_load_command(args: argparse.Namespace, endpoints: str | list[str], token: str) -> int:
    """0 ok, 1 an error at a node, 2 bad usage or input.  ``endpoints``: a list
    or a registry URL."""
    where = endpoints if isinstance(endpoints, str) else ";".join(endpoints)
    try:
        return asyncio.run(_run(args, endpoints, token))
    except KeyboardInterrupt:  # before _run's own handlers were in place
        return _interrupted(args, "SIGINT", EXIT_SIGINT)
    except BadRequest as exc:  # the model file, the placement: local problems
        _say(args, {"error": to_json(where, exc)}, f"rpcbuf: {exc.message}")
        return EXIT_USAGE
    except ClusterError as exc:
        # One sentence per failing node (the message repeats each node's raw
        # error, "[Errno 111] Connect call failed", for the API's users).
        what = exc.details.get("what")
        head = f"{what} failed on {len(exc.errors)} node(s):" if what else exc.message
        lines = [f"rpcbuf: {head}"] + \
            [f"rpcbuf: {sentence(a, e)}" for a, e in exc.errors.items()]
        _say(args, {"error": exc.to_wire(),
                    "nodes": {a: to_json(a, e) for a, e in exc.errors.items()}},
             "\n".join(lines))
        return EXIT_NODE
    except RpcBufError as exc:
        _say(args, {"error": to_json(where, exc)}, f"rpcbuf: {sentence(where, exc)}")
        return EXIT_NODE


EXIT_SIGINT, EXIT_SIGTERM = 128 + signal.SIGINT, 128 + signal.SIGTERM


def _interrupted(args: argparse.Namespace, sig: str, code: int) -> int:
    """One line, no traceback: an unfinished load released what it made."""
    what = "the load did not finish and what it made was released" if args.cmd == "load" \
        else "it may have released part of the model"
    _say(args, {"error": {"code": "INTERRUPTED", "signal": sig, "message": what}},
         f"rpcbuf: interrupted by {sig}: {what}")
    return code


def run_hash_command(args: argparse.Namespace) -> int:
    """``rpcbuf hash``: 0 written, 2 not a model (or the manifest cannot be written)."""
    t0 = time.perf_counter()
    try:
        model = open_model(args.model)
        try:
            hm = hash_model(model, not args.no_hash_cache)
        finally:
            model.close()
        out = Path(args.output) if args.output else manifest_path(args.model)
        write_manifest(hm, out)
    except BadRequest as exc:
        _say(args, {"error": to_json(args.model, exc)}, f"rpcbuf: {exc.message}")
        return EXIT_USAGE
    n = sum(len(f.tensors) for f in hm.files)
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"manifest": str(out), "model": str(args.model), "tensors": n,
                          "bytes": hm.nbytes, "bytes_hashed": hm.hashed,
                          "seconds": round(seconds, 4)}, indent=2))
    else:
        print(f"{out}: {n} tensors, {format_size(hm.nbytes)} (hashed "
              f"{format_size(hm.hashed)} in {seconds:.2f} s)")
    return EXIT_OK


def _say(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    if args.json:
        print(json.dumps(obj, indent=2, default=str))
    else:
        tables.warn(text)


async def _run(args: argparse.Namespace, endpoints: str | list[str], token: str) -> int:
    # SIGINT and SIGTERM cancel the command once, so a load's cleanup runs
    # (``commit.abort``) instead of the process dying with its buffers
    # half-filled on the nodes.  A second signal does not cut the cleanup
    # short (it is bounded: ``commit.settle``); asyncio.run's own SIGINT
    # handler raised KeyboardInterrupt out of the loop on a second Ctrl-C.
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    got: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        if not got:
            got.append(sig)
            task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await _run_command(args, endpoints, token)
    except asyncio.CancelledError:
        if not got:
            raise
        return _interrupted(args, got[0].name, 128 + got[0])
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
            if got:  # interrupted: the process is on its way out with its code
                signal.signal(sig, signal.SIG_IGN)


async def _run_command(args: argparse.Namespace, endpoints: str | list[str], token: str
                       ) -> int:
    # A bad model file is refused before any connection: no node needs to be
    # up to learn that (and none is bothered).
    if args.cmd == "load" and args.from_node:
        hashed = await asyncio.to_thread(describe, args.model, not args.no_hash_cache)
        return await _run_connected(args, endpoints, token, hashed)
    model = await asyncio.to_thread(open_model, args.model) if args.cmd == "load" else None
    try:
        return await _run_connected(args, endpoints, token, model)
    finally:
        if model is not None:
            model.close()


async def _run_connected(args: argparse.Namespace, endpoints: str | list[str], token: str,
                         model: ModelFile | HashedModel | None) -> int:
    # By free memory from a registry: its figures choose the nodes before
    # any is connected (slots then number those nodes' devices).
    need = model.nbytes if model is not None and not args.placement else None
    async with fleet.cluster(args, endpoints, token, partial=False, need=need) as cluster:
        for why in cluster.warnings:
            tables.warn(f"rpcbuf: warning: {why}")
        if args.cmd == "unload":
            got = await unload_model(cluster, args.name)
            if args.json:
                print(json.dumps({"name": args.name, "released": got}, indent=2))
            else:
                for addr, names in got.items():
                    print(tables.clean(f"{addr}: released {', '.join(names) or 'nothing'}"))
            return EXIT_OK
        assert model is not None
        result: LoadResult
        if isinstance(model, HashedModel):
            result = await load_from_node(cluster, model, args.from_node, args.placement,
                                          args.name, progress=not args.json,
                                          batch_bytes=_or(args.batch_size, NODE_BATCH))
        else:
            result = await load_model(cluster, model, args.placement, args.name,
                                      progress=not args.json,
                                      batch_bytes=_or(args.batch_size, DEFAULT_BATCH),
                                      dedup=not args.no_dedup,
                                      hash_cache=not args.no_hash_cache)
        takes = None if args.json else await _takes(cluster, result)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        tables.console(args.wide).print(result_table(result, args.wide, takes))
    return EXIT_OK


async def _takes(cluster: Any, r: LoadResult) -> dict[str, int]:
    """The memory each node's load buffers take (buddy blocks, rounded up); none
    for a node that does not answer."""
    async def one(addr: str, names: list[str]) -> int:
        mine = set(names)
        return sum(int(b["alloc_size"]) for b in await cluster[addr].list_buffers()
                   if b.get("name") in mine)

    addrs = [a for a, n in r.nodes.items() if n.tensors]
    got = await asyncio.gather(*(one(a, r.nodes[a].buffers) for a in addrs),
                               return_exceptions=True)
    return {a: g for a, g in zip(addrs, got, strict=True) if isinstance(g, int)}


def result_table(r: LoadResult, wide: bool = False, takes: dict[str, int] | None = None
                 ) -> Any:
    takes = takes or {}
    taken = [tables.Col("takes", right=True, drop=5)] if takes else []

    def took(addr: str) -> list[str]:
        return [format_size(takes[addr]) if addr in takes else "-"] if takes else []

    if isinstance(r, NodeLoadResult):
        return _node_table(r, wide, taken, took)
    rows = [[addr, _names(r, n.buffers), str(n.tensors), format_size(n.bytes_total),
             *took(addr), format_size(n.bytes_sent), format_size(n.bytes_placed),
             f"{n.seconds:.2f}"] for addr, n in r.nodes.items() if n.tensors]
    return tables.fit(
        f"{r.name}: {format_size(r.bytes_total)} in {r.seconds:.2f} s "
        f"(placement {r.placement.spec})",
        [tables.Col("node", key=True), tables.Col("buffers", key=True, wrap=True),
         tables.Col("tensors", right=True, drop=2), tables.Col("bytes", right=True), *taken,
         tables.Col("sent", right=True, drop=3), tables.Col("deduped", right=True, drop=1),
         tables.Col("seconds", right=True, drop=4)], rows, wide=wide)


def _names(r: LoadResult, names: list[str]) -> str:
    """A node's buffers, clones (a re-load under a new name) marked so."""
    cloned = {b["name"] for b in r.buffers if b.get("cloned")}
    return ", ".join(f"{n} (clone)" if n in cloned else n for n in names)


def _node_table(r: NodeLoadResult, wide: bool, taken: list[Any],
                took: Callable[[str], list[str]]) -> Any:
    rows = [[addr, _names(r, n.buffers), str(n.tensors), format_size(n.bytes_total),
             *took(addr), format_size(getattr(n, "bytes_read", 0)),
             format_size(getattr(n, "bytes_in_place", 0)), f"{n.seconds:.2f}"]
            for addr, n in r.nodes.items() if n.tensors]
    hashes = {"manifest": "hash manifest", "cache": "hash cache",
              "hashed": f"hashed {format_size(r.bytes_hashed)} here"}[r.hashes]
    return tables.fit(
        f"{r.name}: {format_size(r.bytes_total)} in {r.seconds:.2f} s, read by the nodes "
        f"from their {r.node_path}, nothing sent ({hashes}; placement {r.placement.spec})",
        [tables.Col("node", key=True), tables.Col("buffers", key=True, wrap=True),
         tables.Col("tensors", right=True, drop=3), tables.Col("bytes", right=True), *taken,
         tables.Col("read there", right=True), tables.Col("in place", right=True, drop=2),
         tables.Col("seconds", right=True, drop=4)], rows, wide=wide)



def _or(given: int | None, default: int) -> int:
    return default if given is None else given
