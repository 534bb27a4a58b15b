#!/usr/bin/env bash
# GPU check for the 2x H200 machine (the image's python3, CuPy and system MPI; nothing is installed from a
# registry there). Run from the repo root of the copied working tree, with .carry/ carried along:
#
#   bash scripts/gpu_check.sh                         # every step
#   GPU_CHECK_STEPS="nvidia_smi gpu2" bash scripts/gpu_check.sh
#
# Steps (in this order): nvidia_smi unit gpu2 gpu4 gpu8 llipc mps internode torchrun bench llbench soak sanitize
#   nvidia_smi  GPUs, links and software versions
#   unit        the single-process tests (tests/unit, and those of tests/multirank that need no second rank)
#   gpuN        tests/gpu under the MPI launcher with N ranks (4 and 8: several ranks per GPU), without
#               tests/gpu/internode
#   llipc       tests/gpu/low_latency but test_nvshmem.py over the CUDA-IPC transport (CUPY_EP_LL_TRANSPORT=ipc)
#               at LLIPC_RANKS (default "4 8") ranks, several per GPU (NVSHMEM refuses that, so gpu4 / gpu8 skip
#               them)
#   mps         ranks sharing each GPU as CUDA MPS clients of a private MPS control daemon (started and stopped
#               here, its pipe and log folders in a temporary folder): tests/gpu/low_latency on NVSHMEM (which
#               refuses ranks sharing a GPU without MPS) at MPS_RANKS_PER_GPU (default 2) ranks per GPU, then the
#               rest of tests/gpu likewise; the kernels of the ranks on one GPU run at the same time there. Each
#               rank gets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$MPS_THREAD_PERCENTAGE (default 100 / ranks per GPU;
#               empty: unset), so that the kernels run on provisioned shares; MPS_PARTS="ll rest" (default) picks
#               the parts ("torchrun": the torchrun step's tests as MPS clients, steps named mps_torchrun<N>)
#   internode   tests/gpu/internode at 2 ranks (2 nodes x 1 GPU) and 4 ranks (2 nodes x 2, IPC transport)
#   torchrun    under torchrun (torch.distributed, gloo; no MPI) at TORCHRUN_RANKS (default 2) ranks:
#               tests/gpu/intranode/test_intranode.py, low_latency/test_low_latency.py (CUPY_EP_LL_TRANSPORT=ipc:
#               2 ranks may share a GPU) and common/test_streams.py, then examples/moe_layer.py; skipped where
#               torch is not installed (TORCHRUN_TESTS: other test paths, e.g. "tests/gpu/common tests/gpu/intranode
#               tests/gpu/low_latency"). Ranks sharing a GPU as MPS clients: start the step inside an MPS daemon's
#               environment (CUDA_MPS_PIPE_DIRECTORY set)
#   bench       python -m cupy_ep.bench --out $OUT_DIR at 2 ranks
#   llbench     python -m cupy_ep.bench --mode low-latency --out $OUT_DIR at 2 ranks
#   soak        python -m cupy_ep.soak (SOAK_ITERS, default 10000) at 2 ranks, then --zero-copy at 12 and 24 SMs
#               (SOAK_ZC_ITERS, default 2000 each)
#   sanitize    scripts/sanitize.sh: compute-sanitizer memcheck/racecheck/synccheck/initcheck at 2 ranks
# Every step's output goes to $OUT_DIR/<step>.log (OUT_DIR=${OUT:-./out}). A failed step is recorded and
# the next one runs; the script ends with a table of step -> rc and counts, and exits 1 if any step failed.
# EP_STEP_TIMEOUT_S=N kills a step after N seconds (useful under a per-command time limit).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
exec 2>&1  # one stream, so the closing summary line is really the last line
export CUPY_EP_SKIP_INSTALL=1
# shellcheck source=scripts/_env.sh
source scripts/_env.sh
ep_setup_python || exit 1

OUT_DIR="${OUT:-./out}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
export EP_LOG_DIR="$OUT_DIR"
export PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-/tmp/cupy_ep_gpu_check/cupy_kernel_cache}"
export CUPY_EP_CACHE_DIR="${CUPY_EP_CACHE_DIR:-/tmp/cupy_ep_gpu_check/cupy_ep_cache}"
mkdir -p "$CUPY_CACHE_DIR" "$CUPY_EP_CACHE_DIR"

