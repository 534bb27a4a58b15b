#!/bin/bash
# S24A (kind nvidia-h200: one GPU; carry [".carry"] with the pytest-mpi wheel): ranks sharing the one GPU as CUDA
# MPS clients. mps_probe.py without and with the MPS control daemon (and with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50);
# under MPS the low-latency files on NVSHMEM at 2 ranks (refused without MPS) and the rest of tests/gpu at 2 ranks;
# the daemon is stopped, then tests/gpu at one rank without MPS (the path every one-GPU-per-rank job takes).
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
logs_in s24a
P=benchmarks/experiments/s24/mps_probe.py
LL="tests/gpu/test_low_latency.py tests/gpu/test_nvshmem.py tests/gpu/test_zz_low_latency_timeout.py"
nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv
command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin /usr/bin | grep -i mps
RUN_GREP="^rank" run probe_plain 40 $M -n 2 python3 $P
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
stop_mps() { echo quit | nvidia-cuda-mps-control; sleep 1; cp -r /tmp/mps/log $D/mps_log 2>/dev/null; }
trap stop_mps EXIT
nvidia-cuda-mps-control -d; echo "mps daemon rc=$?"
RUN_GREP="^rank" run probe_mps 40 $M -n 2 python3 $P
export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
RUN_GREP="^rank" run probe_mps50 40 $M -n 2 python3 $P
run mps50_ll2 200 $M -n 2 $T $LL
run mps50_rest2 160 $M -n 2 $T tests/gpu $(for f in $LL; do echo --ignore=$f; done)
unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
stop_mps; trap - EXIT
run plain_gpu1 100 $M -n 1 $T tests/gpu
