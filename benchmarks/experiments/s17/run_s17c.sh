#!/bin/bash
# S17C on a82c642 (the 512-thread dispatch with 8 loads in flight per lane in the receive copies): the GPU suite
# at 2 ranks, LL soak and racecheck, the LL benchmark with stamps (results) and b11372f's (1024 threads, .carry/vbase)
# beside it, the suite at 4 ranks, a second LL benchmark of a82c642.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s17c; mkdir -p $D
pack() { tar czf $OUT/s17c.tgz -C /tmp s17c; }
C=$(cat .carry/commit)
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 200 $M -n 2 $T tests/gpu > $D/gpu_suite.log 2>&1; echo "gpu suite 2 ranks rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED" $D/gpu_suite.log | head -n 8; pack
s=$(date +%s); CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000 > $D/ll_soak.log 2>&1; echo "ll soak rc=$? $(( $(date +%s)-s ))s"; tail -n 1 $D/ll_soak.log; pack
s=$(date +%s); CUPY_EP_TIMEOUT_S=60 PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 compute-sanitizer --tool racecheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1 > $D/san_racecheck_ll.log 2>&1
echo "racecheck ll rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "ERROR SUMMARY|RACECHECK SUMMARY|mismatches" $D/san_racecheck_ll.log | sort | uniq -c; pack
B="python3 -m cupy_ep.bench --mode low-latency --ll-stamps"
bench() {  # bench NAME DIR COMMIT
  s=$(date +%s); (cd $2 && CUPY_EP_COMMIT=$3 PYTHONPATH=/tmp/site:$PWD timeout 120 $M -n 2 $B --out $D/llb_$1 > $D/ll_bench_$1.log 2>&1)
  echo "ll bench $1 rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_.*(graph|steady)|VERIF|Error" $D/ll_bench_$1.log | head -12; grep -a "ll_dispatch      phases" $D/ll_bench_$1.log; pack
}
bench head $PWD $C
bench base $PWD/.carry/vbase b11372f
s=$(date +%s); PYTHONPATH=/tmp/site:$PWD timeout 150 $M -n 4 $T tests/gpu > $D/gpu_suite4.log 2>&1; echo "gpu suite 4 ranks rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed|FAILED" $D/gpu_suite4.log | head -n 8; pack
bench head2 $PWD $C
