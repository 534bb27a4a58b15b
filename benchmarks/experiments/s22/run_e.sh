#!/bin/bash
# S22E (kind nvidia-h200: one GPU; carry [".carry"]): after S22D's 3-iteration memcheck (0 errors): every
# compute-sanitizer tool over the LL soak at 2 ranks sharing the GPU on the IPC transport, 12 iterations each.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s22e; mkdir -p $D
pack() { tar czf $OUT/s22e.tgz -C /tmp s22e; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "mismatches|ERROR SUMMARY|RACECHECK SUMMARY" $D/$name.log | sort | uniq -c | tail -n 6; pack; }
export CUPY_EP_LL_TRANSPORT=ipc CUPY_EP_TIMEOUT_S=60
for tool in memcheck racecheck synccheck initcheck; do
    run ${tool}_ipc_n2 120 $M -n 2 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 12 --check-every 1
done
