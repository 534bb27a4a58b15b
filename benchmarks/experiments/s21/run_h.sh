#!/bin/bash
# S21H (kind nvidia-h200, one rank; carry [".carry"]): the final kernels (after the review mend): the LL file, the
# soak, then the LL results benchmark (its JSON/markdown go to benchmarks/results/bench_ll_gpu_ep1.*).
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s21h; mkdir -p $D
pack() { tar czf $OUT/s21h.tgz -C /tmp s21h; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|verified" $D/$name.log | sort | uniq -c | tail -n 4; pack; }
run ll_tests 110 $M -n 1 $T tests/gpu/test_low_latency.py
(export CUPY_EP_TIMEOUT_S=15; run soak 30 $M -n 1 python3 -m cupy_ep.soak --mode low-latency --iters 1000)
run results_ll 110 $M -n 1 python3 -m cupy_ep.bench --mode low-latency --out $D/results_ll
grep -a -E "^  ll_.*(graph|aligned|steady) " $D/results_ll.log | head -16
