#!/bin/bash
# Device run S11A: the intranode GPU tests (zero-copy dispatch included), then the normal-mode benchmark.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s11a; mkdir -p $D
export CUPY_EP_COMMIT=$(cat .carry/commit)
echo "commit $CUPY_EP_COMMIT"
trap 'tar czf $OUT/s11a.tgz -C /tmp s11a' EXIT
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 200 $M -n 2 $T tests/gpu/test_intranode.py > $D/intranode_tests.log 2>&1; echo "intranode tests rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error|rank" $D/intranode_tests.log | head -n 30
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 330 $M -n 2 python3 -m cupy_ep.bench --out $D/bench > $D/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s)-s ))s"; grep -a -E "ceiling|verified|FAILED|Error|sms= 24|zero" $D/bench.log | head -n 60
