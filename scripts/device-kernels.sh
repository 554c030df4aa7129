#!/usr/bin/env bash
# The real HybridEP and DeepEP kernels on a lent GPU (issue 55), in one run. Written into
# .build/device-kernels/run.sh by `scripts/device-check kernels prepare`, which carries the
# deep_ep source and the two trees beside it; run there from the repository root:
#
#   bash .build/device-kernels/run.sh        (device tool: carry [".build/device-kernels"])
#
# It reads only its own folder and the repository's tracked files. Each step is bounded
# (`timeout`) and logged to $OUT/<step>.log (default: the folder's out/); a step that fails is
# reported with the tail of its log and the next step still runs. Steps: the machine's facts;
# deep_ep built in place (TORCH_CUDA_ARCH_LIST=9.0, intranode only: NVSHMEM hidden from its
# setup.py, which then builds without it); the import; the memory report with the real
# kernels, HybridEP then DeepEP, the two ranks sharing the one GPU (the process group over gloo,
# the kernels' transfers over CUDA IPC; the CUDA MPS daemon started where it exists, so the two
# processes' kernels can run at once).
set -uo pipefail
K="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$K/../.." && pwd)"
cd "$ROOT" || exit 2
OUT="${OUT:-$K/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 NO_VCS_VERSION=1
export MOE_RELEASE_BASE_TREE="$K/trees/base" MOE_RELEASE_TREE="$K/trees/patched"
failed=()

step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s, $(date +%T))"
    local t0=$SECONDS rc
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    tail -n 30 "$OUT/$name.log"
    [ "$rc" -eq 0 ] || failed+=("$name")
    return "$rc"
}

facts() {
    cat "$K/SOURCE.txt"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    nvcc --version | tail -n 2
    "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__,
        "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
    nproc
}

build() {
    cd "$K/deep_ep" || return 2
    # Intranode only: setup.py builds without NVSHMEM where it cannot find it (setup.py:213-221
    # at 94a9f8f); hide the nvidia.nvshmem wheel the image has from it.
    TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS="$(nproc)" "$PY" - <<'EOF'
import importlib.util, runpy, sys
find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.startswith("nvidia.nvshmem") else find(name, *a)
sys.argv = ["setup.py", "build_ext", "--inplace"]
runpy.run_path("setup.py", run_name="__main__")
EOF
}

install() {
    # Every process (the report's ranks too, whose PYTHONPATH the launcher sets) imports it.
    local site
    site="$("$PY" -c 'import site; print(site.getsitepackages()[0])')" || return 2
    echo "$K/deep_ep" >"$site/moe_release_deep_ep.pth"
    "$PY" -c 'import deep_ep; print(deep_ep.__file__, deep_ep.Buffer, deep_ep.HybridEPBuffer)'
}

report() {
    "$PY" scripts/memory_report.py --device cuda --kernels deep_ep --backend "$1" --rounds 1 \
        --out "$OUT/report-$1"
}

step facts 30 facts
if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    nvidia-cuda-mps-control -d && echo "== MPS daemon started" || echo "== MPS daemon not started"
fi
if step build 300 build && step import 30 install; then
    step report-hybridep 90 report hybridep
    step report-deepep 90 report deepep
fi
echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || true
echo "== failed steps: ${failed[*]:-none}"
[ "${#failed[@]}" -eq 0 ]
