#!/usr/bin/env bash
# Before/after kernel timing of two trees of cupy_ep with the benchmark's own timers (docs/benchmarking.md):
# the checkout ("head") against an earlier commit ("base"), run alternately, so that a refactor can show that no
# kernel got slower.
#
#   scripts/bench_ab.sh prepare COMMIT      # here: the base tree, from git, into .carry/ab_base/ (carry .carry)
#   scripts/bench_ab.sh run                 # on the GPU machine: the rounds, logs and results under $OUT/ab/
#
# `run` starts 2 ranks on one GPU as CUDA MPS clients of a private MPS daemon (AB_MPS_PERCENTAGE per rank,
# default 50), or one rank per GPU where there are 2 GPUs or more (AB_MPS=0). Per round and tree: normal mode at
# --sms AB_SMS (default 24) without the token sweep, --iters AB_ITERS (default 100); then low-latency mode,
# --iters AB_LL_ITERS (default 400); AB_MODES picks among "normal ll host" (default "normal ll", which at 2
# rounds needs more than one 10-minute device call on one GPU; "host": benchmarks/host_overhead.py, the host time
# per call of the normal-mode calls and the low-latency pair, run over each tree; "inprocess":
# benchmarks/ab_inprocess.py, both trees in one process per rank, their calls interleaved, AB_REPS repetitions
# (default 8) of AB_INPROCESS_ITERS iterations per timing (default 50), AB_INPROCESS_FIRST's memory allocated first
# (default base), none begun after AB_BUDGET_S seconds of timing, killed after AB_INPROCESS_TIMEOUT_S (default 540),
# results under $OUT/ab/inprocess/; it runs once, after the rounds). AB_ROUNDS rounds (default 2:
# base, head, base, head), numbered from AB_FIRST_ROUND (default 1; a later device call that continues a comparison
# starts where the last one ended, so that all its runs fit one ab_table.py table), each run killed after
# AB_RUN_TIMEOUT_S (default 150; the first run of a tree compiles its kernels). The results name each tree's commit
# (CUPY_EP_COMMIT: the base's from .carry/ab_base/COMMIT, the head's from AB_HEAD_COMMIT or git). Timings on ranks
# sharing a GPU are HBM copies, not NVLink figures: compare a tree with a tree, never with a ceiling.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
BASE_DIR="$PWD/.carry/ab_base"

if [[ "${1:-}" == prepare ]]; then
    commit="${2:?usage: scripts/bench_ab.sh prepare COMMIT}"
    rm -rf "$BASE_DIR" && mkdir -p "$BASE_DIR" || exit 1
    git archive "$commit" cupy_ep cuda_src pyproject.toml | tar -x -C "$BASE_DIR" || exit 1
    git rev-parse --short "$commit" > "$BASE_DIR/COMMIT"
    git rev-parse --short HEAD > "$PWD/.carry/ab_head_commit"
    echo "base tree $(cat "$BASE_DIR/COMMIT") in $BASE_DIR ($(du -sh "$BASE_DIR" | cut -f1)); carry .carry"
    exit 0
fi
[[ "${1:-}" == run ]] || { echo "usage: scripts/bench_ab.sh prepare COMMIT | run" >&2; exit 2; }
[[ -f "$BASE_DIR/COMMIT" ]] || { echo "no base tree: run 'scripts/bench_ab.sh prepare COMMIT' first" >&2; exit 2; }

export CUPY_EP_SKIP_INSTALL=1
# shellcheck source=scripts/_env.sh
source scripts/_env.sh
ep_setup_python || exit 1
OUT_DIR="${OUT:-./out}/ab"
mkdir -p "$OUT_DIR"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-/tmp/cupy_ep_gpu_check/cupy_kernel_cache}"
export CUPY_EP_CACHE_DIR="${CUPY_EP_CACHE_DIR:-/tmp/cupy_ep_gpu_check/cupy_ep_cache}"
mkdir -p "$CUPY_CACHE_DIR" "$CUPY_EP_CACHE_DIR"

use_mps=0
mps_start() {  # a private MPS control daemon (a fresh folder each time)
    local mps_dir
    mps_dir="$(mktemp -d /tmp/cupy_ep_ab_mps.XXXXXX)"
    mkdir -p "$mps_dir/pipe" "$mps_dir/log"
    export CUDA_MPS_PIPE_DIRECTORY="$mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$mps_dir/log"
    nvidia-cuda-mps-control -d || { echo "the MPS control daemon did not start" >&2; exit 1; }
}
if [[ "${AB_MPS:-1}" == 1 && "$(ep_num_gpus)" == 1 ]]; then
    use_mps=1
    mps_start
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
    export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="${AB_MPS_PERCENTAGE:-50}"
    echo "bench_ab: 2 ranks as MPS clients of one GPU, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