# Python packages the image lacks (pytest-mpi) come as wheels in .carry/wheels.
shopt -s nullglob
wheels=(.carry/wheels/*.whl)
shopt -u nullglob
if ((${#wheels[@]})); then
    site=/tmp/site
    mkdir -p "$site"
    if ! "$EP_PYTHON" -m pip install --disable-pip-version-check -q --no-index --no-deps --upgrade \
        --target "$site" "${wheels[@]}"; then
        # Pure-python wheels are zip files: unpacking them is an install.
        ep_log "[env] pip failed; unpacking the wheels into $site"
        for w in "${wheels[@]}"; do "$EP_PYTHON" -m zipfile -e "$w" "$site" || exit 1; done
    fi
    export PYTHONPATH="$site:$PYTHONPATH"
    ep_log "[env] wheels from .carry/wheels in $site: ${wheels[*]##*/}"
else
    ep_log "[env] no .carry/wheels/*.whl (pytest-mpi must already be installed)"
fi

ALL_STEPS="nvidia_smi unit gpu2 gpu4 gpu8 llipc mps internode torchrun bench llbench soak sanitize"
STEPS="${GPU_CHECK_STEPS:-$ALL_STEPS}"
for s in $STEPS; do
    [[ " $ALL_STEPS " == *" $s "* ]] || ep_record "$s" - - - - FAILED "unknown step (known: $ALL_STEPS)"
done
want() { [[ " $STEPS " == *" $1 "* ]]; }

machine_info() {
    nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || return 1
    nvidia-smi topo -m || true
    "$EP_PYTHON" -c '
import sys, cupy, numpy
print("python", sys.version.split()[0], sys.executable)
print("cupy", cupy.__version__, "| numpy", numpy.__version__)
print("CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "| driver", cupy.cuda.runtime.driverGetVersion(),
      "| devices", cupy.cuda.runtime.getDeviceCount())
import importlib.metadata as md
for name in ("pytest", "pytest-mpi", "pytest-timeout", "mpi4py", "ml_dtypes", "nvidia-cuda-nvrtc"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "MISSING")
from mpi4py import MPI
print("MPI:", MPI.Get_library_version().splitlines()[0])' || return 1
    ep_resolve_launcher || return 1
    echo "launcher: ${EP_LAUNCHER[*]}"
    env | grep -E '^(NCCL_NVLS_ENABLE|NVSHMEM_DISABLE_NVLS|TORCH_SYMM_MEM_DISABLE_MULTICAST|CUPY_|PYTHONPATH)=' | sort
}

want nvidia_smi && ep_plain_step nvidia_smi machine_info
want unit && ep_pytest_step unit 0 -q -p no:cacheprovider --timeout=900 --timeout-method=thread \
    tests/unit tests/multirank
for n in 2 4 8; do
    # The internode tests have their own step (2 ranks: 2 nodes x 1 GPU; 4 ranks: 2 x 2 over the IPC transport).
    want "gpu$n" && ep_pytest_step "gpu$n" "$n" --with-mpi -q -p no:cacheprovider --color=no \
        --timeout=900 --timeout-method=thread tests/gpu -rs --ignore=tests/gpu/internode
done
if want llipc; then
    export CUPY_EP_LL_TRANSPORT=ipc
    for n in ${LLIPC_RANKS:-4 8}; do
        ep_pytest_step "llipc$n" "$n" --with-mpi -q -p no:cacheprovider --color=no --timeout=900 \
            --timeout-method=thread tests/gpu/low_latency -rs --ignore=tests/gpu/low_latency/test_nvshmem.py
    done
    unset CUPY_EP_LL_TRANSPORT
