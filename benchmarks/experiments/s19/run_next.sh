#!/bin/bash
# Prepared in session 19 for the next device session (not run). Carry [".carry"] with .carry/v0 = bf330e3's tree
# (git archive bf330e3 cupy_ep cuda_src tests pyproject.toml | tar x -C .carry/v0) and the pytest-mpi wheel.
#   bash run_next.sh        (nvidia-h200-x2, ~6.5 min) the session-19 kernels and host path at TWO ranks: the LL
#                           files, sanitizers and soak; ll_ab.py HEAD against bf330e3 alternating; the LL results
#                           benchmark (copy $D/results_ll/* into benchmarks/results/ afterwards); the rest of tests/gpu
#   bash run_next.sh more   (nvidia-h200-x2, ~8 min) tests/gpu at 4 ranks, the intranode file at 8, issue 4's
#                           copy-engine combine probe, then the normal-mode results benchmark (scripts/bench.sh)
#   bash run_next.sh prologue (any kind; ranks = GPUs, ~3.5 min) branch s19-prologue (.carry/vprologue = git archive
#                           s19-prologue ...: the receive bookkeeping without divisions or a binary search, never run)
#                           against HEAD with ll_ab.py, alternating; then the branch's LL tests, soak and racecheck.
#                           Merge the branch if its tests pass and its kernel end / steady / graph beat HEAD's.
#   bash run_next.sh ncu    (any kind, one rank) why every warp of the dispatch's receive phase crawls for ~0.9 us
#                           after the prefix (S19F): ncu's warp-state stall reasons over one dispatch (instruction
#                           fetch, "no_instruction", would confirm the 56 KB of code fetched per call)
set -u
source benchmarks/experiments/device_env.sh  # exports, $M, $T
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/next19; mkdir -p $D
pack() { tar czf $OUT/next19.tgz -C /tmp next19; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|SUMMARY" $D/$name.log | sort | uniq -c | tail -n 4; pack; }
LL="tests/gpu/test_low_latency.py tests/gpu/test_nvshmem.py tests/gpu/test_zz_low_latency_timeout.py"
AB=$PWD/benchmarks/experiments/s19/ll_ab.py; HP=$PWD/benchmarks/experiments/s18/ll_host_profile.py
case "${1:-}" in
prologue)
  N=$(nvidia-smi -L | wc -l)
  for v in branch head branch2 head2; do
    case $v in branch*) dir=$PWD/.carry/vprologue;; *) dir=$PWD;; esac
    s=$(date +%s); (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 100 $M -n $N python3 $AB > $D/abp_$v.log 2>&1)
    echo "ab prologue $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_dispatch +(graph|steady)|phases|VERIF|rror" $D/abp_$v.log | head -8; pack
  done
  cd .carry/vprologue; export PYTHONPATH=/tmp/site:$PWD
  run prologue_ll_tests 150 $M -n $N $T tests/gpu/test_low_latency.py
  (export CUPY_EP_TIMEOUT_S=15; run prologue_soak 60 $M -n $N python3 -m cupy_ep.soak --mode low-latency --iters 1000)
  (export CUPY_EP_TIMEOUT_S=15; run prologue_soak300 60 $M -n $N python3 -m cupy_ep.soak --mode low-latency --iters 300 --max-tokens 300)
  (export CUPY_EP_TIMEOUT_S=60; run prologue_racecheck 100 $M -n $N compute-sanitizer --tool racecheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1)
  exit;;
ncu)
  # eager dispatches (ll_host_profile.py's warm-up calls), the 21st profiled; kernel replay restores memory between
  # passes, and at one rank no peer waits. SourceCounters samples the warps' stall reasons per SASS instruction: the
  # receive prologue's (between the recv_prepared and recv_copy_start stamps in a stamps build) say whether the warps
  # wait for instructions (no_instruction), constants (imc_miss) or something else.
  run ncu_dispatch 300 $M -n 1 ncu --clock-control none --kernel-name regex:dispatch --launch-skip 20 --launch-count 1 \
      --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters \
      -o $D/ncu_dispatch python3 benchmarks/experiments/s18/ll_host_profile.py --calls 10
  ncu -i $D/ncu_dispatch.ncu-rep --page details > $D/ncu_details.txt 2>&1
  ncu -i $D/ncu_dispatch.ncu-rep --page source --csv --print-source sass > $D/ncu_source_sass.csv 2>&1
  pack; grep -a -i -E "stall|warp cycles|issued" $D/ncu_details.txt | head -40; exit;;
more)
  run gpu4 150 $M -n 4 $T tests/gpu
  run intranode8 120 $M -n 8 $T tests/gpu/test_intranode.py
  run ce_combine_probe 120 $M -n 2 python3 benchmarks/experiments/s17/ce_combine_probe.py
  run bench 560 bash scripts/bench.sh --out $D/bench; exit;;
esac
run ll_files2 120 $M -n 2 $T $LL
for tool in racecheck synccheck; do
  (export CUPY_EP_TIMEOUT_S=60; run san_${tool}_ll2 100 $M -n 2 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1)
done
(export CUPY_EP_TIMEOUT_S=15; run ll_soak2 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000)
for v in head v0 head2 v0b; do
  case $v in v0*) dir=$PWD/.carry/v0;; *) dir=$PWD;; esac
  s=$(date +%s); (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 100 $M -n 2 python3 $AB > $D/ab2_$v.log 2>&1)
  echo "ab2 $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_dispatch +(graph|steady|host)|phases|VERIF|rror" $D/ab2_$v.log | head -8; pack
done
for v in head v0; do  # host time per call with check_values False (benchmarks) and True (the default)
  case $v in v0*) dir=$PWD/.carry/v0;; *) dir=$PWD;; esac
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 60 $M -n 2 python3 $HP --calls 1000 > $D/hp_$v.log 2>&1
   PYTHONPATH=/tmp/site:$dir timeout 60 $M -n 2 python3 $HP --calls 300 --check-values > $D/hp_cv_$v.log 2>&1)
  echo "host profile $v"; grep -a "^== " $D/hp_$v.log $D/hp_cv_$v.log; pack
done
run results_ll 150 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --ll-stamps --out $D/results_ll
grep -a -E "^  ll_.*(graph|steady|host)" $D/results_ll.log | head -12
run gpu2_rest 150 $M -n 2 $T tests/gpu $(for f in $LL; do echo --ignore=$f; done)
