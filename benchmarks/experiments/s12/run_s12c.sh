#!/bin/bash
# Device run S12C: the entry handshake (working tree on top of the commit in .carry/commit): intranode and timeout
# tests, the A/B experiment (old tree .carry/vS12old = that commit, then the new tree), zero-copy soaks.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s12c; mkdir -p $D
echo "base commit $(cat .carry/commit) + working tree"
trap 'tar czf $OUT/s12c.tgz -C /tmp s12c' EXIT
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 150 $M -n 2 $T tests/gpu/test_intranode.py tests/gpu/test_zz_timeout.py > $D/tests.log 2>&1; echo "intranode + timeout tests rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error" $D/tests.log | head -n 20
for tree in new old new; do
  if [ $tree = old ]; then P=$PWD/.carry/vS12old; else P=$PWD; fi
  s=$(date +%s); PYTHONPATH=/tmp/site:$P timeout 150 $M -n 2 python3 benchmarks/experiments/s12/exp_entry.py $tree >> $D/exp_entry.log 2>&1; echo "exp $tree rc=$? $(( $(date +%s)-s ))s"
done
grep -a "\[" $D/exp_entry.log | grep -v "%|" | tail -n 40
for sms in 12 24; do
  s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --zero-copy --num-sms $sms --iters 1000 > $D/soak_zc_$sms.log 2>&1; echo "soak zero-copy $sms SMs rc=$? $(( $(date +%s)-s ))s"; grep -a -E "mismatch|Error" $D/soak_zc_$sms.log | tail -n 3
done
