"""Every kernel instantiation in cuda_src/ compiles with NVRTC for sm_90, without a GPU, without spills."""
import re

import pytest

from cupy_ep import jit
from cupy_ep.errors import CompileError

RANKS = range(1, 9)


def intranode_names():
    names = ["ep::carve_probe"]
    for r in RANKS:
        names += [f"ep::barrier<{r}>", f"ep::notify_dispatch<{r}>", f"ep::cached_notify_dispatch<{r}>",
                  f"ep::cached_notify_combine<{r}>", f"ep::combine<{r}>",
                  f"ep::dispatch<{r}, long long>", f"ep::dispatch<{r}, int>",
                  f"ep::dispatch_direct<{r}, long long>", f"ep::dispatch_direct<{r}, int>",
                  f"ep::combine_direct<{r}>"]
    return names


# Internode: instantiated on demand for any (nodes, GPUs per node); compile a representative set: every GPU
# count at 2 nodes (the GPU tests use 2 x 1 and 2 x 2) and cluster shapes of 8 GPUs per node up to 32 nodes.
INTERNODE_SHAPES = [(2, 1), (2, 2), (2, 4), (2, 8), (3, 8), (4, 8), (8, 8), (16, 8), (20, 8), (32, 8)]


def internode_names(transport):
    names = ["ep::internode_carve_probe"] if transport == "ep::IpcRdma" else []
    for n, g in INTERNODE_SHAPES:
        names += [f"ep::internode_notify_dispatch<{n}, {g}, {transport}>",
                  f"ep::internode_cached_notify<{n}, {g}, {transport}>",
                  f"ep::internode_combine<{n}, {g}, {transport}>"]
        names += [f"ep::internode_dispatch<{n}, {g}, {transport}, {t}>" for t in ("long long", "int")]
    return names + [f"ep::internode_put_bandwidth<{transport}>"]


LL_KERNELS = ["ep::ll_carve_probe", "ep::combine<long long>", "ep::combine<int>"] + [
    f"ep::dispatch<{fp8}, {t}>" for fp8 in ("true", "false") for t in ("long long", "int")]
# the instantiations of the larger top-k bounds (config.LL_TOPK_BOUNDS; the first is the default, above)
LL_BOUND_KERNELS = [f"ep::combine<{t}, {b}>" for b in (16, 32) for t in ("long long", "int")] + [
    f"ep::dispatch<{fp8}, {t}, {b}>" for b in (16, 32) for fp8 in ("true", "false") for t in ("long long", "int")]

KERNELS = {
    "layout.cu": ["ep::get_dispatch_layout<long long>", "ep::get_dispatch_layout<int>"],
    "intranode.cu": intranode_names(),
    "probes/copy.cu": ["ep::p2p_copy"],
    "probes/timing.cu": ["ep::spin_ns"],
    # the IPC transport: no NVSHMEM header, not relocatable (the NVSHMEM one is test_internode_nvshmem_...)
    "internode.cu": internode_names("ep::IpcRdma"),
    # the CUDA-IPC build: no NVSHMEM (the NVSHMEM build is test_low_latency_nvshmem_build_is_linked...)
    "low_latency.cu": LL_KERNELS + LL_BOUND_KERNELS,
}


def test_low_latency_bound_kernels_cover_every_bound():
    """Every top-k bound but the default has its dispatch and combine instantiations in the compile list."""
    from cupy_ep import config
    assert {int(n.rsplit(",", 1)[1].rstrip(">")) for n in LL_BOUND_KERNELS} == set(config.LL_TOPK_BOUNDS[1:])


@pytest.mark.parametrize("filename", sorted(KERNELS))
def test_compiles_for_sm90_without_spills(filename):
    result = jit.compile_only(filename, KERNELS[filename], arch="sm_90")
    assert result.cubin[:4] == b"\x7fELF"
    assert set(result.mapping) == set(KERNELS[filename])
    assert all(v.startswith("_Z") for v in result.mapping.values())
    resources = result.resources()
    for expr, lowered in result.mapping.items():  # our kernels (NVSHMEM's library functions use a stack)
        res = resources[lowered]
        assert res.get("spill_stores", 0) == 0, f"{expr} spills: {res}"
        assert 0 < res["registers"] <= 128, f"{expr}: {res}"
    # ... and none of our device functions was left out of line with a spilling call frame (with -rdc a
    # non-template __device__ function has external linkage and may stay a call: LL's combine_send did, with
    # a 272-byte frame per thread, until it was marked __forceinline__)
    # (except put_message: kept out of line on purpose, on the NVSHMEM put path only, so that its NVSHMEM code does
    # not take registers from the 1024-thread dispatch's common path; its frame saves the registers it uses)
    ours = {k: v for k, v in resources.items() if "nvshmem" not in k.lower() and k not in result.mapping.values()
            and "put_message" not in k}
    assert not {k: v for k, v in ours.items() if v.get("spill_stores", 0)}, ours


