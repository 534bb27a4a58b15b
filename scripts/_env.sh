# shellcheck shell=bash
# Shared setup for scripts/test.sh, scripts/bench.sh and scripts/gpu_check.sh: source it, don't run it.
#
# Defines
#   EP_REPO_ROOT               absolute path of the repository
#   ep_setup_python            venv + `pip install -e .[test,bench,nvshmem]` (or, with CUPY_EP_SKIP_INSTALL=1, the
#                              python on PATH with the repo on PYTHONPATH); sets EP_PYTHON
#   ep_mpirun N CMD...         start N ranks with the right launcher and flags (ep_mpirun_argv N sets EP_ARGV)
#   ep_num_gpus                number of GPUs CuPy sees (0 when none)
#   ep_pytest_step NAME NRANKS ARGS...   run pytest (NRANKS=0: one process, no launcher), count results
#   ep_plain_step NAME CMD...  run any command as a step (rc only)
#   ep_summary                 print the step table and the closing "N passed, N failed" line; rc 1 if a step failed
#
# Environment
#   CUPY_EP_VENV          venv path (default .venv in the repo root)
#   CUPY_EP_SKIP_INSTALL  1: no venv, no pip; use python3 (or python) and mpiexec/mpirun from PATH
#   CUPY_EP_PYTHON        the interpreter to use with CUPY_EP_SKIP_INSTALL=1
#   CUPY_EP_FORCE_INSTALL 1: run pip even when pyproject.toml is unchanged since the last install
#   CUPY_EP_MPIEXEC       launcher to use instead of the detected one
#   CUPY_EP_MPIEXEC_ARGS  extra launcher arguments (word-split), e.g. "-launcher fork"
#   EP_LOG_DIR            when set, each step's output is also written to $EP_LOG_DIR/<step>.log
#   EP_STEP_TIMEOUT_S     when set, each step is killed after this many seconds (counts as failed)

EP_REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# NVLink multicast (NVLS) stays off everywhere: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0
export NVSHMEM_DISABLE_NVLS=1
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1

EP_PYTHON=""
EP_VENV=""

ep_log() { printf '%s\n' "$*" >&2; }

