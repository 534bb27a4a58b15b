#!/bin/bash
# S19E (one H200), at ONE rank: HEAD (.carry/vnew) against .carry/vx (send_counts by warps 1.. only: S19D's diag
# stamps put the 0.9 us between the histograms and the loop's first barrier in warp 0's send_counts + token_slots)
# and .carry/vdiag2 (per warp its first copy unit's start, c0..c15, and its copies' end, e0..e15: is only warp 1
# late after the prefix, or every warp?). Then vx's LL tests, soak and racecheck (in case it is kept).
# (As it ran in S19E, ${v%2} made "vdiag2" run .carry/vdiag: its ab_vdiag2.log is vdiag's; S19F reran vdiag2 alone
# with VARIANTS=vdiag2 AB_ONLY=1 after the case below was added.)
set -u
source benchmarks/experiments/device_env.sh
D=/tmp/s19e; mkdir -p $D
pack() { tar czf $OUT/s19e.tgz -C /tmp s19e; }
AB=$PWD/benchmarks/experiments/s19/ll_ab.py
for v in ${VARIANTS:-vx vnew vdiag2 vx2 vnew2}; do
  case $v in vdiag2) dir=$PWD/.carry/vdiag2;; *) dir=$PWD/.carry/${v%2};; esac; s=$(date +%s); (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 100 $M -n 1 python3 $AB > $D/ab_$v.log 2>&1)
  echo "ab $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_dispatch +(graph|steady)|phases|VERIF|rror" $D/ab_$v.log | head -8; pack
done
[ -n "${AB_ONLY:-}" ] && exit 0
cd .carry/vx; export PYTHONPATH=/tmp/site:$PWD
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|SUMMARY" $D/$name.log | sort | uniq -c | tail -n 4; pack; }
run ll_tests1_vx 120 $M -n 1 $T tests/gpu/test_low_latency.py
(export CUPY_EP_TIMEOUT_S=15; run ll_soak_vx 60 $M -n 1 python3 -m cupy_ep.soak --mode low-latency --iters 1000)
(export CUPY_EP_TIMEOUT_S=60; run san_racecheck_vx 100 $M -n 1 compute-sanitizer --tool racecheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1)