def test_low_latency_stamping_build_compiles():
    """The profiling build (phase stamps compiled in, cuda.low_latency.STAMPS_OPTION) compiles, differs from the
    plain one, and stays close to it: the 1024-thread dispatch is at its 64-register limit, so the stamps' extra
    live values may spill a few bytes there (20 in the FP8 dispatch when this was written: the stamped kernel is
    slightly slower than the one the timings measure), but no more than that."""
    from cupy_ep.cuda.low_latency import STAMPS_OPTION
    names = ["ep::dispatch<true, long long>", "ep::dispatch<true, int>", "ep::combine<long long>"]
    result = jit.compile_only("low_latency.cu", names, arch="sm_90", extra_options=(STAMPS_OPTION,))
    resources = result.resources()
    for expr, lowered in result.mapping.items():
        assert resources[lowered].get("spill_stores", 0) <= 32, f"{expr} spills: {resources[lowered]}"
    plain = jit.compile_only("low_latency.cu", names, arch="sm_90")
    assert plain.cubin != result.cubin, "the option must change the build"


def test_every_source_file_is_covered():
    """Every entry file (.cu, at any depth) has its kernels in KERNELS, and every header is included by some file."""
    root = jit.source_dir()
    files = {p.relative_to(root).as_posix() for p in jit.source_files() if p.suffix == ".cu"}
    assert files == set(KERNELS), "add the new file's kernels to KERNELS"
    included = set()
    for p in jit.source_files():
        included |= set(re.findall(r'#include "([^"]+)"', p.read_text()))
    headers = {p.relative_to(root).as_posix() for p in jit.source_files() if p.suffix == ".cuh"}
    assert headers <= included, f"headers nothing includes: {sorted(headers - included)}"
    assert {i for i in included if not i.startswith("nvshmem")} <= headers | {"cuda/std/type_traits"} | set(
        jit.generated_headers())


def test_source_hash_and_package_data_cover_every_file(tmp_path, monkeypatch):
    """The kernel cache key changes with any file under cuda_src/, in a subfolder too, and pyproject.toml's
    package-data patterns match every such file (an installed package compiles from the same tree)."""
    import glob
    import tomllib
    from pathlib import Path
    root = jit.source_dir()
    rel = [p.relative_to(root).as_posix() for p in jit.source_files()]
    assert any("/" in r for r in rel) and not [p for p in root.rglob("*") if p.is_file() and p.suffix not in
                                              jit.SOURCE_SUFFIXES and "__pycache__" not in p.parts]
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["cupy_ep.cuda_src"]

    # setuptools expands package-data patterns with glob(recursive=True) in the package's folder
    shipped = {s for pat in patterns for s in glob.glob(pat, root_dir=root, recursive=True)}
    assert set(rel) <= shipped, sorted(set(rel) - shipped)
    copy = tmp_path / "cuda_src"
    for r in rel:
        (copy / r).parent.mkdir(parents=True, exist_ok=True)
        (copy / r).write_bytes((root / r).read_bytes())
    monkeypatch.setattr(jit, "source_dir", lambda: copy)
    jit.source_hash.cache_clear()
    try:
        first = jit.source_hash()
        for r in rel:
            original = (copy / r).read_bytes()
            (copy / r).write_bytes(original + b"\n")
            jit.source_hash.cache_clear()
            assert jit.source_hash() != first, r
            (copy / r).write_bytes(original)
        jit.source_hash.cache_clear()
        assert jit.source_hash() == first
    finally:
        jit.source_hash.cache_clear()


