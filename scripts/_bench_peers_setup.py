"""The peers' virtualenvs for ``bench_peers.py``: one per peer under ``.peers/``.

Each peer gets ``.peers/<name>`` (ignored by git; ``make test`` never
touches it), made with ``python -m venv`` and filled with the peer's PyPI
package and numpy by the venv's own pip, then checked by importing the
peer's module with that venv's python.  An existing venv whose import
check passes is used as it is (``--reinstall`` starts it afresh).  Every
step is bounded; a peer whose install or import fails comes back with the
reason (the last lines pip or python printed), and the benchmark reports it
in its table instead of crashing.  Mooncake's wheel links ``libibverbs``:
``make bench-peers`` installs ``libibverbs1`` when run as root (and says so
otherwise); without it the import check fails with the loader's message.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import benchkit


@dataclass(frozen=True)
class PeerPackage:
    name: str  # the venv's directory under .peers/
    package: str  # what pip installs
    module: str  # what the import check imports
    version_of: str  # the distribution whose version the report names


PACKAGES = (
    PeerPackage("mooncake", "mooncake-transfer-engine-non-cuda", "mooncake.engine",
                "mooncake-transfer-engine-non-cuda"),
    PeerPackage("nixl", "nixl", "nixl._api", "nixl"),
)
PEERS_DIR = benchkit.ROOT / ".peers"


@dataclass
class PeerEnv:
    """A peer's venv: ``python`` when usable, else ``reason`` says why not."""

    name: str
    python: Path | None
    version: str | None = None
    reason: str = ""
    installed_now: bool = False


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    """(exit status, the last lines of its output); a timeout is status -1."""
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"{' '.join(cmd[:4])} ... ran past {timeout:.0f} s"
    except OSError as exc:
        return -1, str(exc)
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines()
             if ln.strip() and not ln.startswith("WARNING: Location")]  # pip's index noise
    return proc.returncode, " | ".join(lines[-3:])


def _check(pkg: PeerPackage, python: Path) -> tuple[str | None, str]:
    """(version, '') if the module imports, else (None, why)."""
    code = (f"import {pkg.module}, importlib.metadata as m; "
            f"print(m.version({pkg.version_of!r}))")
    rc, out = _run([str(python), "-c", code], 120)
    if rc == 0:
        return out.split(" | ")[-1].strip(), ""
    return None, f"import {pkg.module} failed: {out.split(' | ')[-1]}"  # the error line


def ensure(pkg: PeerPackage, install: bool = True, reinstall: bool = False,
           timeout: float = 1800.0, progress: object = None) -> PeerEnv:
    """The peer's venv, installed first if ``install`` and it is missing or broken."""
    venv = PEERS_DIR / pkg.name
    python = venv / "bin" / "python"
    if reinstall and venv.exists():
        shutil.rmtree(venv)
    if python.exists():
        version, why = _check(pkg, python)
        if version is not None:
            return PeerEnv(pkg.name, python, version)
        if not install:
            return PeerEnv(pkg.name, None, reason=why)
    elif not install:
        return PeerEnv(pkg.name, None, reason=f"not installed in {venv} (run make bench-peers)")
    say = progress if callable(progress) else (lambda _msg: None)
    say(f"installing {pkg.package} into {venv.relative_to(benchkit.ROOT)} "
        "(once; a few minutes) ...")
    PEERS_DIR.mkdir(exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)  # not our venv's python
    rc, out = _run([base, "-m", "venv", "--clear", str(venv)], 300)
    if rc != 0:
        return PeerEnv(pkg.name, None, reason=f"python -m venv failed: {out}")
    rc, out = _run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    pkg.package, "numpy"], timeout)
    if rc != 0:
        return PeerEnv(pkg.name, None, reason=f"pip install {pkg.package} failed: {out}")
    version, why = _check(pkg, python)
    if version is None:
        return PeerEnv(pkg.name, None, reason=why)
    return PeerEnv(pkg.name, python, version, installed_now=True)
