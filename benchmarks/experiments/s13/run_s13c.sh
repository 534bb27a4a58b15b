#!/bin/bash
# Device run S13C: LL combine A/B: vH (452f390) / vD (+ flagger warp) / vE (vD + two chunks per thread), each
# with 24-bit and bf16 partials; then vH and vD again; LL soaks of vD and vE, racecheck + synccheck of vD.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
D=/tmp/s13c; mkdir -p $D
trap 'tar czf $OUT/s13c.tgz -C /tmp s13c' EXIT
i=0
for v in vH vD vE vH vD; do
  i=$((i+1))
  s=$(date +%s); (cd .carry/$v && CUPY_EP_COMMIT=$v PYTHONPATH=/tmp/site:$PWD timeout 110 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --iters 100 --ll-token-sweep 128 --out $D/llb_${i}_$v > $D/ll_bench_${i}_$v.log 2>&1)
  echo "ll bench $i $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|VERIF|Error|rror" $D/ll_bench_${i}_$v.log | head -8
done
for v in vD vE; do
s=$(date +%s); (cd .carry/$v && CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 40 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000 > $D/ll_soak_$v.log 2>&1); echo "ll soak $v rc=$? $(( $(date +%s)-s ))s"; tail -n 1 $D/ll_soak_$v.log
done
for tool in racecheck synccheck; do
  s=$(date +%s); (cd .carry/vD && PYTHONPATH=/tmp/site:$PWD timeout 70 $M -n 2 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 3 --check-every 1 > $D/san_${tool}_ll.log 2>&1)
  echo "$tool ll vD rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "ERROR SUMMARY|RACECHECK SUMMARY|mismatches" $D/san_${tool}_ll.log | sort | uniq -c
done
