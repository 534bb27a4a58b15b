#!/bin/bash
# Device run S11B: zero-copy dispatch, fused writers vs a local/remote role split.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
M="mpirun --oversubscribe --bind-to none"
D=/tmp/s11b; mkdir -p $D
trap 'tar czf $OUT/s11b.tgz -C /tmp s11b' EXIT
s=$(date +%s); PYTHONPATH=$PWD timeout 300 $M -n 2 python3 benchmarks/experiments/zero_copy_s11/exp_direct_split.py > $D/split.log 2>&1; echo "split rc=$? $(( $(date +%s)-s ))s"; cat $D/split.log | tail -30
