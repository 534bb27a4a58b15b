#!/bin/bash
# Device run S11F: intranode GPU tests (zero-copy combine added), then the combine split experiment.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s11f; mkdir -p $D
trap 'tar czf $OUT/s11f.tgz -C /tmp s11f' EXIT
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 200 $M -n 2 $T tests/gpu/test_intranode.py -k "base or worst or seed1 or topk32" > $D/intranode_tests.log 2>&1; echo "intranode tests rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error" $D/intranode_tests.log | head -n 20
s=$(date +%s); PYTHONPATH=$PWD timeout 200 $M -n 2 python3 benchmarks/experiments/zero_copy_s11/exp_direct_combine.py > $D/combine.log 2>&1; echo "combine exp rc=$? $(( $(date +%s)-s ))s"; grep -a -E "sms=|ring|Error" $D/combine.log
