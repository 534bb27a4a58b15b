"""NVSHMEM on the GPU: UID bootstrap over mpi4py, symmetric allocation, a linked kernel initialised with
nvshmemx_cumodule_init (clean_low_latency_buffer: device barriers + zeroing)."""
import numpy as np
import pytest

from tests.helpers import all_ok


@pytest.mark.mpi(min_size=2)
def test_nvshmem_init_align_and_linked_kernel(comm):
    import os
    import cupy
    from cupy_ep import jit
    from cupy_ep.nvshmem import Nvshmem
    from tests.gpu.low_latency.test_low_latency import mps_clients, ranks_share_a_gpu
    # NVSHMEM supports one PE per GPU (several only under MPS); with two ranks on one GPU outside MPS it
    # can crash the process in nvshmem init (SIGSEGV), so it is skipped there like the low-latency tests
    if ranks_share_a_gpu(comm) and not mps_clients(comm):
        pytest.skip("NVSHMEM needs one GPU per PE or CUDA MPS (low_latency_mode refuses ranks sharing a GPU likewise)")
    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")  # this test box has NVLink only
    device = comm.Get_rank() % cupy.cuda.runtime.getDeviceCount()
    with cupy.cuda.Device(device), Nvshmem(comm, device) as nv:
        n = 64
        ptr = nv.align(2 * n * 4)
        mem = cupy.cuda.UnownedMemory(ptr, 2 * n * 4, nv, device)
        signals = cupy.ndarray((2 * n,), cupy.int32, cupy.cuda.MemoryPointer(mem, 0))
        signals.fill(7)
        cupy.cuda.runtime.deviceSynchronize()
        peer = nv.peer_ptr(ptr, (comm.Get_rank() + 1) % comm.Get_size())
        kernel = jit.get_kernel("low_latency.cu", "ep::clean_low_latency_buffer",
                                extra_options=(jit.NVSHMEM_DEFINE,))
        nv.init_module(kernel._module.ptr)
        kernel((1,), (128,), (signals[:n], np.int32(n), signals[n:], np.int32(n)))
        cupy.cuda.runtime.deviceSynchronize()
        ok = int(signals.sum()) == 0 and peer != 0
        nv.barrier_all()
        nv.free(ptr)
    assert all_ok(comm, ok), f"rank {comm.Get_rank()}: sum {int(signals.sum())}, peer ptr {peer:#x}"
