#!/bin/bash
# Device run S12D: the own rows of the zero-copy dispatch by bulk copies (working tree on top of .carry/commit):
# intranode tests, A/B against the entry-handshake commit (.carry/vS12entry), the own-row block split, soaks.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s12d; mkdir -p $D
echo "base commit $(cat .carry/commit) + working tree"
trap 'tar czf $OUT/s12d.tgz -C /tmp s12d' EXIT
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 150 $M -n 2 $T tests/gpu/test_intranode.py > $D/tests.log 2>&1; echo "intranode tests rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error" $D/tests.log | head -n 20
for tree in entry tma; do
  if [ $tree = entry ]; then P=$PWD/.carry/vS12entry; else P=$PWD; fi
  s=$(date +%s); PYTHONPATH=/tmp/site:$P timeout 150 $M -n 2 python3 benchmarks/experiments/s12/exp_entry.py $tree >> $D/exp_entry.log 2>&1; echo "exp $tree rc=$? $(( $(date +%s)-s ))s"
done
grep -a "\[" $D/exp_entry.log | grep -v "%|" | tail -n 40
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 200 $M -n 2 python3 benchmarks/experiments/s12/exp_local_split.py 24:8,24:4,24:6,24:10,16:8,16:4,16:6,32:8,32:4,32:6,8:0,8:2,8:4,24:8 > $D/split.log 2>&1; echo "split rc=$? $(( $(date +%s)-s ))s"; grep -a "sms=" $D/split.log
for sms in 12 24; do
  s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --zero-copy --num-sms $sms --iters 1000 > $D/soak_zc_$sms.log 2>&1; echo "soak zero-copy $sms SMs rc=$? $(( $(date +%s)-s ))s"; grep -a -E "mismatch|Error" $D/soak_zc_$sms.log | tail -n 3
done
