#!/bin/bash
# S18D (one H200): main's low-latency file and soak at one rank, branch s18-direct's (.carry/vdir) file at one rank,
# and main's GPU files at two ranks sharing the GPU (normal mode; the low-latency files skip there), after the jit
# shared-memory fix.
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
D=/tmp/s18d; mkdir -p $D
pack() { tar czf $OUT/s18d.tgz -C /tmp s18d; }
run() { local name=$1 lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $D/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|mismatches" $D/$name.log | tail -n 2; pack; }
run ll1_main 120 $M -n 1 $T tests/gpu/test_low_latency.py -rs
(export CUPY_EP_TIMEOUT_S=15; run soak1_main 90 $M -n 1 python3 -m cupy_ep.soak --mode low-latency --iters 1000)
(cd .carry/vdir && export PYTHONPATH=/tmp/site:$PWD && run ll1_direct 120 $M -n 1 $T tests/gpu/test_low_latency.py -rs)
run gpu2_shared_main 240 $M -n 2 $T tests/gpu --ignore=tests/gpu/test_internode.py -rs
