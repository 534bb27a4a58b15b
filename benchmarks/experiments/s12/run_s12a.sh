#!/bin/bash
# Device run S12A (HEAD ec15319, i.e. 46ea5e6's kernels): the whole GPU suite (2 ranks), zero-copy soaks
# (12 SMs fused, 24 SMs split) of 2000 iterations, memcheck over a few zero-copy soak iterations.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s12a; mkdir -p $D
echo "commit $(cat .carry/commit)"
trap 'tar czf $OUT/s12a.tgz -C /tmp s12a' EXIT
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 240 $M -n 2 $T tests/gpu > $D/gpu_tests.log 2>&1; echo "gpu suite rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED" $D/gpu_tests.log | head -n 12
for sms in 12 24; do
  s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --zero-copy --num-sms $sms --iters 2000 > $D/soak_zc_$sms.log 2>&1; echo "soak zero-copy $sms SMs rc=$? $(( $(date +%s)-s ))s"; grep -a -E "mismatch|Error" $D/soak_zc_$sms.log | tail -n 3
done
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 150 $M -n 2 compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --zero-copy --num-sms 24 --max-tokens 256 --iters 2 --check-every 1 > $D/san_memcheck_zc.log 2>&1; echo "memcheck zero-copy rc=$? $(( $(date +%s)-s ))s"; grep -a -E "ERROR SUMMARY|mismatch|Error" $D/san_memcheck_zc.log | tail -n 4
