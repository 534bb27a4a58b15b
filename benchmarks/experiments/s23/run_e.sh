#!/bin/bash
# S23E (kind nvidia-h200; carry [".carry"]): the benchmark with two ranks on the one GPU now stops with a message
# (NCCL refuses two ranks per GPU; S23A died in NCCL_ERROR_INVALID_USAGE), and at one rank the low-latency benchmark
# still builds its NCCL baseline (a short run, not a results run).
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
logs_in s23e
RUN_GREP="cupy_ep.bench|Error|verified|OK|warm start"
run bench_shared 120 $M -n 2 python3 -m cupy_ep.bench --sms 24 --token-sweep "" --iters 5 --warmup 1 --out $D/bench
run bench_ll1 200 $M -n 1 python3 -m cupy_ep.bench --mode low-latency --iters 20 --ll-token-sweep "" --out $D/ll
