"""``rpcbuf``: the command-line client.  Exit 0 success; 1 an error at a node (for a
command over several: at least one failed, the table shows the others); 2 bad
usage or a local problem.  Every error is one sentence per failing node on
stderr, never a traceback; ``--json`` carries the same as objects.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rpcbuf.cli import commands as cliops, fleet, locate, tables
from rpcbuf.cli.commands import register_operator_commands
from rpcbuf.cli.errors import (
    EXIT_NODE,
    EXIT_OK,
    EXIT_USAGE,
    positive_seconds,
    report,
    sentence,
    to_json,
)
from rpcbuf.cli.load import register_load_commands, run_hash_command, run_load_command
from rpcbuf.control.flagparse import Parser
from rpcbuf.control.formats.keyfile import load_keys
from rpcbuf.control.wire.auth import DEFAULT_KID, Keyring, create_token
from rpcbuf.control.wire.errors import RpcBufError
from rpcbuf.control.wire.membership import DEFAULT_CLUSTER, RecordError, check_name, check_node_id
from rpcbuf.control.wire.units import format_size, parse_duration
from rpcbuf.control.wire.version import describe

DEFAULT_TOKEN_TTL = 24 * 3600.0  # a token lives a day unless asked otherwise


class UsageError(ValueError):
    """Bad usage found after parsing (no token): exit 2."""


def _token_ttl(text: str) -> float | None:
    """``--ttl``: a positive duration, or "never" (None: no expiry)."""
    if text.strip().lower() == "never":
        return None
    try:
        ttl = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or never") from None
    if ttl <= 0:
        raise argparse.ArgumentTypeError(f"--ttl {text!r} must be positive (or never)")
    return ttl


def _names(text: str, check: Callable[[str, str], str] = check_name) -> list[str]:
    """``--cluster`` of ``token create``: NAME[,NAME...]."""
    names = [n.strip() for n in text.split(",")]
    try:
        return [check("name", n) for n in names]
    except RecordError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _node_ids(text: str) -> list[str]:
    """``--node`` of ``token create``: ID[,ID...] (a default id is ``host:port``)."""
    return _names(text, check_node_id)


def _endpoints(args: argparse.Namespace) -> list[str]:
    text = args.endpoints or args.endpoint or os.environ.get("RPCBUF_ENDPOINTS") or "127.0.0.1:7700"
    from rpcbuf.control.client.opening import with_port

    # ``HOST`` as ``HOST:7700``: what tables and errors show is the port tried
    return [with_port(e.strip()) for e in text.replace(",", ";").split(";") if e.strip()]


def _target(args: argparse.Namespace) -> str | list[str]:
    """The registry URL (``--registry``, an etcd:// endpoint, or
    ``$RPCBUF_REGISTRY``), else the endpoint list."""
    return fleet.registry_url(args) or _endpoints(args)


def _one_endpoint(args: argparse.Namespace) -> str:
    if fleet.registry_url(args) is not None:
        raise UsageError(f"rpcbuf {args.cmd} talks to one node: give it --endpoint HOST:PORT "
                         "(rpcbuf nodes lists the registry's)")
    return _endpoints(args)[0]


def _token(args: argparse.Namespace) -> str:
    token = args.token or os.environ.get("RPCBUF_TOKEN")
    if not token:
        raise UsageError("no token: pass --token or set RPCBUF_TOKEN "
                         "(make one with 'rpcbuf token create')")
    return str(token)


def _keys(path: str, create: bool, kid: str) -> Keyring:
    """``token create``'s keys: a missing file is an error (a typo minted a key
    every node refused) unless ``--create``, in a directory that exists."""
    where = Path(path)
    if not where.exists():
        if not create:
            raise UsageError(f"--secret-file {path}: no such file: give the file the daemons "
                             "use (rpcbufd makes it at its first start), or --create to "
                             "make a new key")
        if not where.parent.is_dir():
            raise UsageError(f"--secret-file {path}: no such directory "
                             f"{where.parent}: --create makes the file, not its directory")
    return load_keys(where, create=create, kid=kid)


def _client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", help="daemon HOST:PORT (else $RPCBUF_ENDPOINTS, 127.0.0.1:7700)")
    p.add_argument("--endpoints", help='several daemons: "h1:7700;h2:7700"')
    p.add_argument("--token", help="auth token (else $RPCBUF_TOKEN)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--timeout", type=positive_seconds, default=10.0, help="seconds per daemon [10]")
    p.add_argument("--wide", action="store_true",
                   help="every table column, however wide the terminal")
    fleet.node_tls_flags(p)
    fleet.registry_flags(p)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="rpcbuf", description="rpcbuf command-line client.",
                                epilog="exit codes: 0 ok, 1 an error at a node (the others' "
                                       "results are still shown), 2 usage or a local problem")
    p.add_argument("--version", action="version", version=describe("rpcbuf"))
    # Not required: a bare ``rpcbuf`` (or ``rpcbuf token``) prints its help
    # instead of argparse's "required: cmd", which names an internal dest.
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    tok = sub.add_parser("token", help="manage auth tokens").add_subparsers(dest="tcmd",
                                                                           metavar="COMMAND")
    tc = tok.add_parser("create", help="print a token (a JWT, HS256) for a tenant",
                        epilog="example: rpcbuf token create --secret-file /etc/rpcbuf/secret "
                               "--tenant alice --ttl 7d")
    tc.add_argument("--secret-file", required=True,
                    help="the node's keys, one 'KEY_ID SECRET' a line: the file the daemons "
                         "use (rpcbufd makes it at its first start)")
    tc.add_argument("--create", action="store_true",
                    help="make the secret file (0600, one new key) if it is missing; its "
                         "directory must exist")
    tc.add_argument("--tenant", required=True)
    tc.add_argument("--ttl", type=_token_ttl, default=DEFAULT_TOKEN_TTL,
                    help="lifetime, e.g. 1h or 30d, or 'never' for a token that never "
                         "expires [24h]")
    tc.add_argument("--kid", help="sign with this key of the secret file (the one created, if "
                    "the file is missing) [the file's last key]")
    tc.add_argument("--cluster", type=_names, default=[DEFAULT_CLUSTER], metavar="NAME[,NAME]",
                    help="the token's audience: good on any node of these clusters (each "
                         "daemon's --cluster), refused on every other [default]")
    tc.add_argument("--node", type=_node_ids, default=[], metavar="ID[,ID]",
                    help="narrow the audience to these node ids (each daemon's --node-id) of "
                         "those clusters [any node]")

    dv = sub.add_parser("devices", help="list every node's devices and free memory",
                        epilog='example: rpcbuf devices --endpoints "10.0.0.5:7700;10.0.0.6:7700"')
    _client_flags(dv)
    dr = sub.add_parser("doctor", help="check each node step by step: reachable, token, "
                        "data path, round trips, memory, clock",
                        epilog="example: rpcbuf doctor --endpoint 127.0.0.1:7700   "
                               "(exit 0 when no check failed)")
    _client_flags(dr)
    register_operator_commands(sub, _client_flags)
    register_load_commands(sub, _client_flags)
    fleet.register_fleet_commands(sub)
    md = sub.add_parser("models", help="this tenant's loaded models across the nodes: slots, "
                        "nodes, bytes, tensors, source types, complete or not",
                        epilog="example: rpcbuf models --registry etcd://10.0.0.1:2379")
    _client_flags(md)
    return p


async def _per_node(args: argparse.Namespace, fn: Any) -> dict[str, Any]:
    """``{endpoint: result or error}`` of ``fn(ctx)`` on every node."""
    async with _cluster(args) as cluster:
        return await cluster.each(fn)


async def _devices(args: argparse.Namespace) -> int:
    """Every node's devices in one table (placement's slot numbers) or JSON;
    exit 1 if any node failed."""
    async with _cluster(args) as cluster:
        got = await cluster.devices_by_node()
    failed = any(isinstance(r, RpcBufError) for r in got.values())
    if args.json:
        _print_json(got)
        return EXIT_NODE if failed else EXIT_OK
    cols = [tables.Col("slot", right=True), tables.Col("endpoint", key=True),
            tables.Col("node", key=True), tables.Col("device", key=True),
            tables.Col("allocator", drop=1), tables.Col("total", right=True, drop=2),
            tables.Col("free", right=True), tables.Col("largest free", right=True)]
    rows = [[str(d["slot"]) if not failed else "-", addr, str(d["node_id"]), str(d["key"]),
             str(d.get("allocator", "")), format_size(d["total"]), format_size(d["free"]),
             format_size(d["largest_free"])]
            for addr, res in got.items() if not isinstance(res, RpcBufError) for d in res]
    if rows:
        tables.console(args.wide).print(tables.fit("rpcbuf devices", cols, rows, wide=args.wide))
    _print_errors(got)
    if failed and rows:
        tables.warn("rpcbuf: slot numbers (for --placement) need every node: none are shown")
    return EXIT_NODE if failed else EXIT_OK


def _doctor(args: argparse.Namespace) -> int:
    from rpcbuf.cli import doctor

    if fleet.registry_url(args) is not None:
        raise UsageError("rpcbuf doctor checks an endpoint list: give it --endpoint(s) "
                         "(rpcbuf nodes lists the registry's)")
    # No token: the checks that need none still run (reachable, TLS, UCX
    # here), and the token's is the one that fails.
    token = args.token or os.environ.get("RPCBUF_TOKEN") or None
    results = asyncio.run(doctor.doctor(_endpoints(args), token, args.timeout,
                                        fleet.dial_kw(args)))
    if args.json:
        print(json.dumps(doctor.as_json(results), indent=2, default=str))
    else:
        print("\n".join(doctor.render(results)))
    return EXIT_NODE if doctor.failed(results) else EXIT_OK


def _print_errors(results: dict[str, Any]) -> None:
    for addr, res in results.items():
        if isinstance(res, RpcBufError):
            tables.warn(f"rpcbuf: {sentence(addr, res)}")


def _print_json(results: dict[str, Any]) -> None:
    print(json.dumps({a: (to_json(a, r) if isinstance(r, RpcBufError) else r)
                      for a, r in results.items()}, indent=2, default=str))


def _node_command(args: argparse.Namespace) -> int:
    """status / ls / blocks on every endpoint: exit 1 if any node failed."""
    fns = {"status": cliops.status, "ls": cliops.ls,
           "blocks": lambda c: cliops.blocks(c, args.keys, args.prefix, args.limit)}
    results = asyncio.run(_per_node(args, fns[args.cmd]))
    failed = any(isinstance(r, RpcBufError) for r in results.values())
    if args.json:
        _print_json(results)
    else:
        console = tables.console(args.wide)
        if args.cmd == "status":
            made = cliops.status_tables(results, args.wide)
        elif args.cmd == "blocks":
            made = cliops.blocks_tables(results, args.wide)
        else:
            made = [cliops.ls_table(results, args.wide)]
        for table in made:
            if table.row_count:
                console.print(table)
        answered = [a for a, r in results.items() if not isinstance(r, RpcBufError)]
        if args.cmd == "ls" and answered and not any(t.row_count for t in made):
            # (as `models` says it: nothing printed read as nothing asked)
            print(f"no buffers for this tenant on {', '.join(answered)}")
    if not args.json:
        _print_errors(results)
    return EXIT_NODE if failed else EXIT_OK


def _blocks_rm(args: argparse.Namespace) -> int:
    """``rpcbuf blocks rm KEY...`` or ``rm --prefix P --yes`` on every node."""
    if bool(args.rm_keys) == (args.prefix is not None):
        raise UsageError("rpcbuf blocks rm: name the KEYs to remove, or --prefix P "
                         "(every key starting with P), not both")
    if args.prefix is not None and not args.yes:
        every = "every key of this tenant" if args.prefix == "" else \
            f"every key starting with {args.prefix!r}"
        raise UsageError(f"rpcbuf blocks rm --prefix removes {every} on every node: "
                         "add --yes to do it")
    results = asyncio.run(_per_node(
        args, lambda c: cliops.remove_blocks(c, args.rm_keys, args.prefix)))
    lines = []
    for addr, r in results.items():
        if isinstance(r, RpcBufError):
            continue
        what = f"{r['removed']} of {r['named']} keys named" if args.prefix is None else \
            f"{r['removed']} keys starting with {r['prefix']!r}" + (
                " (more left: run it again)" if r["more"] else "")
        lines.append(f"{addr}: removed {what}")
    return _finish(args, results, lines)


def _cluster(args: argparse.Namespace) -> Any:
    """Every node this command names (``_target``), those that answer."""
    return fleet.cluster(args, _target(args), _token(args))


def _finish(args: argparse.Namespace, results: dict[str, Any], lines: list[str]) -> int:
    """Print a multi-node result and each failing node's sentence; exit 1 if
    any failed.  Found nowhere (``"*"``): the whole command's error."""
    if list(results) == ["*"]:
        return report(";".join(_endpoints(args)), results["*"], args.json)
    if args.json:
        _print_json(results)
    else:
        for line in lines:  # node answers in them: cleaned
            print(tables.clean(line))
        _print_errors(results)
    return EXIT_NODE if any(isinstance(r, RpcBufError) for r in results.values()) else EXIT_OK


