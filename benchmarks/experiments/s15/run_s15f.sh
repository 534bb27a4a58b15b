#!/bin/bash
# Device run S15F: the whole GPU suite on the final kernels (de953e3 = d9aaed4's code plus docs).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
mkdir -p $OUT/s15f
echo "commit $(cat .carry/commit)"
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 190 $M -n 2 $T tests/gpu > $OUT/s15f/gpu_tests.log 2>&1; echo "gpu suite rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error" $OUT/s15f/gpu_tests.log | head -n 8
