#!/bin/bash
# S24E (kind nvidia-h200, the machine S24D left warm; carry [".carry"]), run as one command line (this file records
# it): 4 ranks under MPS without a percentage (33 blocks each) and at 25 % (30 of 32 provisioned SMs each), the LL
# soak from iteration 0 and the two iterations S24C/D pointed at, alone. Logs in logs_e/.
source benchmarks/experiments/device_env.sh; export PYTHONPATH=/tmp/site:$PWD; D=$OUT; LOG_TAG=none; pack() { :; }
S="python3 -m cupy_ep.soak --mode low-latency --check-every 1"
export CUPY_EP_TIMEOUT_S=10 CUPY_EP_LL_TRANSPORT=ipc CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT; G="MISMATCH|Error|mismatches"
RUN_GREP=$G run mps4_b33_20 40 $M -n 4 $S --iters 20
RUN_GREP=$G CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 run mps4_25_20 40 $M -n 4 $S --iters 20
RUN_GREP=$G CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 run mps4_25_r6 30 $M -n 4 $S --start 6 --iters 1
RUN_GREP=$G CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 run mps4_25_r5 30 $M -n 4 $S --start 5 --iters 2
