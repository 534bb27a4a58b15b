#!/bin/bash
# Device run S16E on the stamped token sweep's commit (3c9afd4's kernels): the LL benchmark with stamps, where the
# 0-token calls are stamped too (what a call's fixed cost is made of).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
M="mpirun --oversubscribe --bind-to none"
D=/tmp/s16e; mkdir -p $D
pack() { tar czf $OUT/s16e.tgz -C /tmp s16e; }
s=$(date +%s); CUPY_EP_COMMIT=$(cat .carry/commit) PYTHONPATH=$PWD timeout 150 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --ll-stamps --iters 100 --out $D/llb > $D/ll_bench.log 2>&1
echo "ll bench rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady|phases|slowest)|VERIF|Error" $D/ll_bench.log | head -40; pack
