#!/bin/bash
# S17B: the low-latency dispatch at 1024 threads (checkout) / 512 threads (dispatch_512_threads_untested.patch) /
# 512 threads with 8 loads per lane in flight in the receive copies (v512b: a unit in one pass), two rounds
# alternating, token sweep 0/16/64/128 (steady), no stamps; then v512b with stamps.
# The variant trees come in .carry/v512 and .carry/v512b (git archive of the checkout, patched).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
M="mpirun --oversubscribe --bind-to none"
D=/tmp/s17b; mkdir -p $D
pack() { tar czf $OUT/s17b.tgz -C /tmp s17b; }
B="python3 -m cupy_ep.bench --mode low-latency --ll-token-sweep 0,16,64,128"
run() {  # run NAME DIR EXTRA...
  local v=$1 dir=$2; shift 2
  s=$(date +%s); (cd $dir && CUPY_EP_COMMIT=$v PYTHONPATH=$PWD timeout 100 $M -n 2 $B "$@" --out $D/llb_$v > $D/ll_bench_$v.log 2>&1)
  echo "$v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_dispatch.*(graph|steady)|VERIF|Error" $D/ll_bench_$v.log | head -8; pack
}
for r in 1 2; do
  run base$r $PWD; run v512_$r $PWD/.carry/v512; run v512b_$r $PWD/.carry/v512b
done
run v512b_stamps $PWD/.carry/v512b --ll-stamps; grep -a "ll_dispatch      phases" $D/ll_bench_v512b_stamps.log
