#!/bin/bash
# Device run S16A: the working tree (vAD: the receive phase's counters are warps 1.. on mbarriers, so the prefix
# does not wait for warp 0's last releases, and warp 0 takes the last copy units; the own rank's index entries
# released at GPU scope before the peers') against 9e68e9a (.carry/vbase) and vA (.carry/vA: the counters only):
# LL tests on the working tree, LL benchmark base / vA / vAD, vAD with stamps, LL soak, racecheck / synccheck.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s16a; mkdir -p $D
pack() { tar czf $OUT/s16a.tgz -C /tmp s16a; }
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 170 $M -n 2 $T tests/gpu/test_low_latency.py tests/gpu/test_nvshmem.py tests/gpu/test_zz_low_latency_timeout.py > $D/ll_tests.log 2>&1; echo "ll tests rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED|Error" $D/ll_tests.log | head -n 8; pack
s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000 > $D/ll_soak.log 2>&1; echo "ll soak rc=$? $(( $(date +%s)-s ))s"; tail -n 1 $D/ll_soak.log; pack
B="python3 -m cupy_ep.bench --mode low-latency --iters 100 --ll-token-sweep 128"
for v in base vA vAD base2 vAD2; do
  case $v in base|base2) dir=.carry/vbase; c=9e68e9a;; vA) dir=.carry/vA; c=vA;; *) dir=.; c=vAD;; esac
  s=$(date +%s); (cd $dir && CUPY_EP_COMMIT=$c PYTHONPATH=/tmp/site:$PWD timeout 90 $M -n 2 $B --out $D/llb_$v > $D/ll_bench_$v.log 2>&1)
  echo "ll bench $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|VERIF|Error" $D/ll_bench_$v.log | head -14; pack
done
s=$(date +%s); CUPY_EP_COMMIT=vAD PYTHONPATH=/tmp/site:$PWD timeout 120 $M -n 2 $B --ll-stamps --out $D/llb_vAD_stamps > $D/ll_bench_vAD_stamps.log 2>&1
echo "ll bench vAD stamps rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|VERIF|Error|stamp|us" $D/ll_bench_vAD_stamps.log | head -40; pack
for tool in racecheck synccheck; do
  s=$(date +%s); CUPY_EP_TIMEOUT_S=60 PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 compute-sanitizer --tool $tool --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1 > $D/san_${tool}_ll.log 2>&1
  echo "$tool ll rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "ERROR SUMMARY|RACECHECK SUMMARY|mismatches" $D/san_${tool}_ll.log | sort | uniq -c
done; pack
