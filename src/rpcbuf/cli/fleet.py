"""The fleet registry on the command line: the ``--registry`` flags every client
command takes, ``rpcbuf nodes`` (live members; no token: entries hold no
tenant data) and ``rpcbuf models`` (this tenant's models across the live nodes,
grouped from their ``NAME/slotN`` buffers).  An etcd password comes from the
environment or a file, never a flag (flags show in ``ps``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from typing import Any

from rich.text import Text

from rpcbuf.cli import tables
from rpcbuf.cli.commands import bar
from rpcbuf.cli.errors import (
    EXIT_NODE,
    EXIT_OK,
    positive_seconds,
    report,
    sentence,
    to_json,
)
from rpcbuf.control.client.cluster import Cluster, ClusterConnector
from rpcbuf.control.client.discovery import Discovery
from rpcbuf.control.fleet.etcd import EtcdOptions
from rpcbuf.control.wire.errors import RpcBufError
from rpcbuf.control.wire.membership import DEFAULT_CLUSTER, NodeRecord, is_registry
from rpcbuf.control.wire.units import format_size
from rpcbuf.models import record as LR
from rpcbuf.models.metadata import META_TENSOR

SLOT_RE = re.compile(r"(.+)/slot(\d+)")


def node_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ca", metavar="PEM", help="TLS to the nodes: each must present a "
                   "certificate from this CA naming its address (else $RPCBUF_CA)")
    p.add_argument("--insecure", action="store_true",
                   help="allow plain TCP (the token in the clear) to nodes that are not on "
                        "loopback: only on a network you trust (else $RPCBUF_INSECURE=1)")


def dial_kw(args: argparse.Namespace) -> dict[str, Any]:
    """``tls`` and ``insecure`` for ``connect`` (None: the environment's defaults)."""
    return {"tls": getattr(args, "ca", None) or None,
            "insecure": True if getattr(args, "insecure", False) else None}


def registry_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fleet registry")
    g.add_argument("--registry", metavar="etcd://HOST:PORT",
                   help="find the nodes in etcd (else $RPCBUF_REGISTRY when no --endpoint(s))")
    g.add_argument("--cluster", default=os.environ.get("RPCBUF_CLUSTER", DEFAULT_CLUSTER),
                   help="the registry's cluster [$RPCBUF_CLUSTER, else default]")
    g.add_argument("--registry-ca", metavar="PEM", help="TLS to etcd: the CA to trust")
    g.add_argument("--registry-cert", metavar="PEM", help="TLS client certificate for etcd")
    g.add_argument("--registry-key", metavar="PEM", help="its private key")
    g.add_argument("--registry-user", help="etcd user (password: $RPCBUF_REGISTRY_PASSWORD "
                   "or --registry-password-file)")
    g.add_argument("--registry-password-file", metavar="FILE")


def registry_url(args: argparse.Namespace) -> str | None:
    """The registry a command should use, or None (an endpoint list)."""
    if getattr(args, "registry", None):
        return str(args.registry)
    for given in (getattr(args, "endpoints", None), getattr(args, "endpoint", None)):
        if given:
            return str(given) if is_registry(given) else None
    env = os.environ.get("RPCBUF_REGISTRY")
    if env and not os.environ.get("RPCBUF_ENDPOINTS"):
        return env
    return None


def options(args: argparse.Namespace) -> EtcdOptions:
    password = None
    if args.registry_user:
        if args.registry_password_file:
            with open(args.registry_password_file) as f:
                password = f.readline().rstrip("\n")
        else:
            password = os.environ.get("RPCBUF_REGISTRY_PASSWORD")
            if password is None:
                raise ValueError("--registry-user needs $RPCBUF_REGISTRY_PASSWORD or "
                                 "--registry-password-file")
    return EtcdOptions(ca=args.registry_ca, cert=args.registry_cert, key=args.registry_key,
                       user=args.registry_user, password=password,
                       timeout=min(float(getattr(args, "timeout", 3.0)), 10.0))


def cluster(args: argparse.Namespace, target: str | list[str], token: str, *,
            partial: bool = True, need: int | None = None) -> ClusterConnector:
    """``Cluster.connect`` to ``target`` as the flags say; ``need``: bytes free a
    registry-chosen node must have."""
    kw = dial_kw(args)
    if registry_url(args) is not None:
        kw |= {"cluster": args.cluster, "registry": options(args), "need": need}
    return Cluster.connect(target, token, timeout=args.timeout, partial=partial, **kw)


def register_fleet_commands(sub: Any) -> None:
    nd = sub.add_parser("nodes", help="the registry's live nodes: devices, version, uptime",
                        epilog="example: rpcbuf nodes --registry etcd://10.0.0.1:2379")
    registry_flags(nd)
    nd.add_argument("--json", action="store_true", help="print JSON for scripts")
    nd.add_argument("--timeout", type=positive_seconds, default=5.0, help="seconds for etcd [5]")
    nd.add_argument("--wide", action="store_true", help="every table column")


def nodes_table(records: dict[str, NodeRecord], title: str, wide: bool = False,
                now: float | None = None) -> Any:
    now = time.time() if now is None else now
    rows = []
    for r in records.values():
        devs = Text("\n").join(Text(f"{tables.clean(d.key)} {format_size(d.free)}/"
                                     f"{format_size(d.total)} ")
                                + bar(d.total - d.free, d.total) for d in r.devices) or "-"
        rows.append([r.node_id, r.address, devs, r.version, tables.duration(now - r.started_at),
                     f"{tables.duration(now - r.updated_at)} ago"])
    cols = [tables.Col("node", key=True), tables.Col("address", key=True),
            tables.Col("devices (free/total)", wrap=True), tables.Col("version", drop=2),
            tables.Col("uptime", right=True, drop=3),
            tables.Col("last refresh", right=True, drop=1)]
    return tables.fit(title, cols, rows, wide=wide)


async def _read_nodes(args: argparse.Namespace, url: str) -> dict[str, NodeRecord]:
    discovery = Discovery(url, args.cluster, options(args))
    try:
        return await discovery.read()
    finally:
        await discovery.close()


def run_nodes(args: argparse.Namespace) -> int:
    url = registry_url(args)
    if url is None:
        raise ValueError("rpcbuf nodes needs --registry etcd://HOST:PORT (or $RPCBUF_REGISTRY)")
    try:
        records = asyncio.run(_read_nodes(args, url))
    except RpcBufError as exc:
        return report(url, exc, args.json)
    if args.json:
        print(json.dumps({n: r.to_json() for n, r in records.items()}, indent=2))
        return EXIT_OK
    if not records:
        print(f"no live nodes in cluster {args.cluster!r} at {url}")
        return EXIT_OK
    title = f"rpcbuf nodes: {len(records)} live in cluster {args.cluster!r} ({url})"
    tables.console(args.wide).print(nodes_table(records, title, args.wide))
    return EXIT_OK


def group_models(results: dict[str, Any],
                 records: dict[str, dict[str, LR.Found]] | None = None
                 ) -> dict[str, dict[str, Any]]:
    """``{model: {slots, nodes, bytes, tensors, source_types, metadata,
    complete, problems}}`` from each node's buffers and load records.  ``complete``
    is None when a node did not answer and the rest show no problem."""
    answered = all(not isinstance(r, RpcBufError) for r in results.values())
    out: dict[str, dict[str, Any]] = {}
    found: dict[str, dict[int, tuple[LR.Found, dict[str, Any]]]] = {}
    for addr, bufs in results.items():
        if isinstance(bufs, RpcBufError):
            continue
        for b in bufs:
            m = SLOT_RE.fullmatch(b.get("name") or "")
            if m is None:
                continue
            g = out.setdefault(m.group(1), {"slots": [], "nodes": [], "bytes": 0, "tensors": 0,
                                            "source_types": {}, "metadata": False,
                                            "type_bytes": {}})
            g["slots"].append(int(m.group(2)))
            if addr not in g["nodes"]:
                g["nodes"].append(addr)
            g["bytes"] += int(b.get("size", 0))
            entries = b.get("tensors") if isinstance(b.get("tensors"), dict) else {}
            has_meta = META_TENSOR in entries
            g["metadata"] |= has_meta
            g["tensors"] += int(b.get("tensor_count", 0)) - has_meta \
                - (LR.LOAD_TENSOR in entries)
            rec = (records or {}).get(addr, {}).get(str(b.get("buffer_id")))
            slot = int(m.group(2))
            if slot in found.setdefault(m.group(1), {}):  # one slot on two nodes
                g.setdefault("held_twice", set()).add(slot)
            found[m.group(1)][slot] = (rec, entries)
            for name, e in entries.items():
                kind = e.get("source_type") if isinstance(e, dict) else None
                if isinstance(kind, str) and name not in (META_TENSOR, LR.LOAD_TENSOR):
                    g["source_types"][kind] = g["source_types"].get(kind, 0) + 1
                    nbytes = e.get("nbytes")
                    g["type_bytes"][kind] = g["type_bytes"].get(kind, 0) + \
                        (nbytes if isinstance(nbytes, int) else 0)
    for name, g in out.items():
        g["slots"].sort()
        # A slot held on two nodes (a load left one out, a per-node load): which
        # copy is the model is not for this listing to guess.
        twice = sorted(g.pop("held_twice", ()))
        g["problems"] = [f"slot {n} is held on more than one node" for n in twice] + \
            LR.problems(found[name], every_node=answered)
        g["complete"] = False if g["problems"] else (True if answered else None)
        by_bytes = g.pop("type_bytes")
        g["source_types"] = dict(sorted(g["source_types"].items(),
                                        key=lambda kv: (-by_bytes[kv[0]], kv[0])))
    return dict(sorted(out.items()))


def _types_cell(types: dict[str, int], most: int | None = 3) -> str:
    """Source types by bytes: ``"Q4_K Q6_K F32 +2"`` (all when ``most`` is None)."""
    names = list(types)
    if most is None:
        most = len(names)
    more = f" +{len(names) - most}" if len(names) > most else ""
    return " ".join(names[:most]) + more or "-"


async def _listing(ctx: Any) -> tuple[list[dict[str, Any]], dict[str, LR.Found]]:
    """A node's buffers, and the load record of each model slot buffer there."""
    bufs = await ctx.list_buffers()
    slots = {str(b.get("buffer_id")): (str(b.get("buffer_id")), b["tensors"]) for b in bufs
             if SLOT_RE.fullmatch(b.get("name") or "") and isinstance(b.get("tensors"), dict)}
    return bufs, await LR.records(ctx, slots)


async def _models(args: argparse.Namespace, target: Any, token: str
                  ) -> tuple[dict[str, Any], dict[str, dict[str, LR.Found]]]:
    async with cluster(args, target, token) as nodes:
        got = await nodes.each(_listing)
    return ({a: r if isinstance(r, RpcBufError) else r[0] for a, r in got.items()},
            {a: r[1] for a, r in got.items() if not isinstance(r, RpcBufError)})


def run_models(args: argparse.Namespace, target: Any, token: str) -> int:
    results, records = asyncio.run(_models(args, target, token))
    models = group_models(results, records)
    failed = {a: e for a, e in results.items() if isinstance(e, RpcBufError)}
    if args.json:
        print(json.dumps({"models": models,
                          "errors": {a: to_json(a, e) for a, e in failed.items()}}, indent=2))
    elif models:
        rows = [[name, ", ".join(map(str, g["slots"])), "\n".join(g["nodes"]),
                 format_size(g["bytes"]), str(g["tensors"]),
                 _types_cell(g["source_types"], None if args.wide else 3),
                 {True: "yes", False: "no", None: "unknown"}[g["complete"]]]
                for name, g in models.items()]
        cols = [tables.Col("model", key=True, wrap=True), tables.Col("slots"),
                tables.Col("nodes", key=True), tables.Col("bytes", right=True),
                tables.Col("tensors", right=True, drop=2),
                tables.Col("types", wrap=True, drop=1), tables.Col("complete")]
        tables.console(args.wide).print(tables.fit(
            f"rpcbuf models: {len(models)} on {len(results) - len(failed)} node(s)", cols, rows,
            wide=args.wide))
    else:
        print("no models loaded for this tenant")
    if not args.json:
        for name, g in models.items():
            if g["problems"]:
                tables.warn(f"rpcbuf: {tables.clean(LR.incomplete(name, g['problems']).message)}")
        for addr, exc in failed.items():
            tables.warn(f"rpcbuf: {sentence(addr, exc)}")
    return EXIT_NODE if failed else EXIT_OK
