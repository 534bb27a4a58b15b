#!/bin/bash
# Device run S15E on d9aaed4 (the final kernels): the LL benchmark with stamps (results), memcheck over the LL soak,
# then the A/B f278fe0 (.carry/vb) against d9aaed4, plain, same session.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
D=/tmp/s15e; mkdir -p $D
pack() { tar czf $OUT/s15e.tgz -C /tmp s15e; }
export CUPY_EP_COMMIT=$(cat .carry/commit)
echo "commit $CUPY_EP_COMMIT"
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 120 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --ll-stamps --out $D/llb > $D/ll_bench.log 2>&1
echo "ll bench rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|verified|VERIF|Error" $D/ll_bench.log | head -20; pack
s=$(date +%s); CUPY_EP_TIMEOUT_S=60 PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1 > $D/san_memcheck_ll.log 2>&1
echo "memcheck ll rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "ERROR SUMMARY|mismatches" $D/san_memcheck_ll.log | sort | uniq -c; pack
B="python3 -m cupy_ep.bench --mode low-latency --iters 100 --ll-token-sweep 128"
for v in base final; do
  if [ $v = base ]; then dir=.carry/vb; c=f278fe0; else dir=.; c=$CUPY_EP_COMMIT; fi
  s=$(date +%s); (cd $dir && CUPY_EP_COMMIT=$c PYTHONPATH=/tmp/site:$PWD timeout 90 $M -n 2 $B --out $D/llb_$v > $D/ll_bench_$v.log 2>&1)
  echo "ll bench $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|VERIF|Error" $D/ll_bench_$v.log | head -14; pack
done
