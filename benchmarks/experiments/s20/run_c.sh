#!/bin/bash
# Session 20, one GPU: issue 4's warm start, broken down (the fields e680611 added, never measured on a GPU), with
# two ranks sharing the one GPU. startup_probe.py once cold (compiles), three times warm, once with cProfile; then
# `python3 -X importtime` of what the benchmark imports, twice.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s20c; mkdir -p $D
pack() { tar czf $OUT/s20c.tgz -C /tmp s20c; }
SP=benchmarks/experiments/s20/startup_probe.py
for i in cold 1 2 3; do timeout 120 $M -n 2 python3 $SP > $D/probe_$i.log 2>&1; echo "probe $i rc=$?"; grep -a "^rank" $D/probe_$i.log; done
timeout 120 $M -n 2 python3 $SP --profile > $D/probe_profile.log 2>&1; echo "profile rc=$?"; pack
for i in 1 2; do python3 -X importtime -c "import cupy_ep.bench; import cupy; from mpi4py import MPI" 2> $D/importtime_$i.log
  sort -t'|' -k2 -n $D/importtime_$i.log | tail -12; done
python3 -X importtime -c "import cupy" 2> $D/importtime_cupy.log; tail -1 $D/importtime_cupy.log
python3 -X importtime -c "import numpy" 2> $D/importtime_numpy.log; tail -1 $D/importtime_numpy.log
pack
# HEAD (d12781e's kernels): synccheck over the LL soak at one rank (racecheck ran in S20A), and the whole GPU
# suite with two ranks sharing the GPU (the LL files skip there: NVSHMEM wants a GPU per PE)
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|SUMMARY" $D/$name.log | sort | uniq -c | tail -n 4; pack; }
(export CUPY_EP_TIMEOUT_S=60; run synccheck_ll1 100 $M -n 1 compute-sanitizer --tool synccheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1)
run gpu2_shared 330 $M -n 2 $T tests/gpu