def _release_many(args: argparse.Namespace) -> int:
    """``rpcbuf release --prefix P --yes`` / ``--all --yes`` on every node."""
    if args.buffer is not None or (args.prefix is not None) == args.all:
        raise UsageError("rpcbuf release: name one buffer (ID|NAME), or --prefix P, or --all")
    if not args.yes:
        every = "every buffer of this tenant" if args.all else \
            f"every buffer whose name starts with {args.prefix!r}"
        raise UsageError(f"rpcbuf release would release {every} on every node: add --yes "
                         "to do it (`rpcbuf ls` lists them)")
    results = asyncio.run(_per_node(args, lambda c: cliops.release_many(
        c, None if args.all else args.prefix)))
    return _finish(args, results, [f"{a}: released {r['released']} buffer(s)"
                                   for a, r in results.items() if not isinstance(r, Exception)])


async def _release(args: argparse.Namespace) -> int:
    async with _cluster(args) as cluster:
        found, errors = await locate.find(cluster, args.buffer)
        results: dict[str, Any] = dict(errors)
        for addr, where in found.items():
            try:
                results[addr] = await cliops.release(cluster[addr], where)
            except RpcBufError as exc:
                results[addr] = exc
    return _finish(args, results, [f"{a}: released {r['released']} ({r['name']})"
                                   for a, r in results.items() if not isinstance(r, Exception)])


