#!/bin/bash
# S23D (kind nvidia-h200; carry [".carry"]): test_mpi_start.py on Open MPI (S23C: its children lost
# OMPI_ALLOW_RUN_AS_ROOT* with the launcher's variables, so the singleton start refused; the file now keeps the
# environment and skips itself under mpirun), then S22G's unfinished run: the LL files over IPC at 8 ranks on the
# one GPU, with the time they need.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
logs_in s23d
run mpi_start 120 python3 -m pytest -p no:cacheprovider -q -rs --color=no tests/test_mpi_start.py
CUPY_EP_LL_TRANSPORT=ipc run ll_ipc_n8 330 $M -n 8 $T tests/gpu/test_low_latency.py tests/gpu/test_zz_low_latency_timeout.py
