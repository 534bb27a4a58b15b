#!/bin/bash
# Device run S12I: zero-copy combine rows per flag (and the same without the release fence: unsafe, to measure its
# cost), copy-engine transfer rates for a possible DMA combine.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
D=/tmp/s12i; mkdir -p $D
echo "commit $(cat .carry/commit)"
trap 'tar czf $OUT/s12i.tgz -C /tmp s12i' EXIT
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 python3 benchmarks/experiments/s12/exp_flags.py release 2,1,4,8,2 > $D/flags.log 2>&1; echo "flags rc=$? $(( $(date +%s)-s ))s"; grep -a "\[" $D/flags.log | grep -v "%|"
s=$(date +%s); CUPY_EP_TIMEOUT_S=10 PYTHONPATH=/tmp/site:$PWD/.carry/vS12nofence timeout 100 $M -n 2 python3 benchmarks/experiments/s12/exp_flags.py no-fence 2,8 > $D/flags_nofence.log 2>&1; echo "flags no-fence rc=$? $(( $(date +%s)-s ))s"; grep -a "\[" $D/flags_nofence.log | grep -v "%|"
s=$(date +%s); timeout 100 $M -n 2 python3 benchmarks/experiments/s12/exp_ce.py > $D/ce.log 2>&1; echo "ce rc=$? $(( $(date +%s)-s ))s"; grep -a "CE" $D/ce.log
