#!/usr/bin/env bash
# The main job of the README: the dispatch/combine benchmark (cupy_ep.bench) on this machine.
#
#   scripts/bench.sh [cupy_ep.bench arguments...]      e.g. scripts/bench.sh --out out/
#
# Same environment setup as scripts/test.sh (venv + wheels, or CUPY_EP_SKIP_INSTALL=1 for the python and
# MPI on PATH). Ranks: CUPY_EP_NRANKS, default one per visible GPU (2 when there is no GPU: the host
# backend, useful only to check that the pipeline runs).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
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
