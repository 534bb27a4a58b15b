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
        mod.get_function("poke")((1,), (128,),
                                 (gpu_buffer.impl._nvl.ptr_table, np.int32(rank), np.int32(size), np.int32(n)))
        cupy.cuda.runtime.deviceSynchronize()
        comm.Barrier()
        out = cupy.zeros(2 * n, dtype=cupy.int32)
        mod.get_function("peek")((1,), (128,),
                                 (gpu_buffer.impl._nvl.ptr_table, np.int32(rank), np.int32(size), np.int32(n), out))
        got = out.get()
    src = (rank + size - 1) % size
    ok = (np.array_equal(got[:n], 1000 * (src + 1) + np.arange(n))
          and np.array_equal(got[n:], 1000 * (rank + 1) + np.arange(n)))
    if rank == 0:
        print(f"bootstrap: {size} ranks, peer pointers {[hex(p) for p in gpu_buffer.impl._nvl.ptrs]}, "
              f"read back ok={ok}")
    comm.Barrier()
    gpu_buffer.barrier()  # the signal area we skipped is intact: the device barrier still works
    assert all_ok(comm, ok), f"rank {rank}: got {got[:4]}.. / {got[n:n + 4]}.."


@pytest.mark.mpi(min_size=2)
def test_local_buffer_tensor_is_what_the_peers_see(comm, gpu_buffer):
    """get_local_buffer_tensor views this rank's own NVLink buffer: what a rank writes through it, the next rank
    reads through its CUDA-IPC mapping of that buffer (past the signal header); a torch dtype gives a tensor over
    the same bytes; get_comm_stream is the buffer's communication stream; is_sm90_compiled holds on an H200."""
    import cupy

    import cupy_ep
    from cupy_ep import config as cfgmod
    rank, size = comm.Get_rank(), comm.Get_size()
    n, offset = 256, 8192
    with cupy.cuda.Device(gpu_buffer.device_id):
        whole = gpu_buffer.get_local_buffer_tensor(cupy.uint8)
        view = gpu_buffer.get_local_buffer_tensor(np.int32, n, offset=offset)
        view[:] = cupy.arange(n, dtype=cupy.int32) + 7000 * (rank + 1)
        cupy.cuda.runtime.deviceSynchronize()
        comm.Barrier()
        src = (rank + size - 1) % size
        mem = cupy.cuda.UnownedMemory(gpu_buffer.impl._nvl.ptrs[src] + cfgmod.SIGNAL_BYTES + offset, 4 * n, gpu_buffer,
                                      gpu_buffer.device_id)
        got = cupy.ndarray((n,), cupy.int32, cupy.cuda.MemoryPointer(mem, 0)).get()
        comm.Barrier()
        same_bytes = np.array_equal(whole[offset:offset + 4 * n].view(cupy.int32).get(), view.get())
        torch_ok = True
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            t = gpu_buffer.get_local_buffer_tensor(torch.int32, (n,), offset=offset)
            torch_ok = t.is_cuda and t.cpu().numpy().tolist() == view.get().tolist()
    ok = (np.array_equal(got, np.arange(n) + 7000 * (src + 1)) and same_bytes and torch_ok
          and whole.shape == (gpu_buffer.num_nvl_bytes,)
          and _stream_ptr(gpu_buffer.get_comm_stream()) == gpu_buffer.comm_stream.ptr
          and cupy_ep.Buffer.is_sm90_compiled())
    assert all_ok(comm, ok), f"rank {rank}: got {got[:4]}.. from rank {src}, same bytes {same_bytes}, torch {torch_ok}"


def _stream_ptr(stream) -> int:
    """The CUDA stream behind a CuPy or a torch stream object (get_comm_stream gives the one of the framework the
    buffer's last call used: test_streams.py checks which)."""
    return stream.cuda_stream if hasattr(stream, "cuda_stream") else stream.ptr


_ARRIVE = r"""
extern "C" __global__ void arrive(unsigned long long* ptrs, int total, long long timeout_cycles, int* seen) {
    // Every block of every rank on this GPU counts itself in, then waits for all of them: only blocks that are
    // resident at the same time get past the wait before the timeout.
    extern __shared__ int pad[];
    int* counter = (int*)ptrs[0];
    if (threadIdx.x == 0) {
        atomicAdd(counter, 1);
        long long start = clock64();
        int n = 0;
        while ((n = *(volatile int*)counter) < total && clock64() - start < timeout_cycles) {}
        seen[blockIdx.x] = n;
    }
    pad[threadIdx.x] = threadIdx.x;  // the shared memory is used, so that it is really allocated
}
"""


@pytest.mark.mpi(min_size=1)
def test_the_ranks_of_a_gpu_hold_their_sm_share_at_once(comm, gpu_buffer):
    """Buffer.sm_share.per_rank blocks per rank, on every rank of a GPU at once, are all resident together at one
    block per SM (the most shared memory a block may take): the low-latency grid and the normal-mode SM limit rely
    on it, since their blocks wait for the peers' blocks. Under MPS with a provisioned share
    (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) a grid sized by the whole GPU's half left blocks waiting for SMs."""
    import cupy

    from cupy_ep import bootstrap
    share = gpu_buffer.sm_share
    if share.ranks_per_gpu > 1 and not share.mps:
        pytest.skip("ranks sharing a GPU without CUDA MPS run in time slices: their blocks are never resident at once")
    rt = cupy.cuda.runtime
    with cupy.cuda.Device(gpu_buffer.device_id):
        bus = rt.deviceGetPCIBusId(gpu_buffer.device_id)
        import socket
        colors = sorted(set(comm.allgather((socket.gethostname(), bus))))
        same_gpu = comm.Split(colors.index((socket.gethostname(), bus)), comm.Get_rank())
        try:
            total = same_gpu.allreduce(share.per_rank)
            counter = bootstrap.IpcBuffer(same_gpu, 256)
            smem = rt.deviceGetAttribute(97, gpu_buffer.device_id)  # cudaDevAttrMaxSharedMemoryPerBlockOptin
            kernel = cupy.RawKernel(_ARRIVE, "arrive")
            kernel.max_dynamic_shared_size_bytes = smem
            seen = cupy.zeros(share.per_rank, dtype=cupy.int32)
            same_gpu.Barrier()
            kernel((share.per_rank,), (1024,), (counter.ptr_table, np.int32(total), np.int64(10 * 2_000_000_000),
                                                seen), shared_mem=smem)
            rt.deviceSynchronize()
            got = seen.get()
            counter.close()
        finally:
            same_gpu.Free()
    ok = bool((got == total).all())
    assert all_ok(comm, ok), (f"rank {comm.Get_rank()}: {share.describe()}: of {total} blocks on this GPU, this "
                              f"rank's saw at least {got.min()} and at most {got.max()} arrive")
