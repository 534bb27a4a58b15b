#!/bin/bash
# Prepared in session 18 for the next device session (kind nvidia-h200-x2; not run). In order of value:
#  1. racecheck and synccheck over the LL soak (the combine's buffer check moved before the block split in
#     8f1af6a; racecheck last ran on a82c642's kernels), and the LL soak at one rank (EP1, new in session 18);
#  2. issue 4's copy-engine combine probe (benchmarks/experiments/s17/ce_combine_probe.py: does a chunked
#     cudaMemcpyAsync + flags + an SM reduce beat the kernel's 206 us, 179 = 0.90 of the ceiling?);
#  3. the LL benchmark with stamps at two ranks and at one (cfee17d's finer stamps split the 1.7 us between the
#     counts' prefix and the first row: recv_copy_start, recv_row_seen; and the histograms: send_first_stored);
#     where a call's host time goes (ll_host_profile.py, cProfile; 55-100 us per call now), then tests/gpu at
#     4 ranks (2 per GPU) and the intranode file at 8 (not run since session 17);
#  4. the normal-mode results benchmark (scripts/bench.sh): the warm-start split (gpu_probe_s, buffer_sizes_s,
#     unaccounted_s) has never run on a GPU.
# Run from the repository root with the pytest-mpi wheel in .carry/wheels. `bash run_next.sh` runs 1-3 (~7.5 min
# by past step times; the limits add up to more, so give the call the full 600 s); `bash run_next.sh bench` runs 4
# alone (a call of its own: the benchmark takes minutes).
set -u
source benchmarks/experiments/device_env.sh  # exports, $M, $T
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/next; mkdir -p $D
pack() { tar czf $OUT/next.tgz -C /tmp next; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|SUMMARY" $D/$name.log | sort | uniq -c | tail -n 4; pack; }
if [ "${1:-}" = bench ]; then run bench 560 bash scripts/bench.sh --out $D/bench; exit; fi
for tool in racecheck synccheck; do
  (export CUPY_EP_TIMEOUT_S=60; run san_${tool}_ll 100 $M -n 2 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1)
done
(export CUPY_EP_TIMEOUT_S=15; run ll_soak_1rank 60 $M -n 1 python3 -m cupy_ep.soak --mode low-latency --iters 1000)
run ce_combine_probe 120 $M -n 2 python3 benchmarks/experiments/s17/ce_combine_probe.py
run llb_stamps2 120 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --ll-stamps --out $D/llb2
grep -a "phases" $D/llb_stamps2.log | head -4
run llb_stamps1 120 $M -n 1 python3 -m cupy_ep.bench --mode low-latency --ll-stamps --out $D/llb1
grep -a "phases" $D/llb_stamps1.log | head -4
run ll_host_profile 90 $M -n 1 python3 benchmarks/experiments/s18/ll_host_profile.py
grep -a -A 12 "^== " $D/ll_host_profile.log | head -30
run gpu4 150 $M -n 4 $T tests/gpu
run intranode8 120 $M -n 8 $T tests/gpu/test_intranode.py
