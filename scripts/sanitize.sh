#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over layout, dispatch, cached dispatch and
# combine at 2 ranks, one process per GPU, each rank under the sanitizer. Drives a few soak iterations.
#   bash scripts/sanitize.sh            # logs in $OUT (or ./out)/sanitize_<tool>.log
# Env: SANITIZE_TOOLS (default all four), SANITIZE_ITERS (default 3).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export CUPY_EP_SKIP_INSTALL="${CUPY_EP_SKIP_INSTALL:-1}"
# shellcheck source=scripts/_env.sh
source scripts/_env.sh
ep_setup_python || exit 1
OUT_DIR="${OUT:-./out}"
mkdir -p "$OUT_DIR"
rc=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
    log="$OUT_DIR/sanitize_$tool.log"
    ep_mpirun 2 compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
        "$EP_PYTHON" -m cupy_ep.soak --iters "${SANITIZE_ITERS:-3}" --max-tokens 256 --check-every 1 \
        >"$log" 2>&1
    r=$?
    echo "$tool: rc=$r; $(grep -h -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | sort | uniq -c | tr -s ' \n' ' ')"
    [[ $r == 0 ]] || rc=1
done
exit "$rc"