fi
mps_stop() {  # quit the private MPS daemon (if it runs) and keep its control log
    [[ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]] || return 0
    echo quit | nvidia-cuda-mps-control
    sleep 1
    cp "$CUDA_MPS_LOG_DIRECTORY/control.log" "$OUT_DIR/mps_control.log" 2>/dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
}
# torchrun_step PREFIX: the torchrun part (step names PREFIX + "torchrun<N>"), inside or outside the MPS daemon
torchrun_step() {
    local prefix="$1" n="${TORCHRUN_RANKS:-2}"
    if ! "$EP_PYTHON" -c 'import torch.distributed' >/dev/null 2>&1; then
        ep_record "${prefix}torchrun" - 0 0 1 ok "torch is not installed: skipped"
        return 0
    fi
    local files default="tests/gpu/intranode/test_intranode.py tests/gpu/low_latency/test_low_latency.py"
    read -r -a files <<< "${TORCHRUN_TESTS:-$default tests/gpu/common/test_streams.py}"
    CUPY_EP_LL_TRANSPORT=ipc ep_pytest_step "${prefix}torchrun$n" "torchrun:$n" --with-torchrun -q -p no:cacheprovider \
        --color=no --timeout=300 --timeout-method=thread -rs "${files[@]}"
    if "$EP_PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1; then
        ep_plain_step "${prefix}moe_torchrun$n" timeout -k 10 300 env CUPY_EP_BACKEND=cuda "$EP_PYTHON" \
            -m torch.distributed.run --standalone --nproc-per-node "$n" examples/moe_layer.py
    fi
}
if want mps; then
    per_gpu="${MPS_RANKS_PER_GPU:-2}"
    n=$(( per_gpu * $(ep_num_gpus) ))  # counted before the daemon starts: CUDA in this shell stays outside MPS
    mps_dir="$(mktemp -d /tmp/cupy_ep_mps.XXXXXX)"
    mkdir -p "$mps_dir/pipe" "$mps_dir/log"
    pct="${MPS_THREAD_PERCENTAGE-$((100 / per_gpu))}"
    if ! command -v nvidia-cuda-mps-control >/dev/null; then
        ep_record mps 1 - - - FAILED "nvidia-cuda-mps-control is not on PATH"
    elif ! CUDA_MPS_PIPE_DIRECTORY="$mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$mps_dir/log" nvidia-cuda-mps-control -d
    then
        ep_record mps 1 - - - FAILED "the MPS control daemon did not start"
    else
        export CUDA_MPS_PIPE_DIRECTORY="$mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$mps_dir/log"
        [[ -n "$pct" ]] && export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="$pct"
        echo "mps: $n ranks, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${pct:-unset}"
        trap mps_stop EXIT  # a killed step must not leave the daemon running
        [[ " ${MPS_PARTS:-ll rest} " == *" ll "* ]] && ep_pytest_step "mps_ll$n" "$n" --with-mpi -q -p no:cacheprovider --color=no --timeout=900 \
            --timeout-method=thread tests/gpu/low_latency -rs
        [[ " ${MPS_PARTS:-ll rest} " == *" rest "* ]] && ep_pytest_step "mps_rest$n" "$n" --with-mpi -q -p no:cacheprovider --color=no --timeout=900 \
            --timeout-method=thread tests/gpu -rs --ignore=tests/gpu/low_latency
        [[ " ${MPS_PARTS:-ll rest} " == *" torchrun "* ]] && torchrun_step mps_
        mps_stop
        trap - EXIT
    fi
fi
for n in 2 4; do
    want internode && ep_pytest_step "internode$n" "$n" --with-mpi -q -p no:cacheprovider --color=no \
        --timeout=300 --timeout-method=thread tests/gpu/internode -rs
done
want torchrun && torchrun_step ""
if want bench; then
    ep_mpirun_argv 2 "$EP_PYTHON" -m cupy_ep.bench --out "$OUT_DIR" && ep_plain_step bench "${EP_ARGV[@]}"
fi
if want llbench; then
    ep_mpirun_argv 2 "$EP_PYTHON" -m cupy_ep.bench --mode low-latency --out "$OUT_DIR" && ep_plain_step llbench "${EP_ARGV[@]}"
fi
if want soak; then
    ep_mpirun_argv 2 "$EP_PYTHON" -m cupy_ep.soak --iters "${SOAK_ITERS:-10000}" && ep_plain_step soak "${EP_ARGV[@]}"
    # zero-copy dispatch/combine: every block does both at 12 SMs, the own rows have blocks of their own at 24
    for sms in 12 24; do
        ep_mpirun_argv 2 "$EP_PYTHON" -m cupy_ep.soak --zero-copy --num-sms "$sms" --iters "${SOAK_ZC_ITERS:-2000}" \
            && ep_plain_step "soak_zero_copy_$sms" "${EP_ARGV[@]}"
    done
fi
want sanitize && ep_plain_step sanitize bash scripts/sanitize.sh

# The table goes to stdout only: the device tool brings back at most 8 files from $OUT.
ep_summary
