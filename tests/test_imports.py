"""The import rules of docs/architecture.md, checked over ``src/`` by an AST
walk: ``control.wire`` and ``control.formats`` import neither side;
``control.client`` and ``control.daemon`` never import each other (nor the
CLI, nor the model loader); ``control.fleet`` (the etcd I/O both use)
imports neither; ``models`` (the model loader, over the client) and ``cli``
never import the daemon; ``dataplane`` never imports ``control`` (all of
them under ``rpcbuf.``); and no module imports, however indirectly, itself
(imports inside functions and under ``TYPE_CHECKING`` count too: a cycle
there is a cycle in the design)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def graph() -> dict[str, set[str]]:
    mods = {module_name(p): p for p in SRC.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in mods}
    # a stub beside a module is that module's too (rpcbuf's names live in __init__.pyi)
    files = [(module_name(p), p) for p in [*SRC.rglob("*.py"), *SRC.rglob("*.pyi")]]
    for mod, path in files:
        package = mod if path.stem == "__init__" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                if t in mods and t != mod:
                    edges[mod].add(t)
    return edges


def room(mod: str) -> str:
    """``control.daemon``, ``dataplane``, ``rpcbuf`` (the public face), ... ."""
    parts = mod.split(".")
    if parts[0] != "rpcbuf" or len(parts) == 1:
        return parts[0]
    if parts[1] == "control" and len(parts) > 2:
        return f"control.{parts[2]}"
    return parts[1] if parts[1] in ("control", "dataplane", "cli", "models") else "rpcbuf"


def test_rooms_import_only_what_they_may() -> None:
    may_not = {
        "control.wire": ("control.daemon", "control.client", "control.formats", "cli", "models"),
        "control.formats": ("control.daemon", "control.client", "control.fleet", "cli", "models"),
        "control.daemon": ("control.client", "cli", "models"),
        "control.client": ("control.daemon", "cli", "models"),
        "control.fleet": ("control.daemon", "control.client", "cli", "models"),
        "models": ("control.daemon", "cli"),
        "cli": ("control.daemon",),
        "dataplane": ("control", "rpcbuf", "cli", "models"),
        "rpcbuf": ("control.daemon", "cli"),
    }
    bad = [f"{m} imports {t}" for m, ts in graph().items() for t in ts
           if any(room(t) == f or room(t).startswith(f + ".")
                  for f in may_not.get(room(m), ()))]
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles() -> None:
    edges = graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append([*path[path.index(t):], t] if t in path else [m, t])
            elif t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_rules_see_the_code() -> None:
    """The walk finds the modules and their imports (a test that cannot fail
    is a defect): the session imports the wire protocol."""
    edges = graph()
    assert "rpcbuf.control.wire.protocol" in edges["rpcbuf.control.daemon.sessions.session"]
    assert "rpcbuf.control.client.context" in edges["rpcbuf"]  # through __init__.pyi
    assert len(edges) > 40
    assert room("rpcbuf.control.daemon.service.server") == "control.daemon"
    assert room("rpcbuf.dataplane.ucx") == "dataplane"
    assert room("rpcbuf") == "rpcbuf"
    assert room("rpcbuf.cli.main") == "cli" and room("rpcbuf.models.loader") == "models"


def test_only_rpcbuf_names_are_installed() -> None:
    """The package puts no generic top-level import names (``control``,
    ``dataplane``) into its users' environments: everything it ships lives
    under ``rpcbuf``, but for the LMCache connector's own ``rpcbuf_lmcache`` and the
    SGLang backend's ``rpcbuf_sglang``."""
    packages = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").exists())
    assert packages == ["rpcbuf", "rpcbuf_lmcache", "rpcbuf_sglang"]


DAEMON_ROOMS = ("observe", "accounting", "content", "data", "ops", "sessions", "service")


def test_daemon_rooms_import_only_rooms_below() -> None:
    """``rpcbuf.control.daemon``'s rooms are layers (its ``__init__`` says what
    each holds): a module imports its own room and the rooms below it, never
    one above (``ops`` never imports ``sessions``, ``accounting`` never
    ``data``); every module sits in a room."""
    prefix = "rpcbuf.control.daemon."
    mods = [m for m in graph() if m.startswith(prefix)]
    loose = [m for m in mods if m.count(".") == 3
             and m.split(".")[3] not in (*DAEMON_ROOMS, "__main__")]
    assert not loose, f"modules outside the rooms: {loose}"
    rank = {r: i for i, r in enumerate(DAEMON_ROOMS)}
    edges = graph()
    up = [f"{m} imports {t}" for m in mods if m.count(".") >= 4 for t in edges[m]
          if t.startswith(prefix) and t.count(".") >= 4
          and rank[t.split(".")[3]] > rank[m.split(".")[3]]]
    assert not up, "\n".join(sorted(up))
    assert {m.split(".")[3] for m in mods if m.count(".") >= 3} >= set(DAEMON_ROOMS)
