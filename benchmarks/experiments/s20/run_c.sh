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
