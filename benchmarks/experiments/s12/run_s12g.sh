#!/bin/bash
# Device run S12G: rows with one destination as bulk (TMA) copies, also to the peer (dispatch) and in the combine's
# store blocks (working tree on top of .carry/commit): intranode tests, zero-copy soaks, block splits against b8fe092.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s12g; mkdir -p $D
echo "base commit $(cat .carry/commit) + working tree"
trap 'tar czf $OUT/s12g.tgz -C /tmp s12g' EXIT
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 120 $M -n 2 $T tests/gpu/test_intranode.py > $D/tests.log 2>&1; echo "intranode tests rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error" $D/tests.log | head -n 8
for sms in 12 24; do
  s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --zero-copy --num-sms $sms --iters 1000 > $D/soak_zc_$sms.log 2>&1; echo "soak zero-copy $sms SMs rc=$? $(( $(date +%s)-s ))s"; grep -a -E "mismatch|Error" $D/soak_zc_$sms.log | tail -n 2
done
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD/.carry/vS12b8 timeout 100 $M -n 2 python3 benchmarks/experiments/s12/exp_split2.py b8fe092 "16:8,24:8" "24:9,16:6" > $D/split_old.log 2>&1; echo "split old rc=$? $(( $(date +%s)-s ))s"; grep -a "\[" $D/split_old.log | grep -v "%|"
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 200 $M -n 2 python3 benchmarks/experiments/s12/exp_split2.py tma "16:8,24:8,12:8,12:6,16:6,16:4,20:8,24:6,24:4,8:0,8:2,8:4" "24:9,24:4,24:6,24:8,24:10,24:12,16:4,16:6,16:8,32:12" > $D/split_new.log 2>&1; echo "split new rc=$? $(( $(date +%s)-s ))s"; grep -a "\[" $D/split_new.log | grep -v "%|"
