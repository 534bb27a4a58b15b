#!/bin/bash
# Session 20, one GPU: branch s20-ticket (this checkout) against main (.carry/vmain), alternating: launch_gap.py
# (the dispatch's pre / span / post around its stamps) and graph_ab.py (graph2 / graph20 / queued2); then the
# branch's LL tests, soak and racecheck at one rank.
set -u
source benchmarks/experiments/device_env.sh
D=/tmp/s20l; mkdir -p $D
pack() { tar czf $OUT/s20l.tgz -C /tmp s20l; }
LG=$PWD/benchmarks/experiments/s20/launch_gap.py; GA=$PWD/benchmarks/experiments/s20/graph_ab.py
for v in branch main branch2 main2; do
  case $v in main*) dir=$PWD/.carry/vmain;; *) dir=$PWD;; esac
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 60 $M -n 1 python3 $LG > $D/lg_$v.log 2>&1
   PYTHONPATH=/tmp/site:$dir timeout 60 $M -n 1 python3 $GA > $D/ga_$v.log 2>&1)
  echo "$v"; grep -a -h -E "rank 0|graph2|graph20|queued2|rror" $D/lg_$v.log $D/ga_$v.log | cut -c1-260; pack
done
export PYTHONPATH=/tmp/site:$PWD
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|SUMMARY" $D/$name.log | sort | uniq -c | tail -n 4; pack; }
run ll1 120 $M -n 1 $T tests/gpu/test_low_latency.py
(export CUPY_EP_TIMEOUT_S=15; run soak 40 $M -n 1 python3 -m cupy_ep.soak --mode low-latency --iters 1000)
(export CUPY_EP_TIMEOUT_S=60; run racecheck 60 $M -n 1 compute-sanitizer --tool racecheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1)
