#!/usr/bin/env bash
# scripts/gpu-check.sh [LOG]: the CUDA test tier and a short benchmark, on a machine with a GPU.
#
# Everything goes to LOG (default: $OUT/gpu-check.log, or ./gpu-check.log without $OUT) and to
# the terminal. Uses the virtual environment $VENV (default ~/.cache/stepahead/gpu-venv) when its
# torch sees a GPU; otherwise creates it and installs the project there (torch==2.13.0 from PyPI
# is the CUDA build on Linux x86-64). Stages: the CUDA tier (pytest -m cuda, and the CUDA-gated
# sampler test), then sim and tiny, serial and overlap, through the services (tok/s, device busy,
# gap, overlap vs serial). The stages share an 8-minute budget; the exit status says whether all
# of them passed.
set -euo pipefail

cd "$(dirname "$0")/.."
LOG="${1:-${OUT:-.}/gpu-check.log}"
VENV="${VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/stepahead/gpu-venv}"
PYTHON="${PYTHON:-python3}"
PY="$VENV/bin/python"
DEADLINE=$((SECONDS + 480))
FAILED=()

mkdir -p "$(dirname "$LOG")"
exec > >(tee "$LOG") 2>&1

# The seconds a stage may take: at most $1, and never past the deadline.
budget() {
    local left=$((DEADLINE - SECONDS))
    if ((left < $1)); then echo $((left > 1 ? left : 1)); else echo "$1"; fi
}

# stage NAME MAX_SECONDS COMMAND...: runs COMMAND under the budget; a failure is noted, not fatal.
stage() {
    local name=$1 limit
    limit=$(budget "$2")
    shift 2
    printf '\n== %s (%s UTC, up to %ss)\n' "$name" "$(date -u +%H:%M:%S)" "$limit"
    if ! timeout "$limit" bash -c '"$@"' "$name" "$@"; then
        FAILED+=("$name")
    fi
}

cuda_torch() {
    [[ -x $PY ]] && "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

install() {
    "$PYTHON" -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet -e '.[dev]'
}

protos() {
    mkdir -p stepahead/v1
    "$PY" -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. protos/stepahead/v1/*.proto
    touch stepahead/v1/__init__.py
}

describe() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))'
    git log -1 --format='commit %h %s' || true
}

benchmark() {
    "$PY" - <<'EOF'
from bench.configs import QUICK, THIRD, Case, Configuration, Device, Plan, Workload
from bench.harness import run_plan
from bench.report import to_markdown

# The quick plan's sim and tiny workloads, serial and overlap over gRPC (no sweep), and smollm2.
cases = tuple(
    case
    for case in QUICK.cases
    if case.configuration.transport == "grpc" and not case.configuration.late_pick
)
smollm2 = Device("smollm2", ("--model", "smollm2", "--device", "cuda"))
workload = Workload(64, 16, 48, 64, THIRD, warmup_prompts=16)
cases += tuple(Case(Configuration(smollm2, mode, "grpc"), workload) for mode in ("serial", "overlap"))
run = run_plan(Plan("gpu-check", cases, sweep=None))
print(to_markdown(run, "scripts/gpu-check.sh", None))
EOF
}

export PY VENV PYTHON
export -f cuda_torch install protos describe benchmark
echo "gpu-check: log $LOG, venv $VENV"
cuda_torch || stage "install" 240 install
if ! cuda_torch; then
    echo "gpu-check: torch in $VENV sees no GPU; nothing to check"
    exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[[ -f stepahead/v1/worker_pb2.py ]] || stage "protos" 60 protos
stage "machine" 30 describe
stage "CUDA tier" 200 "$PY" -m pytest -m cuda -v -rA -s tests/
stage "CUDA sampler" 60 "$PY" -m pytest -v -rA tests/test_sampler.py -k cuda
stage "benchmark" 180 benchmark

printf '\n== done in %ss: ' "$SECONDS"
if ((${#FAILED[@]})); then
    echo "FAILED: ${FAILED[*]}"
    exit 1
fi
echo "all stages passed"
