#!/bin/bash
# S19D (one H200): HEAD (.carry/vnew: the staged top-k kernel + the helper's host-time commits) against bf330e3
# (.carry/v0) and the diagnostic stamps tree (.carry/vdiag, vdiag.md), at ONE rank: ll_ab.py (verification, graph,
# steady, host time per dispatch, stamps), ll_host_profile.py (dispatch and combine host time per call, cProfile),
# then HEAD's LL tests and soak at one rank and tests/gpu at two ranks sharing the GPU (LL files skip there).
set -u
source benchmarks/experiments/device_env.sh
D=/tmp/s19d; mkdir -p $D
pack() { tar czf $OUT/s19d.tgz -C /tmp s19d; }
AB=$PWD/benchmarks/experiments/s19/ll_ab.py; HP=$PWD/benchmarks/experiments/s18/ll_host_profile.py
tree() { case $1 in v0*) echo $PWD/.carry/v0;; diag*) echo $PWD/.carry/vdiag;; *) echo $PWD/.carry/vnew;; esac; }
for v in new v0 diag new2 v0b; do
  dir=$(tree $v); s=$(date +%s); (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 100 $M -n 1 python3 $AB > $D/ab_$v.log 2>&1)
  echo "ab $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_dispatch +(graph|steady|host)|phases|VERIF|rror" $D/ab_$v.log | head -8; pack
done
for v in new v0; do
  dir=$(tree $v); s=$(date +%s); (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 60 $M -n 1 python3 $HP --calls 1000 > $D/hp_$v.log 2>&1)
  echo "host profile $v rc=$? $(( $(date +%s)-s ))s"; grep -a "^== " $D/hp_$v.log; pack
done
cd .carry/vnew; export PYTHONPATH=/tmp/site:$PWD
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|SUMMARY" $D/$name.log | sort | uniq -c | tail -n 4; pack; }
run ll_tests1 120 $M -n 1 $T tests/gpu/test_low_latency.py
(export CUPY_EP_TIMEOUT_S=15; run ll_soak_1rank 60 $M -n 1 python3 -m cupy_ep.soak --mode low-latency --iters 1000)
run gpu2_shared 170 $M -n 2 $T tests/gpu
