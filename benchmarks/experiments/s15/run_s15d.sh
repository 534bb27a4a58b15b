#!/bin/bash
# Device run S15D: the working tree's dispatch (variant "early counts": warp 0 releases each token's index entries
# after the block barrier, and the receive phase reads the counts with warps 1.. without a barrier first, so the
# last entries' system-scope fences overlap the count loads) against f278fe0 (.carry/vb): LL tests on the variant,
# LL benchmark base / variant / variant with stamps, LL soak and racecheck / synccheck on the variant.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s15d; mkdir -p $D
pack() { tar czf $OUT/s15d.tgz -C /tmp s15d; }
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 150 $M -n 2 $T tests/gpu/test_low_latency.py tests/gpu/test_nvshmem.py > $D/ll_tests.log 2>&1; echo "ll tests rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error" $D/ll_tests.log | head -n 6; pack
B="python3 -m cupy_ep.bench --mode low-latency --iters 100 --ll-token-sweep 128"
for v in base var; do
  if [ $v = base ]; then dir=.carry/vb; c=f278fe0; else dir=.; c=early_counts; fi
  s=$(date +%s); (cd $dir && CUPY_EP_COMMIT=$c PYTHONPATH=/tmp/site:$PWD timeout 90 $M -n 2 $B --out $D/llb_$v > $D/ll_bench_$v.log 2>&1)
  echo "ll bench $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|VERIF|Error" $D/ll_bench_$v.log | head -14; pack
done
s=$(date +%s); CUPY_EP_COMMIT=early_counts PYTHONPATH=/tmp/site:$PWD timeout 120 $M -n 2 $B --ll-stamps --out $D/llb_var_stamps > $D/ll_bench_var_stamps.log 2>&1
echo "ll bench var stamps rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|VERIF|Error" $D/ll_bench_var_stamps.log | head -14; pack
s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000 > $D/ll_soak.log 2>&1; echo "ll soak rc=$? $(( $(date +%s)-s ))s"; tail -n 1 $D/ll_soak.log
for tool in racecheck synccheck; do
  s=$(date +%s); CUPY_EP_TIMEOUT_S=60 PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1 > $D/san_${tool}_ll.log 2>&1
  echo "$tool ll rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "ERROR SUMMARY|RACECHECK SUMMARY|mismatches" $D/san_${tool}_ll.log | sort | uniq -c
done; pack