def test_compile_error_carries_the_log(tmp_path, monkeypatch):
    bad = tmp_path / "cuda_src"
    root = jit.source_dir()
    for p in jit.source_files():
        if p.suffix == ".cuh":
            (bad / p.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
            (bad / p.relative_to(root)).write_text(p.read_text())
    (bad / "broken.cu").write_text('#include "common/wait.cuh"\n__global__ void k() { undefined_symbol(); }\n')
    monkeypatch.setattr(jit, "source_dir", lambda: bad)
    with pytest.raises(CompileError) as info:
        jit.compile_cubin("broken.cu", ["k"], arch="sm_90")
    assert "undefined_symbol" in info.value.log


def test_source_hash_covers_headers(tmp_path, monkeypatch):
    src = tmp_path / "cuda_src"
    (src / "common").mkdir(parents=True)
    (src / "common" / "wait.cuh").write_text("#define A 1\n")
    monkeypatch.setattr(jit, "source_dir", lambda: src)
    jit.source_hash.cache_clear()
    try:
        first = jit.source_hash()
        (src / "common" / "wait.cuh").write_text("#define A 2\n")
        jit.source_hash.cache_clear()
        assert jit.source_hash() != first
    finally:
        jit.source_hash.cache_clear()


def _assert_nvshmem_linked_without_spills(result) -> None:
    """An executable (linked) cubin holding NVSHMEM's device state; each of our kernels within the 128 registers
    the launch bounds allow, without spills."""
    assert b"nvshmemi_device_state_d" in result.cubin
    e_type = int.from_bytes(result.cubin[16:18], "little")
    assert e_type == 2, f"ELF type {e_type}: not an executable (linked) cubin"
    resources = result.resources()
    for expr, lowered in result.mapping.items():
        res = resources[lowered]
        assert res.get("spill_stores", 0) == 0, f"{expr} spills: {res}"
        assert 0 < res["registers"] <= 128, f"{expr}: {res}"


def test_low_latency_nvshmem_build_is_linked_without_spills():
    """low_latency.cu with -DCUPY_EP_NVSHMEM (the NVSHMEM transport) is relocatable code: the result must be an
    executable cubin with NVSHMEM's device state linked in (the symbol nvshmemx_cumodule_init fills at load time),
    its kernels within the launch bounds' registers, without spills; clean_low_latency_buffer (NVSHMEM barriers)
    exists in this build only."""
    assert not jit.uses_nvshmem("low_latency.cu") and jit.uses_nvshmem("low_latency.cu", (jit.NVSHMEM_DEFINE,))
    assert not jit.uses_nvshmem("intranode.cu")
    names = LL_KERNELS + ["ep::clean_low_latency_buffer", "ep::dispatch<true, long long, 32>",
                          "ep::combine<long long, 32>"]
    _assert_nvshmem_linked_without_spills(jit.compile_only("low_latency.cu", names,
                                                           extra_options=(jit.NVSHMEM_DEFINE,)))


def test_low_latency_ipc_build_needs_no_nvshmem():
    """The CUDA-IPC build: no NVSHMEM state in the cubin, and no NVSHMEM barrier kernel."""
    result = jit.compile_only("low_latency.cu", ["ep::combine<int>"])
    assert b"nvshmemi_device_state_d" not in result.cubin
    with pytest.raises(CompileError):
        jit.compile_only("low_latency.cu", ["ep::clean_low_latency_buffer"])


def test_internode_nvshmem_transport_compiles_links_without_spills():
    """internode.cu with -DCUPY_EP_NVSHMEM: the same kernels over NVSHMEM, relocatable and linked with NVSHMEM's
    device library; registers within the 128 the launch bounds allow, no spills."""
    names = internode_names("ep::NvshmemRdma")
    assert not jit.uses_nvshmem("internode.cu") and jit.uses_nvshmem("internode.cu", (jit.NVSHMEM_DEFINE,))
    _assert_nvshmem_linked_without_spills(jit.compile_only("internode.cu", names, extra_options=(jit.NVSHMEM_DEFINE,)))


def test_internode_ipc_transport_needs_no_nvshmem():
    """The IPC instantiations compile without NVSHMEM: not relocatable, no NVSHMEM state in the cubin."""
    result = jit.compile_only("internode.cu", ["ep::internode_dispatch<2, 2, ep::IpcRdma, long long>"])
    assert b"nvshmemi_device_state_d" not in result.cubin
