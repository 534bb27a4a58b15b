#!/usr/bin/env bash
# The test command of the README (and of CI, through .ci/run).
#
#   scripts/test.sh
#
# 1. creates or reuses a venv (${CUPY_EP_VENV:-.venv}) and installs the package with its test extras from
#    wheels (CUPY_EP_SKIP_INSTALL=1 skips this and uses python/mpiexec from PATH), and torch's CPU build
#    (torch==2.13.0) when the venv has no torch (the autograd tests and the MoE example need it; without torch
#    they are skipped);
# 2. runs the single-process tests (tests/unit, and those of tests/multirank that need no second rank), then
#    the MPI tests (tests/multirank) at 2 and 4 ranks, then the README's
#    quick start (examples/quickstart.py) at 2 ranks and the MoE example (examples/moe_layer.py) at 2 and 4 ranks,
#    on the host backend; then the same under torchrun at 2 and 4 ranks (torch.distributed over gloo, through
#    cupy_ep.bootstrap's torch adapter; mpi4py's MPI is never imported there): the adapter's tests, the host-backend
#    tests (pytest --with-torchrun -m mpi), the quick start and the MoE example;
# 3. when a GPU is visible, runs tests/gpu with one rank per GPU, then the low-latency files at 2 ranks over the
#    CUDA-IPC transport (ranks share the GPU on a one-GPU machine), then the MoE example (one rank per GPU, 2
#    at least).
# Fails when a step fails or a step ran no test; ends with the line "N passed, N failed, N skipped".
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec 2>&1  # one stream, so the closing summary line is really the last line
# shellcheck source=scripts/_env.sh
source scripts/_env.sh
ep_setup_python
has_torch() { "$EP_PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; }
if [[ -n "$EP_VENV" ]] && ! has_torch; then
    # Pinned: pip takes this CPU build from the machine's wheels; an unpinned torch pulls a CUDA build of several GB.
    ep_log "[env] pip install torch==2.13.0 (CPU) into $EP_VENV"
    "$EP_PYTHON" -m pip install --disable-pip-version-check --no-input -q --only-binary=:all: torch==2.13.0
fi

# moe_step NAME NRANKS [ENV...]: examples/moe_layer.py under the launcher (it exits non-zero on a mismatch).
moe_step() {
    local name="$1" n="$2"
    shift 2
    if ! has_torch; then
        ep_record "$name" - 0 0 1 ok "torch is not installed: skipped"
    elif ep_mpirun_argv "$n" "$EP_PYTHON" examples/moe_layer.py; then
        ep_plain_step "$name" timeout -k 10 300 env "$@" "${EP_ARGV[@]}"
    else
        ep_record "$name" - - - - FAILED "no MPI launcher"
    fi
}

common=(-q -p no:cacheprovider --timeout=600 --timeout-method=thread)

# Lint: ruff (its configuration in pyproject.toml) and clang-format for cuda_src/ (.clang-format), from the test
# extra; with CUPY_EP_SKIP_INSTALL=1 on an interpreter without them the step says so and counts as failed.
lint() {
    "$EP_PYTHON" -m ruff check --no-cache . || return 1
    local fmt
    fmt="$(dirname "$EP_PYTHON")/clang-format"
    [[ -x "$fmt" ]] || fmt="$(command -v clang-format)" || { echo "clang-format is not installed"; return 1; }
    find cuda_src -name '*.cu' -o -name '*.cuh' | sort | xargs "$fmt" --style=file --dry-run -Werror
}
ep_plain_step lint lint
# tests/unit holds no MPI-marked test (tests/unit/test_tiers.py checks): the MPI steps run tests/multirank alone.
ep_pytest_step unit 0 "${common[@]}" tests/unit tests/multirank
for n in 2 4; do
    ep_pytest_step "mpi$n" "$n" --only-mpi "${common[@]}" --color=no tests/multirank
done
# The README's quick start exactly as a user runs it, on the host backend (it exits non-zero on a mismatch).
if ep_mpirun_argv 2 "$EP_PYTHON" examples/quickstart.py; then
    ep_plain_step quickstart timeout -k 10 300 env CUPY_EP_BACKEND=host "${EP_ARGV[@]}"
else
    ep_record quickstart - - - - FAILED "no MPI launcher"
fi
# The MoE example: cupy_ep.torch's autograd through a small MoE block, against the same model computed densely.
for n in 2 4; do
    moe_step "moe$n" "$n" CUPY_EP_BACKEND=host
done

# torchrun: the MPI-marked tests with their comm fixture over torch.distributed (gloo), then the examples unchanged.
# The tools (python -m cupy_ep.bench, .soak, .tune) under torchrun are tests/unit/test_tools_torchrun.py, in the unit
# step: each test starts its own torchrun (and the mpiexec run it compares with).
torch_tests=(tests/multirank/test_torch_bootstrap.py tests/multirank/test_host_backend.py
             tests/multirank/test_host_low_latency.py tests/multirank/test_host_faults.py
             tests/multirank/test_torch_layer.py tests/multirank/test_topology.py
             tests/multirank/test_cuda_low_latency_shrink.py tests/multirank/test_bad_inputs.py)
torchrun_argv() { EP_ARGV=(env CUPY_EP_BACKEND=host "$EP_PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$@"); }
for n in 2 4; do
    if ! has_torch; then
        ep_record "torchrun$n" - 0 0 1 ok "torch is not installed: skipped"
        continue
    fi
    ep_pytest_step "torchrun$n" "torchrun:$n" --with-torchrun -m mpi "${common[@]}" --color=no "${torch_tests[@]}"
    torchrun_argv "$n" examples/moe_layer.py
    ep_plain_step "moe-torchrun$n" timeout -k 10 300 "${EP_ARGV[@]}"
done
if has_torch; then
    torchrun_argv 2 examples/quickstart.py
    ep_plain_step quickstart-torchrun timeout -k 10 300 "${EP_ARGV[@]}"
fi

gpu_rc=0
"$EP_PYTHON" -c '
import sys
try:
    import cupy_ep
except Exception as e:
    print(f"cannot import cupy_ep: {e!r}", file=sys.stderr)
    sys.exit(2)
sys.exit(0 if cupy_ep.gpu_available() else 1)' || gpu_rc=$?
if [[ "$gpu_rc" == 0 ]]; then
    ngpus="$(ep_num_gpus)"
    ((ngpus >= 1)) || ngpus=1
    echo ""
    echo "GPU visible: running tests/gpu with $ngpus rank(s), one per GPU"
    ep_pytest_step gpu "$ngpus" --with-mpi "${common[@]}" --color=no tests/gpu -rs
    # The low-latency files again at 2 ranks on the CUDA-IPC transport: on a one-GPU machine the ranks share the
    # GPU (which NVSHMEM refuses), so every peer path of the low-latency kernels runs there too.
    echo ""
    echo "Low-latency tests at 2 ranks over CUDA IPC (CUPY_EP_LL_TRANSPORT=ipc)"
    export CUPY_EP_LL_TRANSPORT=ipc
    ep_pytest_step gpu-ll-ipc 2 --with-mpi "${common[@]}" --color=no -rs \
        tests/gpu/low_latency/test_low_latency.py tests/gpu/low_latency/test_low_latency_timeout.py
    unset CUPY_EP_LL_TRANSPORT
    if "$EP_PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1; then
        moe_step moe-gpu "$((ngpus >= 2 ? ngpus : 2))" CUPY_EP_BACKEND=cuda  # 2 ranks share a lone GPU
    else
        ep_record moe-gpu - 0 0 1 ok "torch has no CUDA here: skipped"
    fi
elif [[ "$gpu_rc" == 1 ]]; then
    echo ""
    echo "GPU tests skipped: no GPU is present (tests/gpu not run)"
else
    ep_record gpu-check "$gpu_rc" - - - FAILED "could not import cupy_ep to look for a GPU"
fi

ep_summary
