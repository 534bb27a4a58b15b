#!/bin/bash
# Prepared in session 21 for the next two-GPU session (not run). Carry [".carry"] with the pytest-mpi wheel in
# .carry/wheels. Kind nvidia-h200-x2 (one rank per GPU).
#   bash run_next.sh        (~8 min) HEAD at TWO ranks: the LL files (with session 21's never-run two-rank cases:
#                           test_wait_cost_stats_point_at_a_late_rank, the LogFMT cases whose partials cross NVLink
#                           and NVSHMEM puts), racecheck/synccheck and the soak (LogFMT in 20 % of its iterations);
#                           the LL results benchmark (with the aligned and ll_combine_logfmt rows: copy
#                           $D/results_ll/* into benchmarks/results/ afterwards); launch_gap.py and graph_ab.py at two
#                           ranks; the rest of tests/gpu
#   bash run_next.sh more   (~9 min) tests/gpu at 4 ranks, the intranode file at 8, issue 4's copy-engine combine
#                           probe (s17, never run), then the normal-mode results benchmark (scripts/bench.sh; copy
#                           $D/bench/* into benchmarks/results/)
set -u
source benchmarks/experiments/device_env.sh  # exports, $M, $T
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/next21; mkdir -p $D
pack() { tar czf $OUT/next21.tgz -C /tmp next21; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|SUMMARY" $D/$name.log | sort | uniq -c | tail -n 4; pack; }
LL="tests/gpu/test_low_latency.py tests/gpu/test_nvshmem.py tests/gpu/test_zz_low_latency_timeout.py"
LG=$PWD/benchmarks/experiments/s20/launch_gap.py; GA=$PWD/benchmarks/experiments/s20/graph_ab.py
N=$(nvidia-smi -L | wc -l)
case "${1:-}" in
more)
  run gpu4 200 $M -n 4 $T tests/gpu
  run intranode8 150 $M -n 8 $T tests/gpu/test_intranode.py
  run ce_combine_probe 120 $M -n 2 python3 benchmarks/experiments/s17/ce_combine_probe.py
  run bench 560 bash scripts/bench.sh --out $D/bench; exit;;
esac
run ll_files2 200 $M -n 2 $T $LL
for tool in racecheck synccheck; do
  (export CUPY_EP_TIMEOUT_S=60; run san_${tool}_ll2 150 $M -n 2 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 16 --check-every 1)
done
(export CUPY_EP_TIMEOUT_S=15; run ll_soak2 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000)
run results_ll 300 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --ll-stamps --out $D/results_ll
grep -a -E "^  ll_.*(graph|aligned|steady|host)" $D/results_ll.log | head -24
run launch_gap2 60 $M -n 2 python3 $LG; grep -a "rank" $D/launch_gap2.log
run graph_ab2 60 $M -n 2 python3 $GA; grep -a -E "graph2|graph20|queued2" $D/graph_ab2.log
run gpu2_rest 150 $M -n 2 $T tests/gpu $(for f in $LL; do echo --ignore=$f; done)
