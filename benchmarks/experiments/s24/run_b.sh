#!/bin/bash
# S24B (kind nvidia-h200; carry [".carry"]): after the SmShare fix for a provisioned MPS share (S24A: at 50 % CUDA
# reports 66 SMs, and the first SmShare halved that again), the probe at 2 ranks (no percentage, 50 %) and 4 ranks
# (25 %); then scripts/gpu_check.sh's new mps step at 4 ranks on the one GPU (NVSHMEM with 4 PEs per GPU under MPS:
# the low-latency files, then the rest of tests/gpu). The kernel cache comes back as $OUT/epc.tgz.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
logs_in s24b
P=benchmarks/experiments/s24/mps_probe.py
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d; echo "mps daemon rc=$?"
RUN_GREP="^rank" run probe_mps 40 $M -n 2 python3 $P
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 RUN_GREP="^rank" run probe_mps50 40 $M -n 2 python3 $P
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 RUN_GREP="^rank" run probe_mps25 40 $M -n 4 python3 $P
echo quit | nvidia-cuda-mps-control; sleep 1
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
CUPY_EP_SKIP_INSTALL=1 GPU_CHECK_STEPS=mps MPS_RANKS_PER_GPU=4 EP_STEP_TIMEOUT_S=230 OUT=$D \
  RUN_GREP="passed|failed|RESULT| ok | FAILED |mps" run gpu_check_mps4 480 bash scripts/gpu_check.sh
tail -12 $D/gpu_check_mps4.log
pgrep -a nvidia-cuda-mps || echo "no MPS process left"
tar czf $OUT/epc.tgz -C /tmp epc; ls -la $OUT
