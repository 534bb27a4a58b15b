#!/bin/bash
# Prepared in session 17 for the next device session (not run): programmatic dependent launch for the low-latency
# calls, and a copy-engine combine probe (issue 4). First the microbenchmarks (pdl_gap.py: the gap between back-to-back kernels shaped like ours, with and
# without PDL, with and without the event pairs cupy_ep's calls put around a launch); then branch s17-pdl (in
# .carry/vpdl: `git archive s17-pdl cupy_ep cuda_src tests pyproject.toml | tar x -C .carry/vpdl`): its LL tests,
# soak and racecheck, and the LL benchmark with stamps against the checkout, alternating, twice each.
# Run from the repository root with the pytest-mpi wheel in .carry/wheels (see benchmarks/results/gpu_tests_h200x2.md).
set -u
source benchmarks/experiments/device_env.sh  # exports, $M, $T
D=/tmp/pdl; mkdir -p $D
pack() { tar czf $OUT/pdl.tgz -C /tmp pdl; }
timeout 60 python3 benchmarks/experiments/s17/pdl_gap.py > $D/pdl_gap.log 2>&1; echo "pdl_gap rc=$?"; cat $D/pdl_gap.log; pack
# issue 4's combine by copy engines: does a chunked cudaMemcpyAsync + flags + an SM reduce beat 206 us (179 = 0.90)?
timeout 120 $M -n 2 python3 benchmarks/experiments/s17/ce_combine_probe.py > $D/ce_combine_probe.log 2>&1; echo "ce_combine_probe rc=$?"; cat $D/ce_combine_probe.log; pack
V=$PWD/.carry/vpdl
s=$(date +%s); (cd $V && PYTHONPATH=/tmp/site:$PWD timeout 170 $M -n 2 $T tests/gpu/test_low_latency.py tests/gpu/test_nvshmem.py tests/gpu/test_zz_low_latency_timeout.py) > $D/ll_tests.log 2>&1; echo "vpdl ll tests rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed" $D/ll_tests.log | head -n 4; pack
s=$(date +%s); (cd $V && CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000) > $D/ll_soak.log 2>&1; echo "vpdl soak rc=$? $(( $(date +%s)-s ))s"; tail -n 1 $D/ll_soak.log; pack
s=$(date +%s); (cd $V && CUPY_EP_TIMEOUT_S=60 PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 compute-sanitizer --tool racecheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1) > $D/san_racecheck.log 2>&1
echo "vpdl racecheck rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "RACECHECK SUMMARY|mismatches" $D/san_racecheck.log | sort | uniq -c; pack
B="python3 -m cupy_ep.bench --mode low-latency --ll-stamps"
for v in base vpdl base2 vpdl2; do
  case $v in base*) dir=$PWD;; *) dir=$V;; esac
  s=$(date +%s); (cd $dir && CUPY_EP_COMMIT=$v PYTHONPATH=/tmp/site:$PWD timeout 120 $M -n 2 $B --out $D/llb_$v > $D/ll_bench_$v.log 2>&1)
  echo "ll bench $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|VERIF|Error" $D/ll_bench_$v.log | head -12; grep -a "ll_dispatch      phases" $D/ll_bench_$v.log; pack
done
