#!/bin/bash
# S18E (nvidia-h200-x2, lent late in session 18): branch s18-direct (.carry/vdir = main + the low-latency calls on
# the caller's stream) at two ranks: the low-latency test files, the LL soak, then the LL benchmark with the calls
# on the caller's stream (default) and on the comm stream (CUPY_EP_LL_COMM_STREAM=1), alternating, twice each.
set -u
source benchmarks/experiments/device_env.sh
V=$PWD/.carry/vdir
export PYTHONPATH=/tmp/site:$V
D=/tmp/s18e; mkdir -p $D
pack() { tar czf $OUT/s18e.tgz -C /tmp s18e; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $D/gpu.txt 2>&1; cat $D/gpu.txt
cd $V
s=$(date +%s); timeout 170 $M -n 2 $T tests/gpu/test_low_latency.py tests/gpu/test_nvshmem.py tests/gpu/test_zz_low_latency_timeout.py > $D/ll_tests.log 2>&1; echo "ll tests rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed" $D/ll_tests.log | tail -n 2; pack
s=$(date +%s); CUPY_EP_TIMEOUT_S=15 timeout 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000 > $D/ll_soak.log 2>&1; echo "soak rc=$? $(( $(date +%s)-s ))s"; tail -n 1 $D/ll_soak.log; pack
for v in direct comm direct2 comm2; do
  case $v in direct*) e="CUPY_EP_LL_COMM_STREAM=0";; comm*) e="CUPY_EP_LL_COMM_STREAM=1";; esac
  s=$(date +%s); env $e CUPY_EP_COMMIT=27fab36 timeout 90 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --out $D/llb_$v > $D/ll_bench_$v.log 2>&1
  echo "ll bench $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|VERIF|rror" $D/ll_bench_$v.log | head -12; pack
done
