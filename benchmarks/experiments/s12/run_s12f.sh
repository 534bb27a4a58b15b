#!/bin/bash
# Device run S12F (final, part 2): intranode tests at 4 and 8 ranks (ranks sharing the GPUs), zero-copy soaks,
# the four sanitizers over the zero-copy soak and memcheck over the ring soak.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s12f; mkdir -p $D
echo "commit $(cat .carry/commit)"
trap 'tar czf $OUT/s12f.tgz -C /tmp s12f' EXIT
for n in 4 8; do
  s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 150 $M -n $n $T tests/gpu/test_intranode.py > $D/intranode_$n.log 2>&1; echo "intranode $n ranks rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED" $D/intranode_$n.log | sort | uniq -c | head -n 6
done
for sms in 12 24; do
  s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --zero-copy --num-sms $sms --iters 2000 > $D/soak_zc_$sms.log 2>&1; echo "soak zero-copy $sms SMs rc=$? $(( $(date +%s)-s ))s"; grep -a -E "mismatch|Error" $D/soak_zc_$sms.log | tail -n 2
done
for tool in memcheck racecheck synccheck initcheck; do
  s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --zero-copy --num-sms 24 --max-tokens 256 --iters 2 --check-every 1 > $D/san_${tool}_zc.log 2>&1; echo "$tool zero-copy rc=$? $(( $(date +%s)-s ))s"; grep -a -E "SUMMARY|mismatch|Error" $D/san_${tool}_zc.log | tail -n 3
done
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --max-tokens 256 --iters 2 --check-every 1 > $D/san_memcheck_ring.log 2>&1; echo "memcheck ring rc=$? $(( $(date +%s)-s ))s"; grep -a -E "SUMMARY|mismatch|Error" $D/san_memcheck_ring.log | tail -n 3
