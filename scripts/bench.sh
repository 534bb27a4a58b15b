#!/usr/bin/env bash
# The main job of the README: the dispatch/combine benchmark (cupy_ep.bench) on this machine.
#
#   scripts/bench.sh [cupy_ep.bench arguments...]      e.g. scripts/bench.sh --out out/
#   scripts/bench.sh --help                            this text and the benchmark's options (one process, no MPI)
#
# Same environment setup as scripts/test.sh (venv + wheels, or CUPY_EP_SKIP_INSTALL=1 for the python and
# MPI on PATH). Ranks: CUPY_EP_NRANKS, default one per visible GPU (2 when there is no GPU: the host
# backend, useful only to check that the pipeline runs; its results go to out/bench_host/ unless --out says).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}

for arg in "$@"; do
    [[ "$arg" == -- ]] && break
    if [[ "$arg" == -h || "$arg" == --help ]]; then
        # Once, in this process: no install, no launcher. The benchmark's --help needs only the interpreter (it
        # exits before numpy, MPI or CuPy load), so the venv's python serves if it is there, else the one on PATH.
        usage
        echo ""
        echo "cupy_ep.bench options:"
        python="${CUPY_EP_PYTHON:-}"
        if [[ -z "$python" ]]; then
            if [[ "${CUPY_EP_SKIP_INSTALL:-0}" != 1 && -x "${CUPY_EP_VENV:-.venv}/bin/python" ]]; then
                python="${CUPY_EP_VENV:-.venv}/bin/python"
            else
                python="$(command -v python3 || command -v python || true)"
            fi
        fi
        if [[ -z "$python" ]]; then
            echo "(no python found: see python -m cupy_ep.bench --help)"
            exit 0
        fi
        PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m cupy_ep.bench --help
    fi
done

# shellcheck source=scripts/_env.sh
source scripts/_env.sh
ep_setup_python

nranks="${CUPY_EP_NRANKS:-}"
if [[ -z "$nranks" ]]; then
    nranks="$(ep_num_gpus)"
    if ((nranks == 0)); then
        nranks=2
        ep_log "[bench] no GPU visible: 2 ranks on the host backend (numbers mean nothing)"
    fi
fi
ep_log "[bench] $nranks rank(s)"
ep_mpirun "$nranks" "$EP_PYTHON" -m cupy_ep.bench "$@"
