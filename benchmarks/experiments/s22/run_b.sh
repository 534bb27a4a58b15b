#!/bin/bash
# S22B (kind nvidia-h200: one GPU; carry [".carry"]): after S22A (the IPC transport at 1 and 2 ranks):
#   part 1: the NVSHMEM build still passes (LL file, one rank: the ll_transport.cuh refactor and the StoreToTargets
#           functor), the IPC transport at 4 ranks sharing the GPU, and the LL benchmark on NVSHMEM at one rank
#           (A/B with S22A's IPC run, same session);
#   part 2 ("suite"): the whole tests/gpu at 2 ranks sharing the GPU with CUPY_EP_LL_TRANSPORT=ipc.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
part=${1:-1}
D=/tmp/s22b$part; mkdir -p $D
pack() { tar czf $OUT/s22b$part.tgz -C /tmp s22b$part; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|verified" $D/$name.log | sort | uniq -c | tail -n 6; pack; }
if [ "$part" = 1 ]; then
    run ll_nvshmem_n1 150 $M -n 1 $T tests/gpu/test_low_latency.py tests/gpu/test_nvshmem.py
    (export CUPY_EP_LL_TRANSPORT=ipc; run ll_ipc_n4 240 $M -n 4 $T tests/gpu/test_low_latency.py tests/gpu/test_zz_low_latency_timeout.py)
    run bench_nvshmem_n1 120 $M -n 1 python3 -m cupy_ep.bench --mode low-latency --out $D/results_ll
    grep -a -E "^  ll_.*(graph|aligned|steady) " $D/bench_nvshmem_n1.log | head -16
else
    (export CUPY_EP_LL_TRANSPORT=ipc; run suite_ipc_n2 560 $M -n 2 $T tests/gpu)
fi
