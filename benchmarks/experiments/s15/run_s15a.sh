#!/bin/bash
# Device run S15A: the LL GPU tests on the working tree (the combine finds its rows by the dispatch's topk_slots),
# then the LL benchmark A/B: new, 3440986 (.carry/v0), new again; the LL soak on the new tree. Logs to $OUT.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=$OUT/s15a; mkdir -p $D
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 150 $M -n 2 $T tests/gpu/test_low_latency.py tests/gpu/test_nvshmem.py > $D/ll_tests.log 2>&1; echo "ll tests rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error" $D/ll_tests.log | head -n 12
B="python3 -m cupy_ep.bench --mode low-latency --iters 100 --ll-token-sweep 128"
for v in new old new2; do
  if [ $v = old ]; then dir=.carry/v0; c=3440986; else dir=.; c=slots; fi
  s=$(date +%s); (cd $dir && CUPY_EP_COMMIT=$c PYTHONPATH=/tmp/site:$PWD timeout 90 $M -n 2 $B --out $D/llb_$v > $D/ll_bench_$v.log 2>&1)
  echo "ll bench $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|VERIF|Error" $D/ll_bench_$v.log | head -14
done
s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000 > $D/ll_soak.log 2>&1; echo "ll soak rc=$? $(( $(date +%s)-s ))s"; tail -n 1 $D/ll_soak.log
