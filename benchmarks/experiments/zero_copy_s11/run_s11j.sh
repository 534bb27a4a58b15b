#!/bin/bash
# Device run S11J: zero-copy soaks (12 SMs: dispatch fused, 24 SMs: role split), the ring soak, memcheck and
# racecheck over a few zero-copy iterations.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
D=/tmp/s11j; mkdir -p $D
echo "commit $(cat .carry/commit)"
trap 'tar czf $OUT/s11j.tgz -C /tmp s11j' EXIT
for sms in 12 24; do
  s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 python3 -m cupy_ep.soak --zero-copy --num-sms $sms --iters 1500 > $D/soak_zc_$sms.log 2>&1; echo "soak zero-copy $sms SMs rc=$? $(( $(date +%s)-s ))s"; grep -a -E "mismatch|MISMATCH|Error" $D/soak_zc_$sms.log | tail -n 3
done
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 80 $M -n 2 python3 -m cupy_ep.soak --iters 1000 > $D/soak_ring.log 2>&1; echo "soak ring rc=$? $(( $(date +%s)-s ))s"; grep -a -E "mismatch|MISMATCH|Error" $D/soak_ring.log | tail -n 3
for tool in memcheck racecheck; do
  s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 120 $M -n 2 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --zero-copy --num-sms 24 --max-tokens 300 --iters 3 --check-every 1 > $D/san_${tool}_zc.log 2>&1; echo "$tool zero-copy rc=$? $(( $(date +%s)-s ))s"; grep -a -E "ERROR SUMMARY|mismatch|Error" $D/san_${tool}_zc.log | tail -n 4
done