async def _get(args: argparse.Namespace) -> int:
    out = cliops.get_target(args.buffer, args.out, args.force, args.tensor)  # before connecting
    async with _cluster(args) as cluster:
        found, errors = await locate.find(cluster, args.buffer, args.tensor)
        results: dict[str, Any] = dict(errors)
        if found:
            addr, where = locate.one(args.buffer, found)  # BAD_REQUEST: on several nodes
            try:
                results[addr] = await cliops.get(cluster[addr], where, out,
                                                 progress=not args.json)
            except RpcBufError as exc:
                results[addr] = exc
    return _finish(args, results, [
        f"{a}: wrote {r['out']}: {r['dtype']} {tuple(r['shape'])} from {r['name']}"
        + (f" ({r['tensor']})" if args.tensor else "")
        for a, r in results.items() if not isinstance(r, Exception)])


async def _bench(args: argparse.Namespace) -> int:
    """One node at a time: they would share this host's links and cores."""
    async with _cluster(args) as cluster:
        results: dict[str, Any] = dict(cluster.errors)
        for addr in cluster.endpoints:
            try:
                results[addr] = await cliops.bench(cluster[addr], args.sizes, args.duration)
            except RpcBufError as exc:
                results[addr] = exc
    if args.json:
        _print_json(results)
    else:
        tables.console(args.wide).print(cliops.bench_table(results, args.wide))
        _print_errors(results)
    return EXIT_NODE if any(isinstance(r, RpcBufError) for r in results.values()) else EXIT_OK


