# Sourced by the device scripts (run_*.sh) from the repository root on the GPU machine: the environment of
# benchmarks/results/gpu_tests_h200x2.md, the pytest-mpi wheel from .carry/wheels installed into /tmp/site, and
#   $M  the launcher:  mpirun --oversubscribe --bind-to none
#   $T  the test runner (pytest-mpi, per-test timeout)
# (The scripts of sessions 7-17 spell this out each; they stay as they ran.)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1 CUPY_EP_CACHE_DIR=/tmp/epc CUPY_EP_TEST_TIMEOUT_S=15
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >/dev/null 2>&1
M="mpirun --oversubscribe --bind-to none"
T="python3 -m pytest --with-mpi -p no:cacheprovider -q -rs --color=no --timeout=100 --timeout-method=thread"
# Step helpers for the scripts from session 22 on (older ones define their own, which override these):
#   logs_in NAME             the run's logs go to /tmp/NAME ($D), packed into $OUT/NAME.tgz after every step
#   run STEP LIMIT CMD...    CMD under `timeout LIMIT` into $D/STEP.log; prints its rc, seconds and result lines
#                            (those matching $RUN_GREP)
logs_in() { LOG_TAG=$1; D=/tmp/$1; mkdir -p "$D"; }
pack() { tar czf "$OUT/$LOG_TAG.tgz" -C /tmp "$LOG_TAG"; }
run() {
    local name=$1 lim=$2 s
    shift 2
    s=$(date +%s)
    timeout "$lim" "$@" > "$D/$name.log" 2>&1
    echo "$name rc=$? $(( $(date +%s) - s ))s"
    grep -a -h -E "${RUN_GREP:-passed|failed|mismatches|verified|SUMMARY|RESULT}" "$D/$name.log" | sort | uniq -c | tail -n 6
    pack
}
