#!/bin/bash
# S21D (kind nvidia-h200, one rank; carry [".carry"], .carry/vmain = git archive 19327bc): run_c.sh again after the
# LogFMT code became its own instantiation (the stamped 24-bit combine's span had grown 1 us in S21C): the LL test
# file, the soak, synccheck (racecheck ran in S21C); launch_gap.py alternating with 19327bc; the LL benchmark.
set -u
source benchmarks/experiments/device_env.sh  # exports, $M, $T
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s21d; mkdir -p $D
pack() { tar czf $OUT/s21d.tgz -C /tmp s21d; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|SUMMARY|verified|FAILED" $D/$name.log | sort | uniq -c | tail -n 6; pack; }
N=$(nvidia-smi -L | wc -l)
LG=$PWD/benchmarks/experiments/s20/launch_gap.py
run ll_tests 180 $M -n $N $T tests/gpu/test_low_latency.py
grep -a -E "logfmt|FAIL|Error" $D/ll_tests.log | head -20
(export CUPY_EP_TIMEOUT_S=15; run soak 90 $M -n $N python3 -m cupy_ep.soak --mode low-latency --iters 1000)
for tool in synccheck; do
  (export CUPY_EP_TIMEOUT_S=60; run san_$tool 120 $M -n $N compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 16 --check-every 1)
done
for v in head base head2 base2; do
  case $v in base*) dir=$PWD/.carry/vmain;; *) dir=$PWD;; esac
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 90 $M -n $N python3 $LG > $D/lg_$v.log 2>&1)
  echo "$v"; grep -a -h -E "rank 0|rror" $D/lg_$v.log | cut -c1-120; pack
done
run results_ll 300 $M -n $N python3 -m cupy_ep.bench --mode low-latency --out $D/results_ll
grep -a -E "^  ll_.*(graph|aligned|steady|host)" $D/results_ll.log | head -24
