#!/bin/bash
# S21E (kind nvidia-h200; carry [".carry"]): the whole tests/gpu at one rank, then at two ranks sharing the GPU (the
# low-latency files skip there: NVSHMEM needs a GPU per rank), on the session's final kernels.
set -u
source benchmarks/experiments/device_env.sh  # exports, $M, $T
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s21e; mkdir -p $D
pack() { tar czf $OUT/s21e.tgz -C /tmp s21e; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed" $D/$name.log | sort | uniq -c | tail -n 4; pack; }
run gpu1 280 $M -n 1 $T tests/gpu
grep -a -E "^FAILED|^ERROR" $D/gpu1.log | head
run gpu2_shared 230 $M -n 2 $T tests/gpu
grep -a -E "^FAILED|^ERROR" $D/gpu2_shared.log | head
