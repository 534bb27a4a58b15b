#!/bin/bash
# S22D (kind nvidia-h200: one GPU; carry [".carry"]): compute-sanitizer memcheck over the LL soak at 2 ranks sharing
# the GPU on the IPC transport (peer stores checked against the peers' mapped allocations), then the low-latency
# start-up per transport at one rank (ll_startup.py: Buffer, first dispatch + combine, destroy), alternating.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s22d; mkdir -p $D
pack() { tar czf $OUT/s22d.tgz -C /tmp s22d; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "passed|failed|mismatches|ERROR SUMMARY|ll_startup" $D/$name.log | sort | uniq -c | tail -n 6; pack; }
for t in nvshmem ipc nvshmem ipc nvshmem ipc; do run startup_$t 60 $M -n 1 python3 benchmarks/experiments/s22/ll_startup.py $t; done
(export CUPY_EP_LL_TRANSPORT=ipc CUPY_EP_TIMEOUT_S=60
 run memcheck_ipc_n2 240 $M -n 2 compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 3 --check-every 1)
