#!/bin/bash
# S24D (kind nvidia-h200; carry [".carry"]: wheels + S24B's kernel cache): is S24C's mismatch (LL soak iteration 6 at
# 4 ranks under MPS, every transport: 30 blocks per rank, the ranks running at once) the grid size or the
# concurrency? CUPY_EP_LL_NUM_BLOCKS sets the grid without MPS (time slices) and under it. Logs straight into $OUT.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
tar xzf .carry/epc.tgz -C /tmp
D=$OUT; LOG_TAG=none; pack() { :; }
S="python3 -m cupy_ep.soak --mode low-latency --check-every 1"; R6="--start 6 --iters 1"
G="mismatch|MISMATCH|Error|error"
export CUPY_EP_TIMEOUT_S=10 CUPY_EP_LL_TRANSPORT=ipc
RUN_GREP=$G CUPY_EP_LL_NUM_BLOCKS=30 run ts4_b30 45 $M -n 4 $S $R6
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d; echo "mps daemon rc=$?"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
RUN_GREP=$G run mps3 40 $M -n 3 $S --iters 20
RUN_GREP=$G run mps4_b33 30 $M -n 4 $S $R6
RUN_GREP=$G CUPY_EP_LL_NUM_BLOCKS=8 run mps2_b8 30 $M -n 2 $S --iters 50
