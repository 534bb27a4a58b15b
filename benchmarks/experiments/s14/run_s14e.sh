#!/bin/bash
# Device run S14E: A/B of 3440986 (the checkout) against vP (no compute_sync per handed-off token on the expert
# side), the LL soak on vP, then vS (3440986 with two extra combine stamps: send_prepared = the first remote batch
# prepared, send_end = its first token stored) with --ll-stamps. Logs straight to $OUT.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
D=$OUT/s14e; mkdir -p $D
B="python3 -m cupy_ep.bench --mode low-latency --iters 100 --ll-token-sweep 128"
s=$(date +%s); CUPY_EP_COMMIT=$(cat .carry/commit) PYTHONPATH=/tmp/site:$PWD timeout 80 $M -n 2 $B --out $D/llb_head > $D/ll_bench_head.log 2>&1
echo "ll bench HEAD rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_comb.*(graph|steady)|VERIF|Error" $D/ll_bench_head.log | head -12
s=$(date +%s); (cd .carry/vP && CUPY_EP_COMMIT=vP PYTHONPATH=/tmp/site:$PWD timeout 80 $M -n 2 $B --out $D/llb_vP > $D/ll_bench_vP.log 2>&1)
echo "ll bench vP rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_comb.*(graph|steady)|VERIF|Error" $D/ll_bench_vP.log | head -12
s=$(date +%s); (cd .carry/vP && CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000 > $D/ll_soak_vP.log 2>&1); echo "ll soak vP rc=$? $(( $(date +%s)-s ))s"; tail -n 1 $D/ll_soak_vP.log
s=$(date +%s); (cd .carry/vS && CUPY_EP_COMMIT=vS PYTHONPATH=/tmp/site:$PWD timeout 90 $M -n 2 $B --ll-stamps --out $D/llb_vS > $D/ll_bench_vS.log 2>&1)
echo "ll bench vS rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_comb.*(graph|steady|phases|slowest)|VERIF|Error" $D/ll_bench_vS.log | head -20
