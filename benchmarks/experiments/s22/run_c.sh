#!/bin/bash
# S22C (kind nvidia-h200: one GPU; carry [".carry"]): the two test fixes after S22B's 4-rank run (the late-rank
# test's delay where ranks share the GPU; the format check skipped for order-sensitive rows): the LL files over
# IPC at 4 and 2 ranks sharing the GPU, then at one rank on NVSHMEM.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s22c; mkdir -p $D
pack() { tar czf $OUT/s22c.tgz -C /tmp s22c; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|verified" $D/$name.log | sort | uniq -c | tail -n 6; pack; }
F="tests/gpu/test_low_latency.py tests/gpu/test_zz_low_latency_timeout.py"
(export CUPY_EP_LL_TRANSPORT=ipc; run ll_ipc_n4 200 $M -n 4 $T $F; run ll_ipc_n2 150 $M -n 2 $T $F;
 export CUPY_EP_TIMEOUT_S=15; run soak_ipc_n4 100 $M -n 4 python3 -m cupy_ep.soak --mode low-latency --iters 200)
run ll_nvshmem_n1 150 $M -n 1 $T $F
