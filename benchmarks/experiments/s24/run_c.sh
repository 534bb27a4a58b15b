#!/bin/bash
# S24C (kind nvidia-h200; carry [".carry"]: the pytest-mpi wheel and S24B's kernel cache epc.tgz): why the
# low-latency files failed at 4 NVSHMEM PEs on one GPU under MPS (S24B: rank 3's combine receiver timed out waiting
# for rank 0). At 25 %: the peer table (ll_peers.py), LL soaks of 20 iterations on NVSHMEM (stores, forced puts)
# and on IPC; at 50 % and 2 ranks a 300-iteration NVSHMEM soak. Logs straight into $OUT.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
tar xzf .carry/epc.tgz -C /tmp
D=$OUT; LOG_TAG=none; pack() { :; }   # logs go to $OUT as they are written
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d; echo "mps daemon rc=$?"
trap 'echo quit | nvidia-cuda-mps-control' EXIT
S="python3 -m cupy_ep.soak --mode low-latency --check-every 1"
export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 CUPY_EP_TIMEOUT_S=10
RUN_GREP="^rank|Error" run peers4 60 $M -n 4 python3 benchmarks/experiments/s24/ll_peers.py
RUN_GREP="^rank|Error" CUPY_EP_LL_TRANSPORT=ipc run peers4_ipc 60 $M -n 4 python3 benchmarks/experiments/s24/ll_peers.py
RUN_GREP="mismatch|Error|OK|ok|iteration" run soak4 90 $M -n 4 $S --iters 20
RUN_GREP="mismatch|Error|OK|ok|iteration" CUPY_EP_LL_FORCE_PUT=1 run soak4_put 90 $M -n 4 $S --iters 20
RUN_GREP="mismatch|Error|OK|ok|iteration" CUPY_EP_LL_TRANSPORT=ipc run soak4_ipc 90 $M -n 4 $S --iters 20
export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
RUN_GREP="mismatch|Error|OK|ok|iteration" run soak2 90 $M -n 2 $S --iters 300
