#!/usr/bin/env bash
# DeepEP (deepseek-ai/DeepEP, its legacy kernels) built outside this project, for timing it beside cupy_ep on the
# same machine. Its sources never enter the tree: they travel in .carry/deepep/ (ignored), the build lives in /tmp.
#
#   scripts/deepep.sh prepare DEEPEP_GIT_DIR FMT_GIT_DIR   # here: DeepEP's HEAD and the fmt commit it pins
#                                                          # (git archive) into .carry/deepep/src
#   scripts/deepep.sh build                                # on the GPU machine: build it in place, log to $OUT
#   scripts/deepep.sh smoke                                # on the GPU machine: import it, one Buffer, its own
#                                                          # intranode test at DEEPEP_SMOKE_RANKS (default 1)
#
# The build uses the machine's python3 (torch, the NCCL and NVSHMEM wheels) and nvcc; DEEPEP_BUILD_JOBS compile
# jobs (default: the CPU count); TORCH_CUDA_ARCH_LIST defaults to 9.0 (Hopper). After `build`, DEEPEP_DIR
# (default /tmp/deepep/src) on PYTHONPATH makes `import deep_ep` work in the same machine session.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
KIT="$PWD/.carry/deepep"
DEEPEP_DIR="${DEEPEP_DIR:-/tmp/deepep/src}"
OUT_DIR="${OUT:-./out}"
PY="${CUPY_EP_PYTHON:-python3}"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

case "${1:-}" in
prepare)
    deepep_git="${2:?usage: scripts/deepep.sh prepare DEEPEP_GIT_DIR FMT_GIT_DIR}"
    fmt_git="${3:?usage: scripts/deepep.sh prepare DEEPEP_GIT_DIR FMT_GIT_DIR}"
    rm -rf "$KIT" && mkdir -p "$KIT/src/third-party/fmt" || exit 1
    git -C "$deepep_git" archive HEAD | tar -x -C "$KIT/src" || exit 1
    # the submodule commit DeepEP pins, from its tree
    fmt_commit="$(git -C "$deepep_git" ls-tree HEAD third-party/fmt | awk '{print $3}')"
    git -C "$fmt_git" archive "$fmt_commit" include | tar -x -C "$KIT/src/third-party/fmt" || exit 1
    printf 'deepep %s\nfmt %s\n' "$(git -C "$deepep_git" rev-parse HEAD)" "$fmt_commit" > "$KIT/COMMITS"
    echo "DeepEP kit in $KIT ($(du -sh "$KIT" | cut -f1)): $(tr '\n' ' ' < "$KIT/COMMITS"); carry .carry"
    ;;
build)
    [[ -d "$KIT/src" ]] || { echo "no DeepEP kit: run 'scripts/deepep.sh prepare ...' here first" >&2; exit 2; }
    mkdir -p "$OUT_DIR" "$(dirname "$DEEPEP_DIR")"
    rm -rf "$DEEPEP_DIR" && cp -r "$KIT/src" "$DEEPEP_DIR" || exit 1
    log="$OUT_DIR/deepep_build.log"
    start=$SECONDS
    (
        cd "$DEEPEP_DIR" || exit 1
        # setup.py finds the NCCL and NVSHMEM roots through the wheels' metadata (EP_NCCL_ROOT_DIR /
        # EP_NVSHMEM_ROOT_DIR override it); its version stamp runs git, which a tree without .git answers as local
        export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${DEEPEP_BUILD_JOBS:-$(nproc)}"
        echo "[deepep] $(tr '\n' ' ' < "$KIT/COMMITS")"
        echo "[deepep] torch $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)')," \
            "nvcc: $(nvcc --version | tail -1), $MAX_JOBS jobs, arch $TORCH_CUDA_ARCH_LIST"
        "$PY" setup.py build_ext --inplace
    ) >"$log" 2>&1
    rc=$?
    echo "deepep build: rc=$rc in $((SECONDS - start)) s (log $log)"
    tail -5 "$log"
    exit "$rc"
    ;;
smoke)
    if [[ ! -d "$DEEPEP_DIR" ]]; then
        echo "no DeepEP build in $DEEPEP_DIR: run 'scripts/deepep.sh build' first" >&2
        exit 2
    fi
    mkdir -p "$OUT_DIR"
    export PYTHONPATH="$DEEPEP_DIR${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" -c 'import deep_ep, torch; print("deep_ep", deep_ep.__file__, "| Buffer", deep_ep.Buffer)' || exit 1
    (cd "$DEEPEP_DIR" && timeout -k 5 "${DEEPEP_SMOKE_TIMEOUT_S:-180}" "$PY" tests/legacy/test_intranode.py \
        --num-processes "${DEEPEP_SMOKE_RANKS:-1}" --num-tokens 512) >"$OUT_DIR/deepep_smoke.log" 2>&1
    rc=$?
    echo "deepep intranode test at ${DEEPEP_SMOKE_RANKS:-1} rank(s): rc=$rc (log $OUT_DIR/deepep_smoke.log)"
    tail -5 "$OUT_DIR/deepep_smoke.log"
    exit "$rc"
    ;;
*)
    echo "usage: scripts/deepep.sh prepare DEEPEP_GIT_DIR FMT_GIT_DIR | build | smoke" >&2
    exit 2
    ;;
esac
