#!/bin/bash
# S23A (kind nvidia-h200: one GPU; carry [".carry"]): issue 4's warm start with cupy_ep.start_mpi (MPI_Init through
# ctypes, the imports and CuPy's runtime start in a thread meanwhile) against the usual start (`from mpi4py import
# MPI` first): startup_probe.py once cold (compiles), then five times each way, alternating, two ranks sharing the
# GPU; then the real main job's start (python -m cupy_ep.bench, one short run) to show its MPI start is overlapped.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
logs_in s23a
RUN_GREP="^rank|warm start|Error|error"
SP=benchmarks/experiments/s23/startup_probe.py
run probe_cold 150 $M -n 2 python3 $SP
for i in 1 2 3 4 5; do
    run probe_ovl_$i 60 $M -n 2 python3 $SP
    run probe_plain_$i 60 $M -n 2 python3 $SP --plain
done
run bench_main 240 $M -n 2 python3 -m cupy_ep.bench --sms 24 --token-sweep "" --iters 5 --warmup 1 --out $D/bench
