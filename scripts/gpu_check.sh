#!/usr/bin/env bash
# GPU check for rpcbuf (issues 6, 27): one command on a machine with an NVIDIA GPU.
#
#   scripts/gpu_check.sh [WHEELS_DIR]        (or WHEELS=DIR scripts/gpu_check.sh)
#
# Expects: an NVIDIA driver (nvidia-smi), a python3 (3.11+; PYTHON=... to pick
# another) that already has CuPy for its CUDA (cupy-cuda13x on CUDA 13) and
# what docs/gpu.md "Running the GPU check" lists.  Whatever it lacks, ucxx
# above all, comes as wheels in WHEELS_DIR, installed with no index and no
# dependency resolution: the machine needs no network.
#
# Output: $OUT when set (the device tool brings that folder back), else
# $OUTDIR, else benchmarks/gpu: gpu-check-STAMP.log (everything), .json (the
# GPU, the driver, the UCX settings, every step's exit status, the VMM figures
# and the benchmark's rows) and one log per step.
#
# Every step runs under `timeout` (STEP_TIMEOUT, default 300 s; the bench
# BENCH_TIMEOUT) and a failed step does not stop the next; the summary and
# the JSON report are written whatever happened (an EXIT trap).  Order: the
# CUDA VMM tests first (they need no UCX and are the newest code), then a
# smoke start of rpcbufd, `pytest -m gpu`, and a bounded benchmark
# (BENCH_SIZE bytes, BENCH_ROUNDS rounds).  Exit status: 0 when every step
# passed, 1 when one failed, 2 when the machine cannot run the check at all.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHEELS=${1:-${WHEELS:-}}
PY=${PYTHON:-python3}
VENV=${GPU_VENV:-$ROOT/.gpu-venv}
OUTDIR=${OUT:-${OUTDIR:-$ROOT/benchmarks/gpu}}
STAMP=$(date +%Y%m%dT%H%M%S)
LOG="$OUTDIR/gpu-check-$STAMP.log"
REPORT="$OUTDIR/gpu-check-$STAMP.json"
FIGURES="$OUTDIR/gpu-check-$STAMP.figures.json"  # the VMM tests' numbers (record())
BENCH_JSON="$OUTDIR/gpu-check-$STAMP.bench.json"
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-240}
BENCH_SIZE=${BENCH_SIZE:-$((64 << 20))}
BENCH_ROUNDS=${BENCH_ROUNDS:-5}

mkdir -p "$OUTDIR"
exec > >(tee -a "$LOG") 2>&1
say() { printf '\n== %s\n' "$*"; }

steps=()     # "name rc seconds", in order
failed=()
VPY=""
tmp=$(mktemp -d)
daemon_pid=""

# step NAME TIMEOUT CMD...: run CMD bounded, its output also in NAME.log.
step() {
    local name=$1 limit=$2
    shift 2
    say "$name (at most ${limit}s)"
    local t0=$SECONDS rc
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUTDIR/gpu-check-$STAMP.$name.log"
    rc=${PIPESTATUS[0]}
    (( rc == 124 || rc == 137 )) && echo "$name: timed out after ${limit}s"
    steps+=("$name $rc $((SECONDS - t0))")
    (( rc == 0 )) || failed+=("$name (exit $rc)")
    return "$rc"
}

report() {
    # The JSON report, from whatever the steps left; bounded, and it must not
    # itself stop the summary.
    local py=${VPY:-$PY}
    timeout -k 5 60 "$py" - "$REPORT" "$FIGURES" "$BENCH_JSON" "${steps[@]}" <<'PYEOF' || true
import json, os, subprocess, sys
report, figures, bench, *steps = sys.argv[1:]
def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
def smi():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20).stdout.strip()
    except Exception as exc:
        out = f"unavailable ({exc})"
    return out
out = {"gpu": smi(), "fatal": os.environ.get("FATAL", ""),
       "steps": [dict(zip(("name", "rc", "seconds"), s.split())) for s in steps],
       "ucx_env": {k: v for k, v in os.environ.items()
                   if k.startswith(("UCX_", "RPCBUF_")) and k != "FATAL"},
       "vmm": load(figures), "bench": load(bench)}
with open(report, "w") as f:
    json.dump(out, f, indent=1)
print(f"report: {report}")
PYEOF
}

