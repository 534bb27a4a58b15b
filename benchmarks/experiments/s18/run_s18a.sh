#!/bin/bash
# S18A (one H200: the two-GPU kind was not lent): PDL's gap microbenchmark, and branch s17-pdl's launch path.
set -u
source benchmarks/experiments/device_env.sh
D=/tmp/s18a; mkdir -p $D
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $D/gpu.txt 2>&1; cat $D/gpu.txt
pack() { tar czf $OUT/s18a.tgz -C /tmp s18a; }
timeout 60 python3 benchmarks/experiments/s17/pdl_gap.py > $D/pdl_gap_busy5.log 2>&1; echo "pdl_gap busy5 rc=$?"; cat $D/pdl_gap_busy5.log; pack
timeout 60 python3 benchmarks/experiments/s17/pdl_gap.py --busy-us 1 > $D/pdl_gap_busy1.log 2>&1; echo "pdl_gap busy1 rc=$?"; cat $D/pdl_gap_busy1.log; pack
(PYTHONPATH=$PWD/.carry/vpdl timeout 60 python3 benchmarks/experiments/s18/launch_ex_check.py) > $D/launch_ex_check.log 2>&1; echo "launch_ex_check rc=$?"; cat $D/launch_ex_check.log; pack
