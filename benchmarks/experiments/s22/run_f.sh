#!/bin/bash
# S22F (kind nvidia-h200: one GPU; carry [".carry"]): the README's test command on a GPU machine
# (CUPY_EP_SKIP_INSTALL=1: the image's python; the pytest-mpi wheel in /tmp/site), whose GPU part now ends with the
# LL files at 2 ranks over IPC; then the bootstrap file (incl. the raw-access test) at 2 ranks sharing the GPU.
# Part "llipc": scripts/gpu_check.sh's new llipc step (the LL files over IPC at 4 and 8 ranks on the one GPU).
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site
part=${1:-1}
D=/tmp/s22f$part; mkdir -p $D
pack() { tar czf $OUT/s22f$part.tgz -C /tmp s22f$part; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|RESULT| ok | FAILED " $D/$name.log | sort | uniq -c | tail -n 12; pack; }
if [ "$part" = 1 ]; then
    CUPY_EP_SKIP_INSTALL=1 EP_STEP_TIMEOUT_S=240 run test_sh 380 bash scripts/test.sh
    PYTHONPATH=/tmp/site:$PWD run bootstrap_n2 90 $M -n 2 $T tests/gpu/test_bootstrap.py
else
    OUT_SAVE=$OUT; export OUT=$D
    GPU_CHECK_STEPS="llipc" EP_STEP_TIMEOUT_S=200 run gpu_check_llipc 420 bash scripts/gpu_check.sh
    OUT=$OUT_SAVE; pack
fi
