#!/bin/bash
# S19B (one H200): the dispatch with topk_idx staged in shared memory by cp.async at the kernel's start
# (.carry/vnew: HEAD + this change's two cuda_src files; a helper edits the checkout's Python meanwhile) against HEAD~ (.carry/v0), alternating, at ONE rank (ll_ab.py: verification, graph + steady, host time
# per call, stamps warm and flushed); then the checkout's LL tests, soaks (M=128, and M=300: several tokens per
# block, unstaged top-k) and racecheck/synccheck over the soak. AB_ONLY=1: the A/B alone (S19C reran it so: the
# first run's ll_ab.py left --tokens at parse_args' 4096, and its verification failed).
set -u
source benchmarks/experiments/device_env.sh
D=/tmp/s19b; mkdir -p $D
pack() { tar czf $OUT/s19b.tgz -C /tmp s19b; }
AB=$PWD/benchmarks/experiments/s19/ll_ab.py
for v in ${VARIANTS:-new v0 new2 v0b}; do
  case $v in v0*) dir=$PWD/.carry/v0;; *) dir=$PWD/.carry/vnew;; esac
  s=$(date +%s); (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 100 $M -n 1 python3 $AB > $D/ab_$v.log 2>&1)
  echo "ab $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_dispatch +(graph|steady|host)|phases|VERIF|rror" $D/ab_$v.log | head -8; pack
done
cd .carry/vnew; [ -n "${AB_ONLY:-}" ] && exit 0
export PYTHONPATH=/tmp/site:$PWD
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|SUMMARY" $D/$name.log | sort | uniq -c | tail -n 4; pack; }
run ll_tests1 120 $M -n 1 $T tests/gpu/test_low_latency.py
(export CUPY_EP_TIMEOUT_S=15; run ll_soak_m128 60 $M -n 1 python3 -m cupy_ep.soak --mode low-latency --iters 1000)
(export CUPY_EP_TIMEOUT_S=15; run ll_soak_m300 60 $M -n 1 python3 -m cupy_ep.soak --mode low-latency --iters 300 --max-tokens 300)
for tool in racecheck synccheck; do
  (export CUPY_EP_TIMEOUT_S=60; run san_${tool}_ll1 100 $M -n 1 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1)
done
