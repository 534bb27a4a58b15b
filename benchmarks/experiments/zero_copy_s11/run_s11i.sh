#!/bin/bash
# Device run S11I: the intranode GPU tests at 4 ranks on 2 GPUs (two ranks per GPU; zero-copy at R = 4: every
# block does both, the combine's sender/reducer split at R = 4).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=30
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=200 --timeout-method=thread"
D=/tmp/s11i; mkdir -p $D
trap 'tar czf $OUT/s11i.tgz -C /tmp s11i' EXIT
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 330 $M -n 4 $T tests/gpu/test_intranode.py > $D/intranode_4ranks.log 2>&1; echo "4-rank intranode rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error" $D/intranode_4ranks.log | head -n 20
