"""The NVSHMEM host library of the pip wheel loads and exports what cupy_ep.nvshmem calls (no GPU needed)."""
from cupy_ep import nvshmem


def test_host_library_exports_the_calls_we_use():
    lib = nvshmem._library()
    for name in ("nvshmemx_get_uniqueid", "nvshmemx_set_attr_uniqueid_args", "nvshmemx_hostlib_init_attr",
                 "nvshmemx_hostlib_finalize", "nvshmem_align", "nvshmem_free", "nvshmem_ptr",
                 "nvshmem_barrier_all", "nvshmemx_cumodule_init", "nvshmemx_cumodule_finalize"):
        assert getattr(lib, name) is not None
