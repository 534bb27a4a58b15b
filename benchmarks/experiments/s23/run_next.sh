#!/bin/bash
# Prepared in session 22 for the next two-GPU session (not run; moved here in session 23, which added the warm
# start's A/B at EP2). Carry [".carry"] with the
# pytest-mpi wheel in .carry/wheels. Kind nvidia-h200-x2 (one rank per GPU). Pass CUPY_EP_COMMIT=<HEAD> in the
# command: the device's copy of .git lags the copied files, and the results files record the commit.
#   bash run_next.sh        (~9 min) HEAD at TWO ranks: the LL files (sessions 21-22's two-rank cases over NVLink
#                           and NVSHMEM puts: the late-rank wait cost, LogFMT / bf16 partials from a peer),
#                           racecheck/synccheck and the soak; the LL results benchmark on both transports (copy
#                           $D/results_ll/* into benchmarks/results/ afterwards); launch_gap.py and graph_ab.py at two
#                           ranks; the rest of tests/gpu
#   bash run_next.sh more   (~10 min) tests/gpu at 4 ranks, the LL files over IPC at 4 (two ranks per GPU), the
#                           intranode file at 8, issue 4's copy-engine combine probe (s17, never run), the warm start
#                           at EP2 with start_mpi and the usual way (s23/startup_probe.py, 3 each, alternating), then
#                           the normal-mode results benchmark (scripts/bench.sh; copy $D/bench/* into
#                           benchmarks/results/)
set -u
source benchmarks/experiments/device_env.sh  # exports, $M, $T, logs_in / run / pack
export PYTHONPATH=/tmp/site:$PWD
logs_in next23
LL="tests/gpu/test_low_latency.py tests/gpu/test_nvshmem.py tests/gpu/test_zz_low_latency_timeout.py"
LG=$PWD/benchmarks/experiments/s20/launch_gap.py; GA=$PWD/benchmarks/experiments/s20/graph_ab.py
case "${1:-}" in
more)
  run gpu4 200 $M -n 4 $T tests/gpu
  (export CUPY_EP_LL_TRANSPORT=ipc; run ll_ipc4 150 $M -n 4 $T $LL)
  run intranode8 150 $M -n 8 $T tests/gpu/test_intranode.py
  run ce_combine_probe 120 $M -n 2 python3 benchmarks/experiments/s17/ce_combine_probe.py
  SP=benchmarks/experiments/s23/startup_probe.py
  for i in 1 2 3; do RUN_GREP="^rank" run probe_ovl_$i 60 $M -n 2 python3 $SP; RUN_GREP="^rank" run probe_plain_$i 60 $M -n 2 python3 $SP --plain; done
  CUPY_EP_SKIP_INSTALL=1 run bench 560 bash scripts/bench.sh --out $D/bench; exit;;
esac
run ll_files2 200 $M -n 2 $T $LL
for tool in racecheck synccheck; do
  (export CUPY_EP_TIMEOUT_S=60; run san_${tool}_ll2 150 $M -n 2 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 16 --check-every 1)
done
(export CUPY_EP_TIMEOUT_S=15; run ll_soak2 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000)
run results_ll 240 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --ll-stamps --out $D/results_ll
run results_ll_ipc 120 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --ll-transport ipc --out $D/results_ll
grep -a -h -E "^  ll_.*(graph|aligned|steady)" $D/results_ll.log $D/results_ll_ipc.log | head -32
run launch_gap2 60 $M -n 2 python3 $LG; grep -a "rank" $D/launch_gap2.log
run graph_ab2 60 $M -n 2 python3 $GA; grep -a -E "graph2|graph20|queued2" $D/graph_ab2.log
run gpu2_rest 150 $M -n 2 $T tests/gpu $(for f in $LL; do echo --ignore=$f; done)
