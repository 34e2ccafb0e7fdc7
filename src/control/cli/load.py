"""``rpcbuf load`` and ``rpcbuf unload``: a model across the nodes, from the
command line.  The work is ``client.model.loader`` (``load_model``,
``unload_model``); this module parses the flags, refuses a bad model file
before connecting (exit 2), and prints the result as a table that fits the
terminal (``cli/tables.py``) or JSON, and errors as sentences, one per
failing node (``cli/errors.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any

from control.cli import fleet, tables
from control.cli.errors import EXIT_NODE, EXIT_OK, EXIT_USAGE, sentence, to_json
from control.client.cluster import Cluster, ClusterError
from control.client.model.loader import (
    DEFAULT_BATCH,
    LoadResult,
    load_model,
    unload_model,
)
from control.client.model.modelfile import ModelFile, open_model
from control.wire.errors import BadRequest, RpcBufError
from control.wire.units import format_size, parse_size


def register_load_commands(sub: Any, client_flags: Callable[[argparse.ArgumentParser], None]
                           ) -> None:
    """Add ``load`` and ``unload`` to the ``rpcbuf`` parser."""
    ld = sub.add_parser("load", help="upload a safetensors/GGUF model across the nodes",
                        epilog='example: rpcbuf load llama.gguf --endpoints "h1:7700;h2:7700" '
                               '--placement "0:prolog,16;1:all,epilog"')
    ld.add_argument("model", help="a .gguf or .safetensors file, or a directory of shards")
    ld.add_argument("--placement", metavar="SPEC",
                    help='which slot gets what, e.g. "0:prolog,epilog;1:20;2:all" (slot i = '
                         "the i-th device of the endpoint list); default: by free memory")
    ld.add_argument("--name", help="model name; buffers are NAME/slotN [the file's stem]")
    ld.add_argument("--batch-size", type=parse_size, default=DEFAULT_BATCH, metavar="SIZE",
                    help="bytes read and sent per round trip [64MiB]")
    ld.add_argument("--no-dedup", action="store_true",
                    help="send every tensor, even those the node already holds")
    ld.add_argument("--no-hash-cache", action="store_true",
                    help="hash every tensor, even of an unchanged file whose hashes are "
                         "remembered in $RPCBUF_CACHE_DIR (~/.cache/rpcbuf)")
    client_flags(ld)
    ul = sub.add_parser("unload", help="release a loaded model on every node",
                        epilog='example: rpcbuf unload llama --endpoints "h1:7700;h2:7700"')
    ul.add_argument("name")
    client_flags(ul)


def run_load_command(args: argparse.Namespace, endpoints: str | list[str], token: str) -> int:
    """Run ``load``/``unload``: 0 ok, 1 an error at a node, 2 bad usage or input.
    ``endpoints``: a list, or a registry's etcd:// URL (the live nodes)."""
    where = endpoints if isinstance(endpoints, str) else ";".join(endpoints)
    try:
        return asyncio.run(_run(args, endpoints, token))
    except BadRequest as exc:  # the model file, the placement: local problems
        _say(args, {"error": to_json(where, exc)}, f"rpcbuf: {exc.message}")
        return EXIT_USAGE
    except ClusterError as exc:
        lines = [f"rpcbuf: {exc.message}"] + \
            [f"rpcbuf: {sentence(a, e)}" for a, e in exc.errors.items()]
        _say(args, {"error": exc.to_wire(),
                    "nodes": {a: to_json(a, e) for a, e in exc.errors.items()}},
             "\n".join(lines))
        return EXIT_NODE
    except RpcBufError as exc:
        _say(args, {"error": to_json(where, exc)}, f"rpcbuf: {sentence(where, exc)}")
        return EXIT_NODE


def _say(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    if args.json:
        print(json.dumps(obj, indent=2, default=str))
    else:
        print(text, file=sys.stderr)


async def _run(args: argparse.Namespace, endpoints: str | list[str], token: str) -> int:
    # A bad model file is refused before any connection: no node needs to be
    # up to learn that (and none is bothered).
    model = await asyncio.to_thread(open_model, args.model) if args.cmd == "load" else None
    try:
        return await _run_connected(args, endpoints, token, model)
    finally:
        if model is not None:
            model.close()


async def _run_connected(args: argparse.Namespace, endpoints: str | list[str], token: str,
                         model: ModelFile | None) -> int:
    kw = fleet.connect_kw(args)
    if kw and model is not None and not args.placement:
        # By free memory from a registry: its figures choose the nodes before
        # any is connected (slots then number those nodes' devices).
        kw["need"] = model.nbytes
    async with Cluster.connect(endpoints, token, timeout=args.timeout, **kw) as cluster:
        for why in cluster.warnings:
            print(f"rpcbuf: warning: {why}", file=sys.stderr)
        if args.cmd == "unload":
            got = await unload_model(cluster, args.name)
            if args.json:
                print(json.dumps({"name": args.name, "released": got}, indent=2))
            else:
                for addr, names in got.items():
                    print(f"{addr}: released {', '.join(names) or 'nothing'}")
            return EXIT_OK
        assert model is not None
        result = await load_model(cluster, model, args.placement, args.name,
                                  progress=not args.json, batch_bytes=args.batch_size,
                                  dedup=not args.no_dedup,
                                  hash_cache=not args.no_hash_cache)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        tables.console(args.wide).print(result_table(result, args.wide))
    return EXIT_OK


def result_table(r: LoadResult, wide: bool = False) -> Any:
    """Per node: its buffers, tensors, bytes, what was sent and deduplicated."""
    rows = [[addr, ", ".join(n.buffers), str(n.tensors), format_size(n.bytes_total),
             format_size(n.bytes_sent), format_size(n.bytes_placed), f"{n.seconds:.2f}"]
            for addr, n in r.nodes.items() if n.tensors]
    return tables.fit(
        f"{r.name}: {format_size(r.bytes_total)} in {r.seconds:.2f} s "
        f"(placement {r.placement.spec})",
        [tables.Col("node", key=True), tables.Col("buffers", key=True, wrap=True),
         tables.Col("tensors", right=True, drop=3), tables.Col("bytes", right=True),
         tables.Col("sent", right=True, drop=2), tables.Col("deduped", right=True, drop=1),
         tables.Col("seconds", right=True, drop=4)], rows, wide=wide)
