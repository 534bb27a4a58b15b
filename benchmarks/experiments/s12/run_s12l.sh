#!/bin/bash
# Device run S12L (final): the whole GPU suite (2 ranks), a zero-copy soak, then the normal-mode benchmark.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=$OUT/s12l; mkdir -p $D
export CUPY_EP_COMMIT=$(cat .carry/commit)
echo "commit $CUPY_EP_COMMIT"
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 200 $M -n 2 $T tests/gpu > $D/gpu_tests.log 2>&1; echo "gpu suite rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED" $D/gpu_tests.log | head -n 6
s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 40 $M -n 2 python3 -m cupy_ep.soak --zero-copy --num-sms 24 --iters 1000 > $D/soak_zc_24.log 2>&1; echo "soak zero-copy 24 SMs rc=$? $(( $(date +%s)-s ))s"; grep -a -E "mismatch|Error" $D/soak_zc_24.log | tail -n 2
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 200 $M -n 2 python3 -m cupy_ep.bench --out $D/bench > $D/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s)-s ))s"; grep -a -E "ceiling|verified|FAILED|Error" $D/bench.log | head -n 6
