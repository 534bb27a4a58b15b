#!/bin/bash
# Device run S11C: intranode GPU tests (zero-copy role split by default at 16+ SMs), then the split experiment.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s11c; mkdir -p $D
trap 'tar czf $OUT/s11c.tgz -C /tmp s11c' EXIT
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 200 $M -n 2 $T tests/gpu/test_intranode.py > $D/intranode_tests.log 2>&1; echo "intranode tests rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error" $D/intranode_tests.log | head -n 20
s=$(date +%s); PYTHONPATH=$PWD timeout 200 $M -n 2 python3 benchmarks/experiments/zero_copy_s11/exp_direct_split.py 8:0,8:4,16:0,16:8,24:0,24:8,24:12,32:0,32:8,32:12,24:8 > $D/split.log 2>&1; echo "split rc=$? $(( $(date +%s)-s ))s"; grep -a -E "sms=|ring|Error" $D/split.log
