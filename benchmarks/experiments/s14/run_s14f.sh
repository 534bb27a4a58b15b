#!/bin/bash
# Device run S14F: where the expert side's first remote batch spends its time (vS2 = 3440986 with stamps moved:
# owner blocks stamp nothing in recv_*; the expert side's recv_start = entering the batch, recv_prepared = ids in
# (prepare's first sync), recv_first_data = counted (second sync), recv_end = prepared (the caller's sync),
# send_prepared = the first token's partial sums done (loads landed), send_end = its row stored).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
M="mpirun --oversubscribe --bind-to none"
D=$OUT/s14f; mkdir -p $D
s=$(date +%s); (cd .carry/vS2 && CUPY_EP_COMMIT=vS2 PYTHONPATH=$PWD timeout 90 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --iters 30 --ll-token-sweep 128 --ll-stamps --out $D/llb_vS2 > $D/ll_bench_vS2.log 2>&1)
echo "ll bench vS2 rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_comb.*(steady|phases|slowest)|VERIF|Error" $D/ll_bench_vS2.log | head -20
