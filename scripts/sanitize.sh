#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck, initcheck) at 2 ranks, one process per GPU, each rank under
# the sanitizer. Per tool, three soak runs of a few iterations: normal mode (layout, dispatch, cached dispatch,
# combine), the same zero-copy (24 SMs: the own rows on blocks of their own) and low-latency mode
# (low_latency_dispatch / low_latency_combine, NVSHMEM).
#   bash scripts/sanitize.sh            # logs in $OUT (or ./out)/sanitize_<tool>{,_zc,_ll}.log
# Env: SANITIZE_TOOLS (default all four), SANITIZE_ITERS (default 3), SANITIZE_RUN_TIMEOUT_S (each run killed
# after that many seconds, counted as failed; default none), CUPY_EP_TIMEOUT_S (default here 120: instrumented
# kernels run many times slower).
# The low-latency run needs NVSHMEM_DISABLE_NVLS=1 and NVSHMEM_REMOTE_TRANSPORT=none in the environment (one
# node, P2P only), as the GPU machine sets them: _env.sh exports the first, cupy_ep sets the second by default
# on one node. On a machine with one GPU the two ranks share it, time-sliced (the sanitizer runs outside MPS), and
# the low-latency run goes over the CUDA-IPC transport, since NVSHMEM refuses ranks sharing a GPU outside MPS.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export CUPY_EP_SKIP_INSTALL="${CUPY_EP_SKIP_INSTALL:-1}"
# shellcheck source=scripts/_env.sh
source scripts/_env.sh
ep_setup_python || exit 1
OUT_DIR="${OUT:-./out}"
mkdir -p "$OUT_DIR"
export CUPY_EP_TIMEOUT_S="${CUPY_EP_TIMEOUT_S:-120}"
ll_env=()
if [[ "$(ep_num_gpus)" -lt 2 ]]; then
    ll_env=(CUPY_EP_LL_TRANSPORT=ipc)
    echo "one GPU: the 2 ranks share it; the low-latency run uses CUPY_EP_LL_TRANSPORT=ipc"
fi
run_timeout=()
[[ -n "${SANITIZE_RUN_TIMEOUT_S:-}" ]] && run_timeout=(timeout -k 10 "$SANITIZE_RUN_TIMEOUT_S")
rc=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
    for mode in normal zero-copy low-latency; do
        if [[ $mode == normal ]]; then
            log="$OUT_DIR/sanitize_$tool.log"
            soak_args=(--max-tokens 256)
        elif [[ $mode == zero-copy ]]; then
            log="$OUT_DIR/sanitize_${tool}_zc.log"
            soak_args=(--max-tokens 256 --zero-copy --num-sms 24)
        else
            log="$OUT_DIR/sanitize_${tool}_ll.log"
            soak_args=(--mode low-latency)
        fi
        env_args=()
        [[ $mode == low-latency ]] && env_args=("${ll_env[@]}")
        ep_mpirun_argv 2 compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
            "$EP_PYTHON" -m cupy_ep.soak --iters "${SANITIZE_ITERS:-3}" --check-every 1 "${soak_args[@]}" || exit 1
        echo "[mpirun] ${env_args[*]} ${EP_ARGV[*]}" >"$log"
        "${run_timeout[@]}" env "${env_args[@]}" "${EP_ARGV[@]}" >>"$log" 2>&1
        r=$?
        echo "$tool $mode: rc=$r; $(grep -h -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | sort | uniq -c | tr -s ' \n' ' ')"
        [[ $r == 0 ]] || rc=1
    done
done
exit "$rc"
