#!/bin/bash
# Device run S12J: the zero-copy combine's releases moved to a flagger warp per store block (working tree on top of
# .carry/commit): intranode tests, zero-copy soaks, racecheck/memcheck over the zero-copy soak, store-block splits
# against b8fe092 (.carry/vS12b8, the same kernels as the commit).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s12j; mkdir -p $D
echo "base commit $(cat .carry/commit) + working tree"
trap 'tar czf $OUT/s12j.tgz -C /tmp s12j' EXIT
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 120 $M -n 2 $T tests/gpu/test_intranode.py > $D/tests.log 2>&1; echo "intranode tests rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error" $D/tests.log | head -n 8
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD/.carry/vS12b8 timeout 100 $M -n 2 python3 benchmarks/experiments/s12/exp_split2.py b8fe092 "" "24:9,16:6" > $D/split_old.log 2>&1; echo "split old rc=$? $(( $(date +%s)-s ))s"; grep -a "\[" $D/split_old.log | grep -v "%|"
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 150 $M -n 2 python3 benchmarks/experiments/s12/exp_split2.py flagger "" "24:9,24:8,24:10,24:11,24:12,16:6,16:7,16:8,32:9,32:12,8:3,24:9" > $D/split_new.log 2>&1; echo "split new rc=$? $(( $(date +%s)-s ))s"; grep -a "\[" $D/split_new.log | grep -v "%|"
for sms in 12 24; do
  s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --zero-copy --num-sms $sms --iters 1500 > $D/soak_zc_$sms.log 2>&1; echo "soak zero-copy $sms SMs rc=$? $(( $(date +%s)-s ))s"; grep -a -E "mismatch|Error" $D/soak_zc_$sms.log | tail -n 2
done
for tool in racecheck memcheck; do
  s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --zero-copy --num-sms 24 --max-tokens 256 --iters 2 --check-every 1 > $D/san_${tool}_zc.log 2>&1; echo "$tool zero-copy rc=$? $(( $(date +%s)-s ))s"; grep -a -E "SUMMARY|mismatch|Error" $D/san_${tool}_zc.log | tail -n 3
done
