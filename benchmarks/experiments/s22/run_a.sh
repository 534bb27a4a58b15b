#!/bin/bash
# S22A (kind nvidia-h200: one GPU; carry [".carry"]): the low-latency path over the CUDA-IPC transport
# (Buffer(low_latency_transport="ipc")): the LL file at one rank, then 2 ranks sharing the GPU (every peer path:
# NVLink-free here, but the same stores, signals and waits as two GPUs), the dead-peer timeout test, a 2-rank
# soak, and the LL benchmark at one rank on the IPC build.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s22a; mkdir -p $D
pack() { tar czf $OUT/s22a.tgz -C /tmp s22a; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|verified|Error" $D/$name.log | sort | uniq -c | tail -n 6; pack; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export CUPY_EP_LL_TRANSPORT=ipc
run ll_ipc_n1 150 $M -n 1 $T tests/gpu/test_low_latency.py
run ll_ipc_n2 240 $M -n 2 $T tests/gpu/test_low_latency.py tests/gpu/test_zz_low_latency_timeout.py
(export CUPY_EP_TIMEOUT_S=15; run soak_ipc_n2 90 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 300)
run bench_ipc_n1 120 $M -n 1 python3 -m cupy_ep.bench --mode low-latency --ll-transport ipc --out $D/results_ll
grep -a -E "^  ll_.*(graph|aligned|steady) " $D/bench_ipc_n1.log | head -16
