"""List the ``double-backticked`` references in src/'s docstrings that name nothing.

A docstring that says ``HostArena.keep`` or ``eager.py`` after the code moved is
false; this finds the candidates.  Three checks, each loose enough to run clean
on prose:

- a token that looks like a path (``daemon/ops/fileops.py``, ``tests/x.py``)
  must name a file or folder under the docstring's own folder, one above it,
  ``src/rpcbuf``, ``src/rpcbuf/control`` or the repository root; a bare file
  name (``paths.py``) must name a file somewhere in src/;
- ``Name.attr`` where ``Name`` is a class or module of src/ must name something
  that class (or one of its bases in src/) defines, or the module or one of its
  classes (``kept.take`` is read through an instance as often as not);
- every other identifier in a token must occur somewhere in src/: as a module,
  def, class, parameter, attribute, name, keyword or string constant (so wire
  field values and environment variables pass).

In a package's docstring a bare lower-case name must be one of the package's
modules or its siblings' (it lists them).

What is left needs a reader: a miss can be prose, a shell command or a name of
another library.

    python scripts/docrefs.py        # prints "path:line: ``token``: what is missing"
"""

from __future__ import annotations

import ast
import builtins
import itertools
import keyword
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
TOKEN = re.compile(r"``([^`]+)``")
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PATHLIKE = re.compile(r"^[\w./-]+\.(py|pyi|md|toml|json|sh)$|^[\w.-]+(/[\w.-]+)+/?$")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


@dataclass
class Index:
    names: set[str] = field(default_factory=set)
    # class name -> (its members, its bases' names); a name defined twice merges
    classes: dict[str, tuple[set[str], set[str]]] = field(default_factory=dict)
    # module stem -> its top-level names (and its submodules, for a package)
    modules: dict[str, set[str]] = field(default_factory=dict)

    def members(self, cls: str, seen: frozenset[str] = frozenset()) -> set[str]:
        own, bases = self.classes[cls]
        found = set(own)
        for base in bases - seen:
            if base in self.classes:
                found |= self.members(base, seen | {cls})
        return found


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Tuple | ast.List):
        return [name for elt in node.elts for name in _targets(elt)]
    return []


def _defined(body: list[ast.stmt], imports: bool) -> set[str]:
    """The names a class or module body defines (and, for a module, imports)."""
    members: set[str] = set()
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            members.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                members.update(_targets(target))
        elif isinstance(stmt, ast.AnnAssign):
            members.update(_targets(stmt.target))
        elif imports and isinstance(stmt, ast.Import | ast.ImportFrom):
            members.update((a.asname or a.name).split(".")[0] for a in stmt.names)
    return members


def _class_members(cls: ast.ClassDef) -> set[str]:
    members = _defined(cls.body, imports=False)
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and isinstance(node.ctx, ast.Store)
        ):
            members.add(node.attr)
    return members


def _module_members(tree: ast.Module) -> set[str]:
    return _defined(tree.body, imports=True)


def sources(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".py", ".pyi"))


def build_index(root: Path) -> Index:
    index = Index()
    index.names.update(dir(builtins), keyword.kwlist, keyword.softkwlist)
    for path in sources(root):
        parts = path.relative_to(root).with_suffix("").parts
        index.names.update(parts)
        tree = ast.parse(path.read_text(), str(path))
        stem = parts[-2] if parts[-1] == "__init__" else parts[-1]
        module = index.modules.setdefault(stem, set())
        module.update(_module_members(tree))
        # ``kept.take`` may mean the module's class's method, through an instance
        for top in tree.body:
            if isinstance(top, ast.ClassDef):
                module.update(_class_members(top))
        prose = {id(stmt) for stmt in _docstring_nodes(tree)}
        package = [part for part in parts if part != "__init__"]
        for parent, child in itertools.pairwise(package):
            index.modules.setdefault(parent, set()).add(child)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                own, bases = index.classes.setdefault(node.name, (set(), set()))
                own.update(_class_members(node))
                for base in node.bases:
                    if isinstance(base, ast.Name):
                        bases.add(base.id)
                    elif isinstance(base, ast.Attribute):
                        bases.add(base.attr)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                index.names.add(node.name)
            elif isinstance(node, ast.arg):
                index.names.add(node.arg)
            elif isinstance(node, ast.Attribute):
                index.names.add(node.attr)
            elif isinstance(node, ast.Name):
                index.names.add(node.id)
            elif isinstance(node, ast.keyword) and node.arg:
                index.names.add(node.arg)
            elif isinstance(node, ast.alias):
                index.names.update((node.asname or node.name).split("."))
            elif isinstance(node, ast.ImportFrom) and node.module:
                index.names.update(node.module.split("."))
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in prose
            ):
                index.names.update(IDENT.findall(node.value))
    return index


def docstrings(tree: ast.Module) -> list[tuple[int, str]]:
    """Module, class and function docstrings, and strings right after an assignment."""
    return [(node.lineno, str(node.value)) for node in _docstring_nodes(tree)]


def _docstring_nodes(tree: ast.Module) -> list[ast.Constant]:
    found: list[ast.Constant] = []
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for position, stmt in enumerate(body):
            first = position == 0 and isinstance(
                node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
            )
            after_assign = position > 0 and isinstance(
                body[position - 1], ast.Assign | ast.AnnAssign
            )
            if (
                (first or after_assign)
                and isinstance(stmt, ast.Expr)
                and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)
            ):
                found.append(stmt.value)
    return found


def path_exists(token: str, here: Path) -> bool:
    token = token.rstrip("/")
    bases = [here, here.parent, SRC / "rpcbuf", SRC / "rpcbuf" / "control", REPO]
    return any((base / token).exists() for base in bases)


def check(token: str, here: Path, index: Index) -> list[str]:
    """What in ``token`` names nothing; empty when all of it checks out."""
    token = " ".join(token.split())
    if PATHLIKE.match(token) and "/" in token:
        return [] if path_exists(token, here) else [f"no file {token}"]
    if re.fullmatch(r"\w+\.(py|pyi)", token):
        anywhere = any(SRC.rglob(token))
        return [] if anywhere else [f"no file {token} in src/"]
    missing: list[str] = []
    for dotted in DOTTED.findall(token):
        head, *rest = dotted.split(".")
        for attr in rest:
            if head in index.classes:
                known = index.members(head)
            elif head in index.modules:
                known = index.modules[head]
            else:
                break
            if attr not in known and not attr.startswith("__"):
                missing.append(f"{head}.{attr}")
                break
            head = attr
    missing += [part for part in IDENT.findall(token) if part not in index.names]
    return missing


def main() -> int:
    index = build_index(SRC)
    misses = 0
    for path in sources(SRC):
        tree = ast.parse(path.read_text(), str(path))
        for lineno, text in docstrings(tree):
            for token in TOKEN.findall(text):
                missing = check(token, path.parent, index)
                if (
                    path.name == "__init__.py"
                    and path.parent.parent != SRC
                    and lineno == 1
                    and IDENT.fullmatch(token)
                    and token.islower()
                ):
                    # a package's docstring lists its modules (and its siblings) by name
                    near = path.parent.parent
                    below = {p.stem for p in near.rglob("*.py")}
                    below |= {p.name for p in near.rglob("*") if p.is_dir()}
                    if token not in below:
                        missing.append(f"no module {token} in {path.parent.name}/")
                if missing:
                    misses += 1
                    print(f"{path.relative_to(REPO)}:{lineno}: ``{token}``: {', '.join(missing)}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