finish() {
    local rc=$?
    if [[ -n "$daemon_pid" ]] && kill -0 "$daemon_pid" 2>/dev/null; then
        kill -TERM "$daemon_pid" 2>/dev/null
        sleep 2
        kill -KILL "$daemon_pid" 2>/dev/null
    fi
    rm -rf "$tmp"
    say "summary"
    printf '%-14s %4s %6s\n' step rc seconds
    local s
    for s in "${steps[@]}"; do printf '%-14s %4s %6s\n' $s; done
    FATAL=$fatal report
    echo "log: $LOG"
    if [[ -n "$fatal" ]]; then
        echo "CANNOT RUN: $fatal"
        exit 2
    fi
    if (( ${#failed[@]} )); then
        printf 'FAILED: %s\n' "${failed[@]}"
        exit 1
    fi
    (( rc )) && exit "$rc"
    echo "all GPU checks passed"
}
trap finish EXIT
fatal=""
die() { printf 'gpu_check: %s\n' "$*" >&2; fatal="$*"; exit 2; }

say "GPU"
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver here"
timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv \
    || die "nvidia-smi failed: no usable GPU"

say "venv $VENV (python: $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])'))"
# --without-pip: a python without ensurepip (Debian's, some CUDA images) can
# still make it; the wheels go in with whichever pip exists, or are unpacked.
timeout 120 "$PY" -m venv --without-pip --system-site-packages "$VENV" \
    || die "cannot make a venv with $PY"
VPY="$VENV/bin/python"
purelib=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# The venv also sees the packages of the python that made it (when that
# python is itself a venv, --system-site-packages alone would not), and this
# checkout's sources (the daemon and CLI run as -m rpcbuf.control.daemon / rpcbuf.cli).
"$PY" -c 'import site; print("\n".join(site.getsitepackages()))' >"$purelib/_gpu_check_base.pth"
echo "$ROOT/src" >"$purelib/_rpcbuf_src.pth"

if [[ -n "$WHEELS" ]]; then
    [[ -d "$WHEELS" ]] || die "wheel folder $WHEELS does not exist"
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    shopt -u nullglob
    (( ${#wheels[@]} )) || die "no .whl files in $WHEELS"
    say "installing ${#wheels[@]} wheels from $WHEELS"
    if "$VPY" -m pip --version >/dev/null 2>&1; then
        timeout 300 "$VPY" -m pip install -q --no-index --no-deps --no-cache-dir "${wheels[@]}"
    elif "$PY" -m pip --version >/dev/null 2>&1; then
        timeout 300 "$PY" -m pip --python "$VPY" install -q --no-index --no-deps \
            --no-cache-dir "${wheels[@]}"
    else  # no pip anywhere: a wheel is a zip of its site-packages files
        echo "no pip: unpacking the wheels into $purelib"
        timeout 300 "$VPY" -c 'import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])' "$purelib" "${wheels[@]}"
    fi || die "installing the wheels failed"
fi

say "checking imports"
timeout 120 "$VPY" - <<'PYEOF' || die "missing packages: add their wheels to the wheel folder"
import importlib, sys
need = ["cupy", "ucxx", "numpy", "msgpack", "uvloop", "xxhash", "rich", "safetensors",
        "prometheus_client", "pytest", "pytest_asyncio", "pytest_timeout", "hypothesis",
        "sortedcontainers", "jwt", "aetcd", "cuda.bindings.driver", "rpcbuf"]
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
from rpcbuf.dataplane.cuda_arena import CudaArena
a = CudaArena(2 << 20, 0, vmm=None)  # what rpcbufd's --gpu-backing auto picks, probe included
print("CUDA arena on device 0:", a.describe())
a.close()
sys.exit(0 if n else 1)
PYEOF

export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
export UCX_TLS=${UCX_TLS:-tcp}  # loopback, as CI; dataplane/ucx.py adds cuda_copy,cuda_ipc
export RPCBUF_UCX_CUDA=${RPCBUF_UCX_CUDA:-1}
export UCX_PROTO_INFO=${UCX_PROTO_INFO:-y}  # which protocol and transports carried each size
export RPCBUF_GPU_FIGURES=$FIGURES
PYTEST=("$VPY" -m pytest -q -rs -x --timeout=60 -p no:cacheprovider)

cd "$ROOT" || die "cannot enter $ROOT"
step vmm "$STEP_TIMEOUT" "${PYTEST[@]}" -m gpu -s tests/test_gpu_vmm.py

# The smoke start is a function of this shell (it must be able to stop the
# daemon it started), so it bounds itself: 60 s to get ready, 30 s per CLI call.
smoke() {
    "$VPY" -m rpcbuf.control.daemon --listen 127.0.0.1:0 --ucx-port 0 --secret-file "$tmp/secret" \
        --ready-file "$tmp/ready" --device cpu:256MiB --device cuda:0:1GiB \
        >"$tmp/daemon.log" 2>&1 &
    daemon_pid=$!
    local ok=1 addr token
    for _ in $(seq 600); do
        [[ -s "$tmp/ready" ]] && break
        kill -0 "$daemon_pid" 2>/dev/null || break
        sleep 0.1
    done
    if [[ -s "$tmp/ready" ]]; then
        addr=$(cut -d' ' -f1 "$tmp/ready")
        token=$(timeout 30 "$VPY" -m rpcbuf.cli token create --secret-file "$tmp/secret" \
                --tenant gpucheck) \
            && timeout 30 "$VPY" -m rpcbuf.cli devices --endpoint "$addr" --token "$token" \
                --json && ok=0
        kill -TERM "$daemon_pid"
        timeout 30 tail --pid="$daemon_pid" -f /dev/null || { ok=1; kill -KILL "$daemon_pid"; }
        wait "$daemon_pid" || ok=1
    else
        echo "rpcbufd did not start"
    fi
    daemon_pid=""
    cat "$tmp/daemon.log"
    return "$ok"
}
say "smoke: rpcbufd with a GPU arena"
t0=$SECONDS
smoke 2>&1 | tee "$OUTDIR/gpu-check-$STAMP.smoke.log"
rc=${PIPESTATUS[0]}
steps+=("smoke $rc $((SECONDS - t0))")
(( rc == 0 )) || failed+=("smoke (exit $rc)")

step pytest-gpu "$STEP_TIMEOUT" "${PYTEST[@]}" -m gpu --ignore=tests/test_gpu_vmm.py tests

step bench "$BENCH_TIMEOUT" "$VPY" "$ROOT/scripts/bench_gpu.py" --json "$BENCH_JSON" \
    --size "$BENCH_SIZE" --rounds "$BENCH_ROUNDS"