fi
head_commit="${AB_HEAD_COMMIT:-$(cat .carry/ab_head_commit 2>/dev/null || git rev-parse --short HEAD)}"
base_commit="$(cat "$BASE_DIR/COMMIT")"

# one NAME TREE COMMIT ARGS...: the benchmark of TREE, its log in $OUT_DIR/NAME.log, its results in $OUT_DIR/NAME/
one() {
    local name="$1" tree="$2" commit="$3"
    shift 3
    local start=$SECONDS rc
    ep_mpirun_argv 2 "$EP_PYTHON" -m cupy_ep.bench --out "$OUT_DIR/$name" "$@" || return 1
    (cd "$tree" && PYTHONPATH="$tree" CUPY_EP_COMMIT="$commit" timeout -k 5 "${AB_RUN_TIMEOUT_S:-150}" \
        "${EP_ARGV[@]}") > "$OUT_DIR/$name.log" 2>&1
    rc=$?
    echo "[$name] $commit rc=$rc $((SECONDS - start)) s"
    if [[ $use_mps == 1 && ( $rc == 124 || $rc == 137 ) ]]; then
        # After its clients were killed mid-run the MPS server refused new ones (cudaErrorDevicesUnavailable, seen
        # on the H200): the next run gets a new daemon.
        pkill -9 -f -- "-m cupy_ep\.bench" 2>/dev/null
        echo quit | nvidia-cuda-mps-control
        sleep 2
        mps_start
        echo "[$name] killed at the time limit: MPS daemon restarted"
    fi
    grep -E '^\| (dispatch|cached_dispatch|combine|round_trip) ' "$OUT_DIR/$name.log" || true
    grep -E '^  ll_[a-z_]+ +(call|graph|steady) ' "$OUT_DIR/$name.log" || true
}
modes="${AB_MODES:-normal ll}"
first_round="${AB_FIRST_ROUND:-1}"
for round in $(seq "$first_round" $((first_round + ${AB_ROUNDS:-2} - 1))); do
    for tree in base head; do
        dir="$BASE_DIR" commit="$base_commit"
        [[ "$tree" == head ]] && dir="$PWD" commit="$head_commit"
        if [[ " $modes " == *" normal "* ]]; then
            one "normal_${tree}_$round" "$dir" "$commit" --sms "${AB_SMS:-24}" --token-sweep '' \
                --iters "${AB_ITERS:-100}"
        fi
        if [[ " $modes " == *" host "* ]]; then  # host time per call: the checkout's script over each tree
            ep_mpirun_argv 2 "$EP_PYTHON" "$PWD/benchmarks/host_overhead.py" || exit 1
            (cd "$dir" && PYTHONPATH="$dir" timeout -k 5 "${AB_RUN_TIMEOUT_S:-150}" "${EP_ARGV[@]}") \
                > "$OUT_DIR/host_${tree}_$round.log" 2>&1
            echo "[host_${tree}_$round] $commit rc=$?"
            grep -E '^host time per call' "$OUT_DIR/host_${tree}_$round.log" || true
        fi
        if [[ " $modes " == *" ll "* ]]; then
            one "ll_${tree}_$round" "$dir" "$commit" --mode low-latency --iters "${AB_LL_ITERS:-400}" \
                --ll-token-sweep ''
        fi
    done
done
if [[ " $modes " == *" inprocess "* ]]; then
    ep_mpirun_argv 2 "$EP_PYTHON" "$PWD/benchmarks/ab_inprocess.py" "$BASE_DIR" --reps "${AB_REPS:-8}" \
        --iters "${AB_INPROCESS_ITERS:-50}" --first "${AB_INPROCESS_FIRST:-base}" --out "$OUT_DIR/inprocess" ${AB_BUDGET_S:+--budget-s "$AB_BUDGET_S"} || exit 1
    start=$SECONDS
    PYTHONPATH="$PWD" CUPY_EP_COMMIT="$head_commit" timeout -k 5 "${AB_INPROCESS_TIMEOUT_S:-540}" "${EP_ARGV[@]}" \
        > "$OUT_DIR/inprocess.log" 2>&1
    echo "[inprocess] base $base_commit, head $head_commit: rc=$? $((SECONDS - start)) s"
    tail -n 40 "$OUT_DIR/inprocess.log"
fi
