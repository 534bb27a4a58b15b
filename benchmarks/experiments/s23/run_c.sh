#!/bin/bash
# S23C (kind nvidia-h200: one GPU; carry [".carry"]): the README's test command on the GPU machine after the lazy
# `import cupy_ep`, start_mpi and the IPC buffers' peer-access check (CUPY_EP_SKIP_INSTALL=1: the image's python;
# the pytest-mpi wheel in /tmp/site).
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site
logs_in s23c
RUN_GREP="passed|failed|RESULT| ok | FAILED "
CUPY_EP_SKIP_INSTALL=1 EP_STEP_TIMEOUT_S=240 run test_sh 420 bash scripts/test.sh
