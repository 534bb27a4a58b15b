#!/bin/bash
# S19G (one H200), at ONE rank: .carry/vs (part 0's scale words loaded before its data) against .carry/vx (HEAD,
# the counts off warp 0), alternating; then vs's LL tests, soak and racecheck.
set -u
source benchmarks/experiments/device_env.sh
D=/tmp/s19g; mkdir -p $D
pack() { tar czf $OUT/s19g.tgz -C /tmp s19g; }
AB=$PWD/benchmarks/experiments/s19/ll_ab.py
for v in vs vx vs2 vx2; do
  dir=$PWD/.carry/${v%2}; s=$(date +%s); (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 100 $M -n 1 python3 $AB > $D/ab_$v.log 2>&1)
  echo "ab $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_dispatch +(graph|steady)|phases|VERIF|rror" $D/ab_$v.log | head -8; pack
done
cd .carry/vs; export PYTHONPATH=/tmp/site:$PWD
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|SUMMARY" $D/$name.log | sort | uniq -c | tail -n 4; pack; }
run ll_tests1_vs 100 $M -n 1 $T tests/gpu/test_low_latency.py
(export CUPY_EP_TIMEOUT_S=15; run ll_soak_vs 40 $M -n 1 python3 -m cupy_ep.soak --mode low-latency --iters 1000)
(export CUPY_EP_TIMEOUT_S=60; run san_racecheck_vs 60 $M -n 1 compute-sanitizer --tool racecheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1)
