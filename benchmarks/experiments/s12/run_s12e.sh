#!/bin/bash
# Device run S12E (final, part 1): the whole GPU suite (2 ranks), then the normal-mode benchmark.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s12e; mkdir -p $D
export CUPY_EP_COMMIT=$(cat .carry/commit)
echo "commit $CUPY_EP_COMMIT"
trap 'tar czf $OUT/s12e.tgz -C /tmp s12e' EXIT
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 240 $M -n 2 $T tests/gpu > $D/gpu_tests.log 2>&1; echo "gpu suite rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED" $D/gpu_tests.log | head -n 12
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 300 $M -n 2 python3 -m cupy_ep.bench --out $D/bench > $D/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s)-s ))s"; grep -a -E "ceiling|verified|FAILED|Error" $D/bench.log | head -n 10
