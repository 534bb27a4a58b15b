#!/bin/bash
# S21B (kind nvidia-h200, one rank; carry [".carry"], .carry/vmain = git archive 19327bc: main before the wait-cost
# stats): the LL test file with the new wait-cost tests, soak and racecheck; graph_ab.py alternating the stats
# commit against 19327bc (the stats are off there: nothing should move); module_gap.py; launch_gap.py once.
set -u
source benchmarks/experiments/device_env.sh  # exports, $M, $T
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s21b; mkdir -p $D
pack() { tar czf $OUT/s21b.tgz -C /tmp s21b; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|SUMMARY|rank 0" $D/$name.log | sort | uniq -c | tail -n 6; pack; }
N=$(nvidia-smi -L | wc -l)
GA=$PWD/benchmarks/experiments/s20/graph_ab.py
run ll_tests 150 $M -n $N $T tests/gpu/test_low_latency.py
grep -a -E "wait_cost|FAIL|Error" $D/ll_tests.log | head -20
(export CUPY_EP_TIMEOUT_S=15; run soak 60 $M -n $N python3 -m cupy_ep.soak --mode low-latency --iters 1000)
(export CUPY_EP_TIMEOUT_S=60; run racecheck 100 $M -n $N compute-sanitizer --tool racecheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1)
run module_gap 90 $M -n $N python3 benchmarks/experiments/s21/module_gap.py
for v in head base head2 base2; do
  case $v in base*) dir=$PWD/.carry/vmain;; *) dir=$PWD;; esac
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 90 $M -n $N python3 $GA > $D/ga_$v.log 2>&1)
  echo "$v"; grep -a -h -E "graph2|graph20|queued2|rror" $D/ga_$v.log | cut -c1-200; pack
done
run launch_gap 90 $M -n $N python3 benchmarks/experiments/s20/launch_gap.py
