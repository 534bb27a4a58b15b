#!/bin/bash
# Device run S15C on the race fix (the owner side syncs after staging its begins): the whole GPU suite, the LL
# benchmark with stamps (results), the LL soak, racecheck / synccheck / memcheck over the LL soak. Logs in
# /tmp/s15c, packed into $OUT/s15c.tgz after every step.

set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s15c; mkdir -p $D
pack() { tar czf $OUT/s15c.tgz -C /tmp s15c; }
export CUPY_EP_COMMIT=$(cat .carry/commit)
echo "commit $CUPY_EP_COMMIT"
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 220 $M -n 2 $T tests/gpu > $D/gpu_tests.log 2>&1; echo "gpu suite rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error" $D/gpu_tests.log | head -n 12; pack
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 120 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --ll-stamps --out $D/llb > $D/ll_bench.log 2>&1
echo "ll bench rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|verified|VERIF|Error" $D/ll_bench.log | head -20; pack
s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000 > $D/ll_soak.log 2>&1; echo "ll soak rc=$? $(( $(date +%s)-s ))s"; tail -n 1 $D/ll_soak.log
for tool in racecheck synccheck memcheck; do
  s=$(date +%s); CUPY_EP_TIMEOUT_S=60 PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1 > $D/san_${tool}_ll.log 2>&1
  echo "$tool ll rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "ERROR SUMMARY|RACECHECK SUMMARY|mismatches" $D/san_${tool}_ll.log | sort | uniq -c
done; pack