async def _put(args: argparse.Namespace) -> int:
    """A .npy file into a new buffer on the first endpoint (said when several)."""
    from rpcbuf.control.client.connect import connect

    arr = cliops.load_npy(args.file)  # a missing or bad file: exit 2 before connecting
    name = cliops.default_name(args.file, args.name, args.ttl)
    endpoints = _endpoints(args)
    addr = _one_endpoint(args)
    try:
        async with connect(addr, _token(args), timeout=args.timeout,
                           **fleet.dial_kw(args)) as ctx:
            result = {**await cliops.put(ctx, arr, name, args.ttl), "endpoint": addr}
    except RpcBufError as exc:
        return report(addr, exc, args.json)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return EXIT_OK
    print(tables.clean(result["buffer_id"]))
    said = cliops.rounding(result["size"], result["alloc_size"], result["device"])
    if said:
        tables.warn(f"rpcbuf: {said}")
    if len(endpoints) > 1:
        tables.warn(f"rpcbuf: stored on {addr}, the first of {len(endpoints)} endpoints "
                    "(--endpoint picks the node)")
    return EXIT_OK


def _chosen(parser: argparse.ArgumentParser,
            args: argparse.Namespace) -> tuple[argparse.ArgumentParser, bool]:
    """The innermost parser ``args`` went through, and whether it lacks a
    subcommand (argparse's subparser actions walked: no public way)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name is None:
                return parser, True
            return _chosen(action.choices[name], args)
    return parser, False


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, or exit 2: an unknown flag gets its own command's usage,
    a command without its subcommand its help."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    chosen, incomplete = _chosen(parser, args)
    if extra:
        chosen.error(f"unrecognized arguments: {' '.join(extra)}")
    if incomplete:
        chosen.print_help(sys.stderr)
        sys.exit(EXIT_USAGE)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        if args.cmd == "token":
            keys = _keys(args.secret_file, args.create, args.kid or DEFAULT_KID)
            print(create_token(keys, args.tenant, args.ttl, kid=args.kid,
                               clusters=args.cluster, nodes=args.node))
            return 0
        if args.cmd == "devices":
            return asyncio.run(_devices(args))
        if args.cmd == "doctor":
            return _doctor(args)
        if args.cmd == "nodes":
            return fleet.run_nodes(args)
        if args.cmd == "models":
            return fleet.run_models(args, _target(args), _token(args))
        if args.cmd in ("load", "unload"):
            return run_load_command(args, _target(args), _token(args))
        if args.cmd == "hash":
            return run_hash_command(args)
        if args.cmd == "blocks" and args.action == "rm":
            return _blocks_rm(args)
        if args.cmd == "release" and (args.buffer is None or args.prefix is not None
                                      or args.all):
            return _release_many(args)
        if args.cmd in ("status", "ls", "blocks"):
            return _node_command(args)
        by_buffer = {"release": _release, "get": _get, "bench": _bench, "put": _put}
        if args.cmd in by_buffer:
            return asyncio.run(by_buffer[args.cmd](args))
    except RpcBufError as exc:  # from a step that reaches every node at once
        where = fleet.registry_url(args) or ";".join(_endpoints(args)) \
            if hasattr(args, "endpoint") else "rpcbuf"
        return report(where, exc, getattr(args, "json", False))
    except (OSError, ValueError) as exc:
        tables.warn(f"rpcbuf: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("rpcbuf: interrupted", file=sys.stderr)
        return 130
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
