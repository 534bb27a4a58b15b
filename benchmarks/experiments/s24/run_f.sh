#!/bin/bash
# S24F: PREPARED, NOT RUN (session 24 had too little device time left to start a machine). Kind nvidia-h200;
# carry [".carry"]: wheels + S24B's kernel cache (or none: it compiles). Under
# MPS without a percentage, NVSHMEM with 4 PEs on the one GPU (the configuration the refusal points users to: does
# NVSHMEM take it?), a 10-iteration LL soak; at 25 % the new refusal test. Logs straight into $OUT.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
tar xzf .carry/epc.tgz -C /tmp
D=$OUT; LOG_TAG=none; pack() { :; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log CUPY_EP_TIMEOUT_S=5
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT
RUN_GREP="MISMATCH|FAILED|Error|mismatches|WARN" run nv4 45 $M -n 4 python3 -m cupy_ep.soak --mode low-latency --check-every 1 --iters 10
RUN_GREP="passed|failed" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 run refuse4 40 $M -n 4 $T tests/gpu/test_zz_low_latency_timeout.py -k refused
