"""``rpcbuf``: the command-line client.

Exit codes: 0 success; 1 an rpcbuf error from a daemon (its code is printed);
2 bad usage or a local problem (missing file, bad flag, no token).  The
operator commands (status, ls, release, put, get, bench) live in
``cliops.py``, model upload (load, unload) in ``loader.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from control.cli import commands as cliops
from control.cli.commands import register_operator_commands
from control.client.model.loader import register_load_commands, run_load_command
from control.wire.auth import DEFAULT_KID, create_token, load_keys
from control.wire.errors import RpcBufError
from control.wire.units import format_size, parse_duration

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


def _endpoints(args: argparse.Namespace) -> list[str]:
    text = args.endpoints or args.endpoint or os.environ.get("RPCBUF_ENDPOINTS") or "127.0.0.1:7700"
    return [e.strip() for e in text.replace(",", ";").split(";") if e.strip()]


def _token(args: argparse.Namespace) -> str:
    token = args.token or os.environ.get("RPCBUF_TOKEN")
    if not token:
        raise UsageError("no token: pass --token or set RPCBUF_TOKEN "
                         "(make one with 'rpcbuf token create')")
    return str(token)


def _client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", help="daemon HOST:PORT (else $RPCBUF_ENDPOINTS, 127.0.0.1:7700)")
    p.add_argument("--endpoints", help='several daemons: "h1:7700;h2:7700"')
    p.add_argument("--token", help="auth token (else $RPCBUF_TOKEN)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per daemon [10]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rpcbuf", description="rpcbuf command-line client.",
                                epilog="exit codes: 0 ok, 1 error from a daemon, 2 usage/local")
    sub = p.add_subparsers(dest="cmd", required=True)

    tok = sub.add_parser("token", help="manage auth tokens").add_subparsers(dest="tcmd",
                                                                           required=True)
    tc = tok.add_parser("create", help="print a token (a JWT, HS256) for a tenant",
                        epilog="example: rpcbuf token create --secret-file /etc/rpcbuf/secret "
                               "--tenant alice --ttl 7d")
    tc.add_argument("--secret-file", required=True,
                    help="the node's keys, one 'KEY_ID SECRET' a line (created 0600 with one "
                         "key if missing)")
    tc.add_argument("--tenant", required=True)
    tc.add_argument("--ttl", type=_token_ttl, default=DEFAULT_TOKEN_TTL,
                    help="lifetime, e.g. 1h or 30d, or 'never' for a token that never "
                         "expires [24h]")
    tc.add_argument("--kid", help="sign with this key of the secret file (the one created, if "
                    "the file is missing) [the file's last key]")

    dv = sub.add_parser("devices", help="list every node's devices and free memory",
                        epilog='example: rpcbuf devices --endpoints "10.0.0.5:7700;10.0.0.6:7700"')
    _client_flags(dv)
    register_operator_commands(sub, _client_flags)
    register_load_commands(sub, _client_flags)
    return p


async def _per_node(args: argparse.Namespace, fn: Any) -> dict[str, Any]:
    """``fn(ctx)`` on every node; ``{endpoint: result or error}`` (a node that
    cannot be reached reports its own error, the others still answer)."""
    from control.client.cluster import Cluster

    async with Cluster.connect(_endpoints(args), _token(args), timeout=args.timeout,
                               partial=True) as cluster:
        return await cluster.each(fn)


async def _devices(args: argparse.Namespace) -> int:
    """Every node's devices as one table (slot numbers are placement's), or JSON
    ``{endpoint: [device, ...] or error}``; exit 1 if any node failed."""
    from control.client.cluster import Cluster

    async with Cluster.connect(_endpoints(args), _token(args), timeout=args.timeout,
                               partial=True) as cluster:
        got = await cluster.devices_by_node()
    failed = any(isinstance(r, RpcBufError) for r in got.values())
    if args.json:
        print(json.dumps({a: (r.to_wire() if isinstance(r, RpcBufError) else r)
                          for a, r in got.items()}, indent=2, default=str))
        return 1 if failed else 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rpcbuf devices")
    for col in ("slot", "endpoint", "node", "device", "allocator", "total", "free",
                "largest free"):
        table.add_column(col, justify="right" if col in ("slot", "total", "free",
                                                        "largest free") else "left")
    for addr, res in got.items():
        if isinstance(res, RpcBufError):
            table.add_row("-", addr, "", f"[red]{res.code}[/red]", res.message[:60], "", "", "")
            continue
        for d in res:
            table.add_row(str(d["slot"] if not failed else "-"), addr, str(d["node_id"]),
                          str(d["key"]), str(d.get("allocator", "")), format_size(d["total"]),
                          format_size(d["free"]), format_size(d["largest_free"]))
    Console(width=max(100, _term_width())).print(table)
    if failed:
        print("rpcbuf: some nodes failed; slot numbers need every node", file=sys.stderr)
    return 1 if failed else 0


def _term_width() -> int:
    import shutil

    return shutil.get_terminal_size((120, 24)).columns


def _report(args: argparse.Namespace, results: dict[str, Any], rows: Any) -> int:
    failed = {a: r for a, r in results.items() if isinstance(r, RpcBufError)}
    if args.json:
        print(json.dumps({a: (r.to_wire() if isinstance(r, RpcBufError) else r)
                          for a, r in results.items()}, indent=2, default=str))
    else:
        for addr, res in results.items():
            if isinstance(res, RpcBufError):
                print(f"{addr}: error {res}", file=sys.stderr)
            else:
                for line in rows(addr, res):
                    print(line)
    return 1 if failed else 0


def _node_command(args: argparse.Namespace) -> int:
    """status / ls / release on every endpoint: exit 1 if any node failed."""
    fns = {"status": cliops.status, "ls": cliops.ls,
           "release": lambda c: cliops.release(c, args.buffer)}
    results = asyncio.run(_per_node(args, fns[args.cmd]))
    if args.json or args.cmd == "release":
        return _report(args, results, lambda a, r: [f"{a}: released {r['released']}"])
    from rich.console import Console

    console = Console(width=max(100, _term_width()))
    if args.cmd == "status":
        for table in cliops.status_tables(results):
            console.print(table)
    else:
        console.print(cliops.ls_table(results))
    for addr, res in results.items():
        if isinstance(res, RpcBufError):
            print(f"{addr}: error {res}", file=sys.stderr)
    return 1 if any(isinstance(r, RpcBufError) for r in results.values()) else 0


async def _one_node(args: argparse.Namespace) -> int:
    """put / get / bench against the first endpoint."""
    from control.client.context import connect

    arr = None
    name = None
    if args.cmd == "put":
        arr = cliops.load_npy(args.file)  # a missing or bad file: exit 2 before connecting
        name = cliops.default_name(args.file, args.name, args.ttl)
    try:
        async with connect(_endpoints(args)[0], _token(args), timeout=args.timeout) as ctx:
            if args.cmd == "put":
                assert arr is not None
                result: Any = await cliops.put(ctx, arr, name, args.ttl)
                text = result["buffer_id"]
            elif args.cmd == "get":
                result = await cliops.get(ctx, args.buffer, args.out)
                text = (f"wrote {result['out']}: {result['dtype']} {tuple(result['shape'])} "
                        f"from {result['buffer_id']}")
            else:
                result = await cliops.bench(ctx, args.sizes, args.duration)
                text = ""
    except RpcBufError as exc:
        if args.json:
            print(json.dumps({"error": exc.to_wire()}, indent=2, default=str))
        else:
            print(f"rpcbuf: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    elif args.cmd == "bench":
        from rich.console import Console

        Console(width=max(100, _term_width())).print(cliops.bench_table(result))
    else:
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "token":
            keys = load_keys(args.secret_file, kid=args.kid or DEFAULT_KID)
            print(create_token(keys, args.tenant, args.ttl, kid=args.kid))
            return 0
        if args.cmd == "devices":
            return asyncio.run(_devices(args))
        if args.cmd in ("load", "unload"):
            return run_load_command(args, _endpoints(args), _token(args))
        if args.cmd in ("status", "ls", "release"):
            return _node_command(args)
        if args.cmd in ("put", "get", "bench"):
            return asyncio.run(_one_node(args))
    except (OSError, ValueError) as exc:
        print(f"rpcbuf: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
