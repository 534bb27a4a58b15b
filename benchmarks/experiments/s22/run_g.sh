#!/bin/bash
# S22G (kind nvidia-h200: one GPU; carry [".carry"]): after S22F's llipc8 (8 ranks on the one GPU: 6 failures per
# rank, all test premises: the normal-mode test's 20 SMs x 8 ranks, formats that one expert's partial cannot tell
# apart, a 3.7 GB allgather): the LL files over IPC at 8 and 2 ranks.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD CUPY_EP_LL_TRANSPORT=ipc
D=/tmp/s22g; mkdir -p $D
pack() { tar czf $OUT/s22g.tgz -C /tmp s22g; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed" $D/$name.log | sort | uniq -c | tail -n 6; pack; }
F="tests/gpu/test_low_latency.py tests/gpu/test_zz_low_latency_timeout.py"
run ll_ipc_n8 170 $M -n 8 $T $F
run ll_ipc_n2 80 $M -n 2 $T $F
