#!/bin/bash
# S18C (one H200, one rank): the dispatch's receive side polls its index entries with ld.acquire.gpu instead of
# ld.acquire.sys (.carry/vG), against main: at one rank the first row comes in 1.7 us after the counts' prefix
# although every entry was released before it (S18B stamps). Measurement only (gpu scope is not enough, formally,
# for entries a peer GPU writes).
set -u
source benchmarks/experiments/device_env.sh
D=/tmp/s18c; mkdir -p $D
pack() { tar czf $OUT/s18c.tgz -C /tmp s18c; }
B="python3 -m cupy_ep.bench --mode low-latency --ll-stamps"
for v in base vG base2 vG2; do
  case $v in base*) dir=$PWD;; vG*) dir=$PWD/.carry/vG;; esac
  s=$(date +%s); (cd $dir && CUPY_EP_COMMIT=$v PYTHONPATH=/tmp/site:$dir timeout 100 $M -n 1 $B --out $D/llb_$v > $D/ll_bench_$v.log 2>&1)
  echo "ll bench $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_dispatch.*(graph|steady)|VERIF|rror" $D/ll_bench_$v.log | head -6; grep -a "ll_dispatch      phases" $D/ll_bench_$v.log | head -3; pack
done
