#!/bin/bash
# Device run S16C: 3c9afd4 (vAR: counters on mbarriers + the first token's loads first) against 30d29b1 (vADR:
# + the own index entries released at GPU scope; branch s16-vadr, .carry/vADR): LL soak and racecheck on 3c9afd4,
# the LL benchmark with stamps (default token sweep 0, 128) vAR / vADR / vAR / vADR, then the whole GPU suite on
# 3c9afd4.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s16c; mkdir -p $D
pack() { tar czf $OUT/s16c.tgz -C /tmp s16c; }
s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000 > $D/ll_soak.log 2>&1; echo "ll soak rc=$? $(( $(date +%s)-s ))s"; tail -n 1 $D/ll_soak.log; pack
s=$(date +%s); CUPY_EP_TIMEOUT_S=60 PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 compute-sanitizer --tool racecheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1 > $D/san_racecheck_ll.log 2>&1
echo "racecheck ll rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "ERROR SUMMARY|RACECHECK SUMMARY|mismatches" $D/san_racecheck_ll.log | sort | uniq -c; pack
B="python3 -m cupy_ep.bench --mode low-latency --ll-stamps"
for v in vAR vADR vAR2 vADR2; do
  case $v in vAR*) dir=.; c=3c9afd4;; *) dir=.carry/vADR; c=30d29b1;; esac
  s=$(date +%s); (cd $dir && CUPY_EP_COMMIT=$c PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 $B --out $D/llb_$v > $D/ll_bench_$v.log 2>&1)
  echo "ll bench $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|VERIF|Error" $D/ll_bench_$v.log | head -12; grep -a "ll_dispatch      phases" $D/ll_bench_$v.log; pack
done
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 200 $M -n 2 $T tests/gpu > $D/gpu_suite.log 2>&1; echo "gpu suite rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED" $D/gpu_suite.log | head -n 8; pack
