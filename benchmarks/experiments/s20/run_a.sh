#!/bin/bash
# Session 20, one GPU (nvidia-h200; the two-GPU kind was not lent). Carry [".carry"].
#  1. run_next.sh prologue: branch s19-prologue (.carry/vprologue) against HEAD, alternating, one rank; the branch's
#     LL tests, soaks and racecheck.
#  2. HEAD's GPU lines not run before (031499a misaligned x, 6efc381 check_values host copy, 228869f the LL bench's
#     host column with check_values=True): the LL test file and the LL results benchmark at one rank.
set -u
cp -r benchmarks/experiments/s19/run_next.sh /tmp/run_next.sh
bash /tmp/run_next.sh prologue
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s20a; mkdir -p $D
pack() { tar czf $OUT/s20a.tgz -C /tmp s20a; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|SUMMARY" $D/$name.log | sort | uniq -c | tail -n 4; pack; }
run head_ll1 150 $M -n 1 $T tests/gpu/test_low_latency.py
run head_results_ll1 150 $M -n 1 python3 -m cupy_ep.bench --mode low-latency --out $D/results_ll1
grep -a -E "^  ll_|host" $D/head_results_ll1.log | head -20
