#!/bin/bash
# Prepared in session 20 for the next device session (not run). Carry [".carry"] with the pytest-mpi wheel in
# .carry/wheels and, for `ctx`, .carry/vctx = git archive s20-ctxparams cupy_ep cuda_src tests pyproject.toml.
#   bash run_next.sh        (nvidia-h200-x2, ~7 min) HEAD at TWO ranks: the LL files, racecheck/synccheck and the
#                           soak; the LL results benchmark with stamps (now with the *aligned* rows: copy
#                           $D/results_ll/* into benchmarks/results/ afterwards); launch_gap.py and graph_ab.py at
#                           two ranks; the rest of tests/gpu
#   bash run_next.sh ctx    (any kind; ranks = GPUs, ~3 min) branch s20-ctxparams (never run: rank and num_ranks as
#                           kernel parameters instead of a DeviceCtx load in the prologue; the last block writes the
#                           next epoch without re-reading it) against HEAD, alternating (launch_gap.py, graph_ab.py);
#                           then the branch's LL tests (the epoch-wrap test among them), soak and racecheck. Merge it
#                           if they pass and its pre / post / queued2 beat HEAD's.
#   bash run_next.sh more   (nvidia-h200-x2, ~9 min) tests/gpu at 4 ranks, the intranode file at 8, issue 4's
#                           copy-engine combine probe (s17, never run), then the normal-mode results benchmark
#                           (scripts/bench.sh; copy $D/bench/* into benchmarks/results/)
set -u
source benchmarks/experiments/device_env.sh  # exports, $M, $T
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/next20; mkdir -p $D
pack() { tar czf $OUT/next20.tgz -C /tmp next20; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|SUMMARY" $D/$name.log | sort | uniq -c | tail -n 4; pack; }
LL="tests/gpu/test_low_latency.py tests/gpu/test_nvshmem.py tests/gpu/test_zz_low_latency_timeout.py"
LG=$PWD/benchmarks/experiments/s20/launch_gap.py; GA=$PWD/benchmarks/experiments/s20/graph_ab.py
N=$(nvidia-smi -L | wc -l)
case "${1:-}" in
ctx)
  for v in branch head branch2 head2; do
    case $v in branch*) dir=$PWD/.carry/vctx;; *) dir=$PWD;; esac
    (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 90 $M -n $N python3 $LG > $D/lg_$v.log 2>&1
     PYTHONPATH=/tmp/site:$dir timeout 90 $M -n $N python3 $GA > $D/ga_$v.log 2>&1)
    echo "$v"; grep -a -h -E "rank|graph2|graph20|queued2|rror" $D/lg_$v.log $D/ga_$v.log | cut -c1-200; pack
  done
  cd .carry/vctx; export PYTHONPATH=/tmp/site:$PWD
  run ctx_ll_tests 150 $M -n $N $T tests/gpu/test_low_latency.py
  (export CUPY_EP_TIMEOUT_S=15; run ctx_soak 60 $M -n $N python3 -m cupy_ep.soak --mode low-latency --iters 1000)
  (export CUPY_EP_TIMEOUT_S=60; run ctx_racecheck 100 $M -n $N compute-sanitizer --tool racecheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1)
  exit;;
more)
  run gpu4 200 $M -n 4 $T tests/gpu
  run intranode8 150 $M -n 8 $T tests/gpu/test_intranode.py
  run ce_combine_probe 120 $M -n 2 python3 benchmarks/experiments/s17/ce_combine_probe.py
  run bench 560 bash scripts/bench.sh --out $D/bench; exit;;
esac
run ll_files2 120 $M -n 2 $T $LL
for tool in racecheck synccheck; do
  (export CUPY_EP_TIMEOUT_S=60; run san_${tool}_ll2 100 $M -n 2 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1)
done
(export CUPY_EP_TIMEOUT_S=15; run ll_soak2 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000)
run results_ll 180 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --ll-stamps --out $D/results_ll
grep -a -E "^  ll_.*(graph|aligned|steady|host)" $D/results_ll.log | head -16
run launch_gap2 60 $M -n 2 python3 $LG; grep -a "rank" $D/launch_gap2.log
run graph_ab2 60 $M -n 2 python3 $GA; grep -a -E "graph2|graph20|queued2" $D/graph_ab2.log
run gpu2_rest 150 $M -n 2 $T tests/gpu $(for f in $LL; do echo --ignore=$f; done)
