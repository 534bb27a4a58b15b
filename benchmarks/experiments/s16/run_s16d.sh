#!/bin/bash
# Device run S16D on 3c9afd4: the GPU suite with ranks sharing the GPUs (4 ranks, 2 per GPU; the low-latency files
# need one GPU per rank and skip), then the intranode tests at 8 ranks (4 per GPU). Not run since session 12; the
# ring / zero-copy combines' source lists were refactored since (1be223e).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s16d; mkdir -p $D
pack() { tar czf $OUT/s16d.tgz -C /tmp s16d; }
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 230 $M -n 4 $T tests/gpu > $D/gpu_suite_4.log 2>&1; echo "gpu suite 4 ranks rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED" $D/gpu_suite_4.log | sort | uniq -c | head -n 8; pack
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 8 $T tests/gpu/test_intranode.py > $D/intranode_8.log 2>&1; echo "intranode 8 ranks rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED" $D/intranode_8.log | sort | uniq -c | head -n 8; pack
