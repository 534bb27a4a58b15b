#!/bin/bash
# Device run S16B: the working tree (vADRH = vADR + every thread's histogram entry loaded at the kernel's start)
# against 9e68e9a (.carry/vbase), vAD (S16A's variant) and vADR (vAD + the first token's x chunk and top-k row
# loaded before warp 0's staging, the buffer check after the first message): LL tests, soak and racecheck on the
# working tree; then the LL benchmark with stamps, base / vADRH / vAD / vADR / base / vADRH.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s16b; mkdir -p $D
pack() { tar czf $OUT/s16b.tgz -C /tmp s16b; }
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 170 $M -n 2 $T tests/gpu/test_low_latency.py tests/gpu/test_nvshmem.py tests/gpu/test_zz_low_latency_timeout.py > $D/ll_tests.log 2>&1; echo "ll tests rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error" $D/ll_tests.log | head -n 8; pack
s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000 > $D/ll_soak.log 2>&1; echo "ll soak rc=$? $(( $(date +%s)-s ))s"; tail -n 1 $D/ll_soak.log; pack
s=$(date +%s); CUPY_EP_TIMEOUT_S=60 PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 compute-sanitizer --tool racecheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1 > $D/san_racecheck_ll.log 2>&1
echo "racecheck ll rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "ERROR SUMMARY|RACECHECK SUMMARY|mismatches" $D/san_racecheck_ll.log | sort | uniq -c; pack
B="python3 -m cupy_ep.bench --mode low-latency --iters 100 --ll-token-sweep 128 --ll-stamps"
for v in base vADRH vAD vADR base2 vADRH2; do
  case $v in base|base2) dir=.carry/vbase; c=9e68e9a;; vAD) dir=.carry/vAD; c=vAD;; vADR) dir=.carry/vADR; c=vADR;; *) dir=.; c=vADRH;; esac
  s=$(date +%s); (cd $dir && CUPY_EP_COMMIT=$c PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 $B --out $D/llb_$v > $D/ll_bench_$v.log 2>&1)
  echo "ll bench $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_dispatch.*(graph|steady)|VERIF|Error" $D/ll_bench_$v.log | head -4; grep -a "ll_dispatch      phases" $D/ll_bench_$v.log; pack
done
