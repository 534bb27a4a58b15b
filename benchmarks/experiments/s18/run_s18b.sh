#!/bin/bash
# S18B (one H200): the low-latency calls on the caller's stream (branch s18-direct, the checkout) against main
# (.carry/vmain) and against the same tree with CUPY_EP_LL_COMM_STREAM=1, at ONE rank (the two-GPU kind was not
# lent; a rank's own rows only, but the launch path and the gaps between kernels are the same).
set -u
source benchmarks/experiments/device_env.sh
D=/tmp/s18b; mkdir -p $D
pack() { tar czf $OUT/s18b.tgz -C /tmp s18b; }
B="python3 -m cupy_ep.bench --mode low-latency --ll-stamps"
for v in direct comm direct2 comm2; do
  case $v in main*) dir=$PWD/.carry/vmain; env="";; direct*) dir=$PWD; env="";; comm*) dir=$PWD; env="CUPY_EP_LL_COMM_STREAM=1";; esac
  s=$(date +%s); (cd $dir && env $env CUPY_EP_COMMIT=$v PYTHONPATH=/tmp/site:$dir timeout 100 $M -n 1 $B --out $D/llb_$v > $D/ll_bench_$v.log 2>&1)
  echo "ll bench $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|VERIF|Error|rror" $D/ll_bench_$v.log | head -14; grep -a "phases" $D/ll_bench_$v.log | head -4; pack
done
