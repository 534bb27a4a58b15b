#!/bin/bash
# S21C (kind nvidia-h200, one rank; carry [".carry"], .carry/vmain = git archive 19327bc: before the wait-cost stats
# and LogFMT): the LL test file (LogFMT tests among them), the soak (LogFMT in 20 % of its iterations), racecheck and
# synccheck over it (LogFMT's half-warp shuffles); launch_gap.py's combine pre/span/post alternating with 19327bc
# (the combine went from 121 to 127 registers); the LL results benchmark (ll_combine_logfmt row).
set -u
source benchmarks/experiments/device_env.sh  # exports, $M, $T
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s21c; mkdir -p $D
pack() { tar czf $OUT/s21c.tgz -C /tmp s21c; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|SUMMARY|verified|FAILED" $D/$name.log | sort | uniq -c | tail -n 6; pack; }
N=$(nvidia-smi -L | wc -l)
LG=$PWD/benchmarks/experiments/s20/launch_gap.py
run ll_tests 180 $M -n $N $T tests/gpu/test_low_latency.py
grep -a -E "logfmt|FAIL|Error" $D/ll_tests.log | head -20
(export CUPY_EP_TIMEOUT_S=15; run soak 90 $M -n $N python3 -m cupy_ep.soak --mode low-latency --iters 1000)
for tool in racecheck synccheck; do
  (export CUPY_EP_TIMEOUT_S=60; run san_$tool 120 $M -n $N compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 16 --check-every 1)
done
for v in head base head2 base2; do
  case $v in base*) dir=$PWD/.carry/vmain;; *) dir=$PWD;; esac
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 90 $M -n $N python3 $LG > $D/lg_$v.log 2>&1)
  echo "$v"; grep -a -h -E "rank 0|rror" $D/lg_$v.log | cut -c1-120; pack
done
run results_ll 300 $M -n $N python3 -m cupy_ep.bench --mode low-latency --out $D/results_ll
grep -a -E "^  ll_.*(graph|aligned|steady|host)" $D/results_ll.log | head -24
