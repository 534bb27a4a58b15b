#!/usr/bin/env bash
# DeepEP (deepseek-ai/DeepEP) built outside this project, for timing it beside cupy_ep on the same machine. Its
# sources never enter the tree: they travel in .carry/deepep/ (ignored), the build lives in /tmp.
#
#   scripts/deepep.sh prepare DEEPEP_GIT_DIR [COMMIT [FMT_GIT_DIR]]
#       here (network): DeepEP's COMMIT (default 567632d, the last commit with only the V1 kernels) archived into
#       .carry/deepep/src, the fmt headers its third-party/fmt submodule pins (FMT_GIT_DIR, for commits that have
#       one), and rdma-core's verbs headers (libibverbs-dev, apt-get download): NVSHMEM's IBGDA header, which the V1
#       kernels include, needs infiniband/mlx5dv.h
#   scripts/deepep.sh build     on the GPU machine: build it in place, log to $OUT
#   scripts/deepep.sh smoke     on the GPU machine: import it and run its own intranode test at DEEPEP_SMOKE_RANKS
#                               (default 1) ranks
#
# Why V1 at 567632d: DeepEP's later commits (EPv2) use NCCL's device API of releases after 2.28 (ncclCommProperties,
# the GIN fields), while the GPU image's torch ships NCCL 2.28.9, which the extension would load. The V1 commit built
# on a CPU machine with CUDA 13.0, torch 2.11 (cu130) and NVSHMEM 3.4.5, given the verbs headers and CPATH entries
# below (and a stand-in libcuda.so there: the GPU machine has the driver's).
#
# The build uses the machine's python3 (torch, the NVSHMEM wheel) and nvcc; DEEPEP_BUILD_JOBS compile jobs
# (default: the CPU count); TORCH_CUDA_ARCH_LIST defaults to 9.0 (Hopper). After `build`, DEEPEP_DIR (default
# /tmp/deepep/src) on PYTHONPATH makes `import deep_ep` work in the same machine session.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
KIT="$PWD/.carry/deepep"
DEEPEP_DIR="${DEEPEP_DIR:-/tmp/deepep/src}"
OUT_DIR="${OUT:-./out}"
PY="${CUPY_EP_PYTHON:-python3}"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

case "${1:-}" in
prepare)
    deepep_git="${2:?usage: scripts/deepep.sh prepare DEEPEP_GIT_DIR [COMMIT [FMT_GIT_DIR]]}"
    commit="${3:-567632d}"
    fmt_git="${4:-}"
    rm -rf "$KIT" && mkdir -p "$KIT/src" "$KIT/debs" || exit 1
    git -C "$deepep_git" archive "$commit" | tar -x -C "$KIT/src" || exit 1
    printf 'deepep %s\n' "$(git -C "$deepep_git" rev-parse "$commit")" > "$KIT/COMMITS"
    # the fmt commit the tree pins, where it has the submodule
    fmt_commit="$(git -C "$deepep_git" ls-tree "$commit" third-party/fmt | awk '{print $3}')"
    if [[ -n "$fmt_commit" ]]; then
        [[ -n "$fmt_git" ]] || { echo "DeepEP $commit pins fmt $fmt_commit: give FMT_GIT_DIR" >&2; exit 2; }
        mkdir -p "$KIT/src/third-party/fmt"
        git -C "$fmt_git" archive "$fmt_commit" include | tar -x -C "$KIT/src/third-party/fmt" || exit 1
        printf 'fmt %s\n' "$fmt_commit" >> "$KIT/COMMITS"
    fi
    if ! (cd "$KIT/debs" && apt-get download libibverbs-dev); then
        echo "apt-get download libibverbs-dev failed" >&2
        exit 1
    fi
    dpkg -x "$KIT"/debs/libibverbs-dev_*.deb "$KIT/rdma" && rm -rf "$KIT/debs" || exit 1
    printf 'libibverbs-dev (headers) in rdma/\n' >> "$KIT/COMMITS"
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
        # the verbs headers of the kit; CUDA 13 keeps libcu++ (cuda/std/...) under include/cccl; torch's CUDA
        # headers (cusparse.h, ...) come with its nvidia-*-cu13 wheels where the toolkit lacks them
        cuda_home="${CUDA_HOME:-}"
        [[ -z "$cuda_home" && -d /usr/local/cuda ]] && cuda_home=/usr/local/cuda
        [[ -n "$cuda_home" ]] || cuda_home="$(dirname "$(dirname "$(command -v nvcc)")")"
        export CUDA_HOME="$cuda_home"
        cu13_include="$("$PY" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "include"))' \
            2>/dev/null)"
        export CPATH="$KIT/rdma/usr/include:$cuda_home/include/cccl${cu13_include:+:$cu13_include}${CPATH:+:$CPATH}"
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
    test=tests/test_intranode.py
    [[ -f "$DEEPEP_DIR/$test" ]] || test=tests/legacy/test_intranode.py  # EPv2's layout
    (cd "$DEEPEP_DIR" && timeout -k 5 "${DEEPEP_SMOKE_TIMEOUT_S:-180}" "$PY" "$test" \
        --num-processes "${DEEPEP_SMOKE_RANKS:-1}" --num-tokens 512) >"$OUT_DIR/deepep_smoke.log" 2>&1
    rc=$?
    echo "deepep intranode test at ${DEEPEP_SMOKE_RANKS:-1} rank(s): rc=$rc (log $OUT_DIR/deepep_smoke.log)"
    tail -5 "$OUT_DIR/deepep_smoke.log"
    exit "$rc"
    ;;
*)
    echo "usage: scripts/deepep.sh prepare DEEPEP_GIT_DIR [COMMIT [FMT_GIT_DIR]] | build | smoke" >&2
    exit 2
    ;;
esac
