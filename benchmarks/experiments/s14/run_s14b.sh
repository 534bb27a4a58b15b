#!/bin/bash
# Device run S14B: the combine with prepare_batch and cp.async partial sums, 2 chunks per thread (working tree): LL GPU tests, LL soak, LL benchmark with stamps,
# then 6a0960d's LL bench (same session) for A/B. Logs straight to $OUT.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=$OUT/s14b; mkdir -p $D
export CUPY_EP_COMMIT=$(cat .carry/commit)
echo "commit $CUPY_EP_COMMIT"
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 150 $M -n 2 $T tests/gpu/test_low_latency.py tests/gpu/test_nvshmem.py > $D/ll_tests.log 2>&1; echo "ll tests rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error" $D/ll_tests.log | head -n 12
s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000 > $D/ll_soak.log 2>&1; echo "ll soak rc=$? $(( $(date +%s)-s ))s"; tail -n 1 $D/ll_soak.log
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 120 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --ll-stamps --out $D/llb > $D/ll_bench.log 2>&1
echo "ll bench rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|verified|VERIF|Error" $D/ll_bench.log | head -20
s=$(date +%s); (cd .carry/vHEAD && CUPY_EP_COMMIT=6a0960d PYTHONPATH=/tmp/site:$PWD timeout 80 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --iters 100 --ll-token-sweep 128 --out $D/llb_head > $D/ll_bench_head.log 2>&1)
echo "ll bench 6a0960d rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|VERIF|Error" $D/ll_bench_head.log | head -12