ep_setup_python() {
    if [[ "${CUPY_EP_SKIP_INSTALL:-0}" == 1 ]]; then
        EP_PYTHON="${CUPY_EP_PYTHON:-$(command -v python3 || command -v python || true)}"
        if [[ -z "$EP_PYTHON" ]]; then
            ep_log "error: CUPY_EP_SKIP_INSTALL=1 but neither python3 nor python is on PATH"
            return 1
        fi
        # The package is used from the source tree, not installed.
        export PYTHONPATH="$EP_REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
        ep_log "[env] CUPY_EP_SKIP_INSTALL=1: using $EP_PYTHON, PYTHONPATH=$PYTHONPATH"
    else
        EP_VENV="${CUPY_EP_VENV:-.venv}"
        [[ "$EP_VENV" == /* ]] || EP_VENV="$EP_REPO_ROOT/$EP_VENV"
        if ! "$EP_VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
            ep_log "[env] creating venv $EP_VENV"
            python3 -m venv --clear "$EP_VENV"
        fi
        # Skip pip when this venv already holds an editable install of this checkout's pyproject.toml.
        local stamp="$EP_VENV/.cupy_ep_install_stamp" want
        want="$EP_REPO_ROOT $(sha256sum "$EP_REPO_ROOT/pyproject.toml" | cut -d' ' -f1)"
        if [[ "${CUPY_EP_FORCE_INSTALL:-0}" == 1 || ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]] \
            || ! "$EP_VENV/bin/python" -c 'import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ("cupy_ep", "pytest", "pytest_mpi", "mpi4py")))' >/dev/null 2>&1; then
            ep_log "[env] pip install -e \"${EP_REPO_ROOT}[test,bench,nvshmem]\" into $EP_VENV (wheels only)"
            rm -f "$stamp"
            # --only-binary applies to the dependencies; the package itself is always built from source.
            "$EP_VENV/bin/python" -m pip install --disable-pip-version-check --no-input -q \
                --only-binary=:all: -e "${EP_REPO_ROOT}[test,bench,nvshmem]"
            printf '%s\n' "$want" >"$stamp"
        else
            ep_log "[env] reusing $EP_VENV (pyproject.toml unchanged since its install)"
        fi
        export VIRTUAL_ENV="$EP_VENV"
        export PATH="$EP_VENV/bin:$PATH"
        EP_PYTHON="$EP_VENV/bin/python"
    fi
    export EP_PYTHON
}

# ---- MPI launcher ---------------------------------------------------------------------------------
EP_LAUNCHER=()   # launcher and its fixed flags, resolved once

ep_resolve_launcher() {
    [[ ${#EP_LAUNCHER[@]} -gt 0 ]] && return 0
    local launcher="${CUPY_EP_MPIEXEC:-}"
    if [[ -z "$launcher" ]]; then
        if [[ -n "$EP_VENV" && -x "$EP_VENV/bin/mpiexec" ]]; then
            launcher="$EP_VENV/bin/mpiexec"        # the mpich wheel's hydra
        elif [[ "${CUPY_EP_SKIP_INSTALL:-0}" == 1 ]] && command -v mpirun >/dev/null; then
            launcher="$(command -v mpirun)"        # the GPU image's system MPI
        else
            launcher="$(command -v mpiexec || command -v mpirun || true)"
        fi
    fi
    if [[ -z "$launcher" ]]; then
        ep_log "error: no mpiexec or mpirun found (install the 'test' extra, which brings the mpich wheel)"
        return 1
    fi
    EP_LAUNCHER=("$launcher")
    local version
    version="$("$launcher" --version 2>&1 || true)"
    if [[ "$version" == *"Open MPI"* || "$version" == *"OpenRTE"* ]]; then
        # Open MPI refuses root and more ranks than cores unless told; MPICH's hydra needs neither.
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
        EP_LAUNCHER+=(--oversubscribe --bind-to none)
    fi
    if [[ -n "${CUPY_EP_MPIEXEC_ARGS:-}" ]]; then
        local -a extra
        read -r -a extra <<<"$CUPY_EP_MPIEXEC_ARGS"
        EP_LAUNCHER+=("${extra[@]}")
    fi
}

# ep_mpirun_argv N CMD...: sets the array EP_ARGV to the full launch command.
ep_mpirun_argv() {
    local n="$1"
    shift
    ep_resolve_launcher || return 1
    EP_ARGV=("${EP_LAUNCHER[0]}" -n "$n" "${EP_LAUNCHER[@]:1}" "$@")
}

ep_mpirun() {
    ep_mpirun_argv "$@" || return 1
    ep_log "[mpirun] ${EP_ARGV[*]}"
    "${EP_ARGV[@]}"
}

ep_num_gpus() {
    "$EP_PYTHON" -c '
try:
    import cupy
    print(cupy.cuda.runtime.getDeviceCount() if cupy.cuda.is_available() else 0)
except Exception:
    print(0)' 2>/dev/null || echo 0
}

# ---- steps and their accounting ---------------------------------------------------------------------
EP_STEP_NAMES=()
EP_STEP_RCS=()
EP_STEP_PASSED=()
EP_STEP_FAILED=()
EP_STEP_SKIPPED=()
EP_STEP_STATUS=()
EP_STEP_NOTES=()
EP_TMP=""

ep_tmpdir() {
    if [[ -z "$EP_TMP" ]]; then
        EP_TMP="$(mktemp -d "${TMPDIR:-/tmp}/cupy_ep_steps.XXXXXX")"
        # shellcheck disable=SC2064  # expand now: the path is fixed
        trap "rm -rf '$EP_TMP'" EXIT
    fi
}

# ep_exec NAME CMD...: runs CMD (stdin from /dev/null, optional timeout, optional log); sets EP_RC.
ep_exec() {
    local name="$1"
    shift
    local -a cmd=("$@")
    if [[ -n "${EP_STEP_TIMEOUT_S:-}" && "$(type -t "$1")" == file ]]; then
        cmd=(timeout -k 30 "$EP_STEP_TIMEOUT_S" "$@")
    fi
    local had_e=0
    [[ $- == *e* ]] && had_e=1
    set +e
    if [[ -n "${EP_LOG_DIR:-}" ]]; then
        mkdir -p "$EP_LOG_DIR"
        "${cmd[@]}" </dev/null 2>&1 | tee "$EP_LOG_DIR/$name.log"
        EP_RC=${PIPESTATUS[0]}
    else
        "${cmd[@]}" </dev/null
        EP_RC=$?
    fi
    ((had_e)) && set -e
    return 0
}

ep_record() {  # NAME RC PASSED FAILED SKIPPED STATUS NOTE
    EP_STEP_NAMES+=("$1")
    EP_STEP_RCS+=("$2")
    EP_STEP_PASSED+=("$3")
    EP_STEP_FAILED+=("$4")
    EP_STEP_SKIPPED+=("$5")
    EP_STEP_STATUS+=("$6")
    EP_STEP_NOTES+=("$7")
    if [[ "$6" == ok ]]; then
        ep_log "[$1] ok (rc=$2${7:+; $7})"
    else
        ep_log "[$1] FAILED (rc=$2${7:+; $7})"
    fi
}

# Sums pytest junit files in a directory: prints "passed failed skipped files unreadable".
ep_count_junit() {
    "$EP_PYTHON" - "$1" <<'PY'
import glob, os, sys
import xml.etree.ElementTree as ET
passed = failed = skipped = files = bad = 0
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.xml"))):
    try:
        root = ET.parse(path).getroot()
    except Exception:
        bad += 1
        continue
    files += 1
    for suite in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
        n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        passed += n["tests"] - n["failures"] - n["errors"] - n["skipped"]
        failed += n["failures"] + n["errors"]
        skipped += n["skipped"]
print(passed, failed, skipped, files, bad)
PY
}

# ep_pytest_step NAME NRANKS PYTEST_ARGS...: NRANKS=0 runs one plain process, otherwise NRANKS ranks under
# the MPI launcher, each rank writing its own junit file. Fails on a non-zero rc, on pytest's exit 5 (no
# tests collected), and when no test was executed at all (everything skipped).
# NRANKS: 0 (one plain pytest), N (under the MPI launcher) or torchrun:N (python -m torch.distributed.run
# --standalone; pass --with-torchrun among the pytest arguments).
ep_pytest_step() {
    local name="$1" nranks="$2"
    shift 2
    ep_tmpdir
    local jdir="$EP_TMP/junit/$name"
    rm -rf "$jdir"
    mkdir -p "$jdir"
    local -a cmd
    if [[ "$nranks" == 0 ]]; then
        cmd=("$EP_PYTHON" -m pytest --junitxml="$jdir/rank0.xml" "$@")
        ep_log ""
        ep_log "==> [$name] python -m pytest $*"
    elif [[ "$nranks" == torchrun:* ]]; then
        nranks="${nranks#torchrun:}"
        # shellcheck disable=SC2016  # expanded by the per-rank bash, not here
        cmd=("$EP_PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$nranks" --no-python bash -c
             'exec "$0" -m pytest --junitxml="$1/rank${RANK:-$$}.xml" "${@:2}"' "$EP_PYTHON" "$jdir" "$@")
        ep_log ""
        ep_log "==> [$name] torchrun --nproc-per-node $nranks python -m pytest $*"
    else
        # Every rank runs its own pytest session; name each junit file by its rank (MPICH: PMI_RANK,
        # Open MPI: OMPI_COMM_WORLD_RANK; else the pid, which is unique too).
        # shellcheck disable=SC2016  # expanded by the per-rank bash, not here
        ep_mpirun_argv "$nranks" bash -c \
            'exec "$0" -m pytest --junitxml="$1/rank${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-$$}}}.xml" "${@:2}"' \
            "$EP_PYTHON" "$jdir" "$@" || { ep_record "$name" - 0 1 0 FAILED "no MPI launcher"; return 0; }
        cmd=("${EP_ARGV[@]}")
        ep_log ""
        ep_log "==> [$name] ${EP_LAUNCHER[0]##*/} -n $nranks python -m pytest $*"
    fi
    ep_exec "$name" "${cmd[@]}"
    local rc="$EP_RC" passed failed skipped files bad
    read -r passed failed skipped files bad < <(ep_count_junit "$jdir")
    local status=ok note=""
    if [[ "$rc" == 5 ]]; then
        status=FAILED note="pytest collected no tests (exit 5)"
    elif [[ "$rc" == 124 || "$rc" == 137 ]] && [[ -n "${EP_STEP_TIMEOUT_S:-}" ]]; then
        status=FAILED note="killed after EP_STEP_TIMEOUT_S=${EP_STEP_TIMEOUT_S}s"
    elif [[ "$rc" != 0 ]]; then
        status=FAILED note="exit code $rc"
    elif ((passed + failed == 0)); then
        status=FAILED note="ran zero tests (all skipped or deselected)"
    fi
    if [[ "$nranks" != 0 ]] && ((files + bad < nranks)); then
        note="${note:+$note; }junit results from $((files + bad)) of $nranks ranks"
    fi
    # A failed step always counts at least one failure, so the closing line never reads "0 failed" for a
    # run that failed (a crash or timeout writes no junit file).
    if [[ "$status" != ok ]] && ((failed == 0)); then
        failed=1
        note="${note:+$note; }counted as 1 failure"
    fi
    ep_record "$name" "$rc" "$passed" "$failed" "$skipped" "$status" "$note"
}

# ep_plain_step NAME CMD...: a step that is not pytest; only its exit code counts.
ep_plain_step() {
    local name="$1"
    shift
    ep_log ""
    ep_log "==> [$name] $*"
    ep_exec "$name" "$@"
    if [[ "$EP_RC" == 0 ]]; then
        ep_record "$name" 0 - - - ok ""
    else
        ep_record "$name" "$EP_RC" - - - FAILED "exit code $EP_RC"
    fi
}

# ep_summary: the step table, then the closing line; returns 1 when any step failed.
ep_summary() {
    local i any_failed=0 tp=0 tf=0 ts=0 v
    echo ""
    echo "==================== summary ===================="
    printf '%-12s %-7s %5s %7s %7s %8s  %s\n' step status rc passed failed skipped note
    for i in "${!EP_STEP_NAMES[@]}"; do
        printf '%-12s %-7s %5s %7s %7s %8s  %s\n' "${EP_STEP_NAMES[$i]}" "${EP_STEP_STATUS[$i]}" \
            "${EP_STEP_RCS[$i]}" "${EP_STEP_PASSED[$i]}" "${EP_STEP_FAILED[$i]}" "${EP_STEP_SKIPPED[$i]}" \
            "${EP_STEP_NOTES[$i]}"
        [[ "${EP_STEP_STATUS[$i]}" == ok ]] || any_failed=1
        v="${EP_STEP_PASSED[$i]}"; [[ "$v" =~ ^[0-9]+$ ]] && tp=$((tp + v))
        v="${EP_STEP_FAILED[$i]}"; [[ "$v" =~ ^[0-9]+$ ]] && tf=$((tf + v))
        v="${EP_STEP_SKIPPED[$i]}"; [[ "$v" =~ ^[0-9]+$ ]] && ts=$((ts + v))
        if [[ "${EP_STEP_STATUS[$i]}" != ok && ! "${EP_STEP_FAILED[$i]}" =~ ^[0-9]+$ ]]; then
            tf=$((tf + 1))   # a failed non-pytest step counts as one failure
        fi
    done
    if ((${#EP_STEP_NAMES[@]} == 0)); then
        echo "(no steps ran)"
        any_failed=1
        tf=$((tf + 1))
    fi
    echo "================================================="
    if ((any_failed)); then echo "RESULT: FAILED"; else echo "RESULT: OK"; fi
    echo "$tp passed, $tf failed, $ts skipped"
    return "$any_failed"
}
