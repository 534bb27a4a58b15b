#!/bin/bash
# S17A (run in session 17; prepared in session 16 as run_next_512.sh): the low-latency dispatch at 512 threads per block
# (dispatch_512_threads_untested.patch) against the checkout's kernels. Builds the variant in /tmp/v512 from the
# checkout, runs its LL tests, soak and racecheck, then the LL benchmark with stamps, base / v512 / base / v512.
# Run from the repository root with the pytest-mpi wheel in .carry/wheels (see benchmarks/results/gpu_tests_h200x2.md).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
D=/tmp/s17a; mkdir -p $D
pack() { tar czf $OUT/s17a.tgz -C /tmp s17a; }
rm -rf /tmp/v512 && mkdir -p /tmp/v512 && cp -r cupy_ep cuda_src tests pyproject.toml /tmp/v512/ \
  && (cd /tmp/v512 && patch -p1 < $OLDPWD/benchmarks/experiments/s16/dispatch_512_threads_untested.patch) > $D/patch.log 2>&1 \
  || { echo "patch failed"; cat $D/patch.log; pack; exit 1; }
s=$(date +%s); (cd /tmp/v512 && PYTHONPATH=/tmp/site:$PWD timeout 170 $M -n 2 $T tests/gpu/test_low_latency.py tests/gpu/test_nvshmem.py tests/gpu/test_zz_low_latency_timeout.py) > $D/ll_tests.log 2>&1; echo "v512 ll tests rc=$? $(( $(date +%s)-s ))s"; grep -a -E "passed|failed" $D/ll_tests.log | head -n 4; pack
s=$(date +%s); (cd /tmp/v512 && CUPY_EP_TIMEOUT_S=15 PYTHONPATH=/tmp/site:$PWD timeout 60 $M -n 2 python3 -m cupy_ep.soak --mode low-latency --iters 1000) > $D/ll_soak.log 2>&1; echo "v512 soak rc=$? $(( $(date +%s)-s ))s"; tail -n 1 $D/ll_soak.log; pack
s=$(date +%s); (cd /tmp/v512 && CUPY_EP_TIMEOUT_S=60 PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 compute-sanitizer --tool racecheck --error-exitcode 3 --print-limit 20 python3 -m cupy_ep.soak --mode low-latency --iters 8 --check-every 1) > $D/san_racecheck.log 2>&1
echo "v512 racecheck rc=$? $(( $(date +%s)-s ))s"; grep -a -h -E "RACECHECK SUMMARY|mismatches" $D/san_racecheck.log | sort | uniq -c; pack
B="python3 -m cupy_ep.bench --mode low-latency --ll-stamps"
for v in base v512 base2 v5122; do
  case $v in base*) dir=$PWD;; *) dir=/tmp/v512;; esac
  s=$(date +%s); (cd $dir && CUPY_EP_COMMIT=$v PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 $B --out $D/llb_$v > $D/ll_bench_$v.log 2>&1)
  echo "ll bench $v rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_dispatch.*(graph|steady)|VERIF|Error" $D/ll_bench_$v.log | head -4; grep -a "ll_dispatch      phases" $D/ll_bench_$v.log; pack
done
# --ll-max-tokens on the GPU: a 128-token batch in a buffer sized for M = 256 (checked against the reference first).
s=$(date +%s); (CUPY_EP_COMMIT=base PYTHONPATH=/tmp/site:$PWD timeout 100 $M -n 2 python3 -m cupy_ep.bench --mode low-latency --tokens 128 --ll-max-tokens 256 --out $D/llb_m256 > $D/ll_bench_m256.log 2>&1)
echo "ll bench M=256 rc=$? $(( $(date +%s)-s ))s"; grep -a -E "^  ll_(dispatch|combine).*(graph|steady)|VERIF|Error|max_tokens" $D/ll_bench_m256.log | head -8; pack
