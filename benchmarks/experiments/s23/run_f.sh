#!/bin/bash
# S23F (kind nvidia-h200-x2: TWO GPUs, lent late in session 23 with ~800 s of device time left; carry [".carry"];
# CUPY_EP_COMMIT=<HEAD>): the first EP2 run since session 17, the results only: the LL benchmark on NVSHMEM with
# stamps, the warm-start A/B at EP2 (2 runs each way), then the normal-mode main job (scripts/bench.sh).
set -u
source benchmarks/experiments/device_env.sh
export PYTHONPATH=/tmp/site:$PWD
logs_in s23f
nvidia-smi topo -m > $D/topo.log 2>&1
RUN_GREP="^  ll_.*(graph|aligned|steady)|verified|Error|error"
run results_ll 150 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --ll-stamps --out $D/results_ll
SP=benchmarks/experiments/s23/startup_probe.py
for i in 1 2; do RUN_GREP="^rank" run probe_ovl_$i 60 $M -n 2 python3 $SP; RUN_GREP="^rank" run probe_plain_$i 60 $M -n 2 python3 $SP --plain; done
RUN_GREP="ceiling|verified|warm start|Error" CUPY_EP_SKIP_INSTALL=1 run bench 330 bash scripts/bench.sh --out $D/bench
