#!/bin/bash
# Device run S15B on the committed tree (e57704a's LL combine by the dispatch's slots + 1be223e's intranode combine
# helpers): the whole GPU suite, the LL benchmark with stamps (results), the LL soak, racecheck / synccheck /
# memcheck over the LL soak, intranode soaks (zero-copy and ring), then the normal benchmark (results). Logs in
# /tmp/s15b, packed into $OUT/s15b.tgz after every step (one file comes back).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s15b; mkdir -p $D
pack() { tar czf $OUT/s15b.tgz -C /tmp s15b; }
export CUPY_EP_COMMIT=$(cat .carry/commit)
echo "commit $CUPY_EP_COMMIT"
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 220 $M -n 2 $T tests/gpu > $D/gpu_tests.log 2>&1; echo "gpu suite rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error" $D/gpu_tests.log | head -n 12; pack
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 120 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --ll-stamps --out $D/llb > $D/ll_bench.log 2>&1
echo "ll bench rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|verified|VERIF|Error" $D/ll_bench.log | head -20; pack
s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000 > $D/ll_soak.log 2>&1; echo "ll soak rc=$? $(( $(date +%s)-s ))s"; tail -n 1 $D/ll_soak.log
for tool in racecheck synccheck memcheck; do
  s=$(date +%s); CUPY_EP_TIMEOUT_S=60 PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 4 --check-every 1 > $D/san_${tool}_ll.log 2>&1
  echo "$tool ll rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "ERROR SUMMARY|RACECHECK SUMMARY|mismatches" $D/san_${tool}_ll.log | sort | uniq -c
done; pack
s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 40 $M -n 2 python3 -m cupy_ep.soak --zero-copy --num-sms 24 --iters 1000 > $D/soak_zc_24.log 2>&1; echo "soak zero-copy 24 SMs rc=$? $(( $(date +%s)-s ))s"; grep -a -E "mismatch|Error" $D/soak_zc_24.log | tail -n 2
s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 40 $M -n 2 python3 -m cupy_ep.soak --num-sms 24 --iters 500 > $D/soak_ring_24.log 2>&1; echo "soak ring 24 SMs rc=$? $(( $(date +%s)-s ))s"; grep -a -E "mismatch|Error" $D/soak_ring_24.log | tail -n 2; pack
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 200 $M -n 2 python3 -m cupy_ep.bench --out $D/bench > $D/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s)-s ))s"; grep -a -E "ceiling|verified|FAILED|Error" $D/bench.log | head -n 6; pack
