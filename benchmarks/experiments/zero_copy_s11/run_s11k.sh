#!/bin/bash
# Device runs S11K (two short commands, the device time nearly spent): after the warp_copy_to_targets fix, the
# intranode tests of the small/odd hidden sizes and num_worst_tokens, then zero-copy soaks at 12 and 24 SMs.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15 CUPY_EP_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
PYTHONPATH=/tmp/site:$PWD timeout 40 $M -n 2 python3 -m pytest --with-mpi -p no:cacheprovider -q --color=no tests/gpu/test_intranode.py -k "hidden128 or hidden320 or hidden2112 or worst" > $OUT/t.log 2>&1
for sms in 12 24; do PYTHONPATH=$PWD timeout 22 $M -n 2 python3 -m cupy_ep.soak --zero-copy --num-sms $sms --iters 300 > $OUT/soak_$sms.log 2>&1; done
# second command
for sms in 12 24; do PYTHONPATH=$PWD timeout 28 $M -n 2 python3 -m cupy_ep.soak --zero-copy --num-sms $sms --start 300 --iters 1000 > $OUT/soak_$sms.log 2>&1; done
