#!/usr/bin/env bash
# GPU check for rpcbuf (issue 6): one command on a machine with an NVIDIA GPU.
#
#   scripts/gpu_check.sh [WHEELS_DIR]        (or WHEELS=DIR scripts/gpu_check.sh)
#
# Expects: an NVIDIA driver (nvidia-smi), a python3 (3.11+; PYTHON=... to pick
# another) that already has CuPy for its CUDA (cupy-cuda13x on CUDA 13) and
# numpy, msgpack, uvloop, xxhash, rich, safetensors, prometheus-client,
# pytest, hypothesis, pytest-timeout.  Whatever it lacks, ucxx above all
# (ucxx-cu13 with libucxx-cu13, libucx-cu13 and their needs), comes as wheels
# in WHEELS_DIR and is installed from there with no index: the machine needs
# no network.  See docs/gpu.md "Running the GPU check" for the wheel list.
#
# Steps: a venv (.gpu-venv, seeing python3's own packages) with the wheels
# and this project installed; a smoke start of rpcbufd with a GPU arena
# (--device cuda:0:1GiB) answering `rpcbuf devices`; `pytest -m gpu`; the
# CUDA VMM tests (tests/test_gpu_vmm.py: export/import across processes, a
# write through a read-only import, copy bandwidth into an import, 1000
# back/unback cycles), with their printed numbers; scripts/bench_gpu.py.  Writes benchmarks/gpu/gpu-check-STAMP.json (the
# GPU, the driver, every number, the goal) and the logs beside it.
# UCX settings come from src/dataplane/ucx.py (CUDA defaults); the caller's
# UCX_* variables win.  Exit status: 0 when every step passed.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHEELS=${1:-${WHEELS:-}}
PY=${PYTHON:-python3}
VENV=${GPU_VENV:-$ROOT/.gpu-venv}
OUTDIR=${OUTDIR:-$ROOT/benchmarks/gpu}
STAMP=$(date +%Y%m%dT%H%M%S)
LOG="$OUTDIR/gpu-check-$STAMP.log"
REPORT="$OUTDIR/gpu-check-$STAMP.json"

mkdir -p "$OUTDIR"
exec > >(tee -a "$LOG") 2>&1
say() { printf '\n== %s\n' "$*"; }
die() { printf 'gpu_check: %s\n' "$*" >&2; exit 2; }

say "GPU"
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver here"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv

say "venv $VENV (python: $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])'))"
"$PY" -m venv --system-site-packages "$VENV"
VPY="$VENV/bin/python"
# The venv also sees the packages of the python that made it (when that
# python is itself a venv, --system-site-packages alone would not).
purelib=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PY" -c 'import site; print("\n".join(site.getsitepackages()))' >"$purelib/_gpu_check_base.pth"

if [[ -n "$WHEELS" ]]; then
    [[ -d "$WHEELS" ]] || die "wheel folder $WHEELS does not exist"
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    shopt -u nullglob
    (( ${#wheels[@]} )) || die "no .whl files in $WHEELS"
    say "installing ${#wheels[@]} wheels from $WHEELS"
    "$VPY" -m pip install -q --no-index --no-deps --no-cache-dir "${wheels[@]}"
fi

say "installing rpcbuf (no dependencies: they come from the wheels or python3)"
if ! "$VPY" -m pip install -q --no-index --no-deps --no-build-isolation -e "$ROOT"; then
    echo "editable install failed; putting $ROOT/src on the path instead"
    echo "$ROOT/src" >"$purelib/_rpcbuf_src.pth"
fi

say "checking imports"
"$VPY" - <<'PYEOF' || die "missing packages: add their wheels to the wheel folder"
import importlib, sys
need = ["cupy", "ucxx", "numpy", "msgpack", "uvloop", "xxhash", "rich", "safetensors",
        "prometheus_client", "pytest", "pytest_asyncio", "pytest_timeout",
        "hypothesis", "cuda.bindings.driver", "rpcbuf"]
missing = []
for name in need:
    try:
        importlib.import_module(name)
    except Exception as exc:
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
if missing:
    print("missing:", *missing, sep="\n  ")
    sys.exit(1)
import cupy
n = cupy.cuda.runtime.getDeviceCount()
print(f"cupy {cupy.__version__}: {n} CUDA device(s); ucxx", importlib.import_module("ucxx").__version__)
from dataplane.cuda_vmm import open_driver
try:
    drv = open_driver(0)
    print(f"CUDA VMM on device 0: {drv.support}; granularity minimum "
          f"{drv.granularity()}, recommended {drv.granularity(recommended=True)}")
except Exception as exc:
    print(f"CUDA VMM on device 0: unavailable ({type(exc).__name__}: {exc})")
sys.exit(0 if n else 1)
PYEOF

export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
export UCX_TLS=${UCX_TLS:-tcp}  # loopback, as CI; dataplane/ucx.py adds cuda_copy,cuda_ipc
export RPCBUF_UCX_CUDA=${RPCBUF_UCX_CUDA:-1}
failed=()

say "smoke: rpcbufd with a GPU arena"
tmp=$(mktemp -d)
daemon_pid=""
cleanup() {
    if [[ -n "$daemon_pid" ]] && kill -0 "$daemon_pid" 2>/dev/null; then
        kill -TERM "$daemon_pid" 2>/dev/null || true
        wait "$daemon_pid" 2>/dev/null || true
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT
"$VPY" -m control.daemon --listen 127.0.0.1:0 --ucx-port 0 --secret-file "$tmp/secret" \
    --ready-file "$tmp/ready" --device cpu:256MiB --device cuda:0:1GiB >"$tmp/daemon.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 600); do
    [[ -s "$tmp/ready" ]] && break
    kill -0 "$daemon_pid" 2>/dev/null || break
    sleep 0.1
done
if [[ -s "$tmp/ready" ]]; then
    addr=$(cut -d' ' -f1 "$tmp/ready")
    token=$("$VPY" -m control.cli token create --secret-file "$tmp/secret" --tenant gpucheck)
    if "$VPY" -m control.cli devices --endpoint "$addr" --token "$token" --json; then
        echo "smoke: ok"
    else
        failed+=("smoke: rpcbuf devices")
    fi
    kill -TERM "$daemon_pid"
    wait "$daemon_pid" || failed+=("smoke: rpcbufd exit status")
else
    failed+=("smoke: rpcbufd did not start")
fi
daemon_pid=""
cat "$tmp/daemon.log"

say "pytest -m gpu"
if ! (cd "$ROOT" && "$VPY" -m pytest -m gpu -q -rs -p no:cacheprovider \
        --ignore=tests/test_gpu_vmm.py); then
    failed+=("pytest -m gpu")
fi

say "CUDA VMM: pytest -m gpu tests/test_gpu_vmm.py (prints granularity, bandwidth, timings)"
if ! (cd "$ROOT" && "$VPY" -m pytest -m gpu -q -rs -s -p no:cacheprovider \
        tests/test_gpu_vmm.py); then
    failed+=("pytest tests/test_gpu_vmm.py")
fi

say "benchmark"
read -r -a bench_args <<<"${BENCH_ARGS:-}"  # e.g. BENCH_ARGS="--size 1073741824 --rounds 20"
if ! "$VPY" "$ROOT/scripts/bench_gpu.py" --json "$REPORT" "${bench_args[@]}"; then
    failed+=("bench_gpu.py")
fi

say "summary"
echo "log: $LOG"
[[ -f "$REPORT" ]] && echo "report: $REPORT"
if (( ${#failed[@]} )); then
    printf 'FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "all GPU checks passed"
