#!/bin/bash
# Device run S13A: warm-start diagnostics; LL A/B: vA (HEAD) / vB1 (combine flagger warp) / vB2 (B1 + two chunks
# per thread) / vC (B2 + bf16 partials on the wire) / vA again; LL soak + racecheck/synccheck on vB2.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
D=/tmp/s13a; mkdir -p $D
trap 'tar czf $OUT/s13a.tgz -C /tmp s13a' EXIT
cd .carry/vA
PYTHONPATH=/tmp/site:$PWD python3 -X importtime -c "import cupy_ep" 2> $D/imp_ep.log
PYTHONPATH=/tmp/site:$PWD python3 -X importtime -c "import cupy_ep, cupy; cupy.cuda.runtime.getDeviceCount()" 2> $D/imp_ep_cupy.log
for c in "pass" "import numpy" "import cupy_ep" "import cupy_ep, cupy" "import cupy_ep, cupy; cupy.cuda.runtime.getDeviceCount()"; do
  for i in 1 2 3; do TIMEFORMAT="$c: %R"; time PYTHONPATH=/tmp/site:$PWD python3 -c "$c"; done
done > $D/py_times.log 2>&1
cat $D/py_times.log
for i in 1 2; do PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 ../warm_start_profile.py > $D/ws_$i.log 2>&1; head -n 1 $D/ws_$i.log; done
cd ../..
for v in vA vB1 vB2 vC vA; do
  s=$(date +%s); (cd .carry/$v && CUPY_EP_COMMIT=$v PYTHONPATH=/tmp/site:$PWD timeout 110 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --iters 100 --ll-token-sweep 128 --out $D/llb_$v > $D/ll_bench_$v.log 2>&1)
  echo "ll bench $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|VERIF|Error|rror" $D/ll_bench_$v.log | head -8
done
for v in vB2 vC; do
s=$(date +%s); (cd .carry/$v && CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 40 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000 > $D/ll_soak_$v.log 2>&1); echo "ll soak $v rc=$? $(( $(date +%s)-s ))s"; tail -n 1 $D/ll_soak_$v.log
done
for tool in racecheck synccheck; do
  s=$(date +%s); (cd .carry/vB2 && PYTHONPATH=/tmp/site:$PWD timeout 70 $M -n 2 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 2 --check-every 1 > $D/san_${tool}_ll.log 2>&1)
  echo "$tool ll rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "ERROR SUMMARY|RACECHECK SUMMARY|mismatches" $D/san_${tool}_ll.log | sort | uniq -c
done
