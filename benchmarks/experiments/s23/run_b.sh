#!/bin/bash
# S23B (kind nvidia-h200; carry [".carry"]): start_mpi's critical path, stamped (preload_stamps.py), three runs with
# the preinit thread on, two with it off (CUPY_EP_PREINIT=0), two ranks sharing the GPU.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
logs_in s23b
RUN_GREP="^rank|Error|error"
for i in 1 2 3; do run stamps_$i 60 $M -n 2 python3 benchmarks/experiments/s23/preload_stamps.py; done
for i in 1 2; do CUPY_EP_PREINIT=0 run stamps_nopre_$i 60 $M -n 2 python3 benchmarks/experiments/s23/preload_stamps.py; done
