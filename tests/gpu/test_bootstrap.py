"""The IPC bootstrap: every rank opens every peer's buffer; a kernel writes into a peer and reads back."""
import numpy as np
import pytest

from tests.helpers import all_ok

_KERNEL = r"""
extern "C" __global__ void poke(unsigned long long* ptrs, int rank, int num_ranks, int slot_ints) {
    // write my signature into slot `rank` of the next rank's buffer (skipping the signal bytes)
    int* peer = (int*)ptrs[(rank + 1) % num_ranks] + 64;
    for (int i = threadIdx.x; i < slot_ints; i += blockDim.x) peer[rank * slot_ints + i] = 1000 * (rank + 1) + i;
}
extern "C" __global__ void peek(unsigned long long* ptrs, int rank, int num_ranks, int slot_ints, int* out) {
    // read back what the previous rank wrote into *my* buffer, through the previous rank's view is not
    // needed: we read our own buffer and the next rank's buffer (our own write) through IPC
    int src = (rank + num_ranks - 1) % num_ranks;
    int* mine = (int*)ptrs[rank] + 64;
    int* peer = (int*)ptrs[(rank + 1) % num_ranks] + 64;
    for (int i = threadIdx.x; i < slot_ints; i += blockDim.x) {
        out[i] = mine[src * slot_ints + i];
        out[slot_ints + i] = peer[rank * slot_ints + i];
    }
}
"""


@pytest.mark.mpi(min_size=2)
def test_peer_write_and_read_back(comm, gpu_buffer):
    import cupy
    rank, size = comm.Get_rank(), comm.Get_size()
    mod = cupy.RawModule(code=_KERNEL)
    n = 256
    with cupy.cuda.Device(gpu_buffer.device_id):
        mod.get_function("poke")((1,), (128,), (gpu_buffer._nvl.ptr_table, np.int32(rank), np.int32(size), np.int32(n)))
        cupy.cuda.runtime.deviceSynchronize()
        comm.Barrier()
        out = cupy.zeros(2 * n, dtype=cupy.int32)
        mod.get_function("peek")((1,), (128,), (gpu_buffer._nvl.ptr_table, np.int32(rank), np.int32(size), np.int32(n), out))
        got = out.get()
    src = (rank + size - 1) % size
    ok = np.array_equal(got[:n], 1000 * (src + 1) + np.arange(n)) and np.array_equal(got[n:], 1000 * (rank + 1) + np.arange(n))
    if rank == 0:
        print(f"bootstrap: {size} ranks, peer pointers {[hex(p) for p in gpu_buffer._nvl.ptrs]}, read back ok={ok}")
    comm.Barrier()
    gpu_buffer.barrier()  # the signal area we skipped is intact: the device barrier still works
    assert all_ok(comm, ok), f"rank {rank}: got {got[:4]}.. / {got[n:n + 4]}.."
