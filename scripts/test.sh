#!/usr/bin/env bash
# The test command of the README (and of CI, through .ci/run).
#
#   scripts/test.sh
#
# 1. creates or reuses a venv (${CUPY_EP_VENV:-.venv}) and installs the package with its test extras from
#    wheels (CUPY_EP_SKIP_INSTALL=1 skips this and uses python/mpiexec from PATH);
# 2. runs the single-process tests, then the MPI tests at 2 and 4 ranks (tests/gpu excluded), then the README's
#    quick start (examples/quickstart.py) at 2 ranks on the host backend;
# 3. when a GPU is visible, runs tests/gpu with one rank per GPU, then the low-latency files at 2 ranks over the
#    CUDA-IPC transport (ranks share the GPU on a one-GPU machine).
# Fails when a step fails or a step ran no test; ends with the line "N passed, N failed, N skipped".
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec 2>&1  # one stream, so the closing summary line is really the last line
# shellcheck source=scripts/_env.sh
source scripts/_env.sh
ep_setup_python

common=(-q -p no:cacheprovider --timeout=600 --timeout-method=thread)

ep_pytest_step unit 0 "${common[@]}" tests --ignore=tests/gpu
for n in 2 4; do
    ep_pytest_step "mpi$n" "$n" --only-mpi "${common[@]}" --color=no tests --ignore=tests/gpu
done
# The README's quick start exactly as a user runs it, on the host backend (it exits non-zero on a mismatch).
if ep_mpirun_argv 2 "$EP_PYTHON" examples/quickstart.py; then
    ep_plain_step quickstart timeout -k 10 300 env CUPY_EP_BACKEND=host "${EP_ARGV[@]}"
else
    ep_record quickstart - - - - FAILED "no MPI launcher"
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
        tests/gpu/test_low_latency.py tests/gpu/test_zz_low_latency_timeout.py
    unset CUPY_EP_LL_TRANSPORT
elif [[ "$gpu_rc" == 1 ]]; then
    echo ""
    echo "GPU tests skipped: no GPU is present (tests/gpu not run)"
else
    ep_record gpu-check "$gpu_rc" - - - FAILED "could not import cupy_ep to look for a GPU"
fi

ep_summary
