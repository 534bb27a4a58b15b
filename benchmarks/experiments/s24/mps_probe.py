"""S24 (its helpers tidied after the runs: the same kernels and output): what CUDA MPS gives ranks sharing one GPU (run under mpirun, 2 ranks, with and without the MPS daemon).

Per rank it prints: whether contexts go through MPS (cudaDevAttrMpsEnabled), the device's SMs, the SMs MPS
provisions to this process (cuCtxGetExecAffinity, via cupy_ep.bootstrap.query_mps) and the SmShare cupy_ep takes
from them; then, with both ranks launching after a barrier:
  coresident  N blocks that each wait (<= 200 ms) until all N have arrived: are N blocks resident at once, with the
              other rank's grid running beside them? (N = SmShare.per_rank, then the device's SM count)
  ping-pong   1000 round trips of a flag through a CUDA-IPC buffer between the two ranks' kernels (us per trip)
"""
import time

import numpy as np
from mpi4py import MPI

import cupy
from cupy_ep import bootstrap

SRC = r'''
__device__ long long now_ns() {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// Spin until *p >= n or timeout_ns have passed; returns the last value read.
__device__ int wait_at_least(const int* p, int n, long long timeout_ns) {
    const long long start = now_ns();
    int v;
    do { v = *((volatile const int*)p); } while (v < n && now_ns() - start < timeout_ns);
    return v;
}
extern "C" __global__ void coresident(int* counter, int n, long long timeout_ns, int* seen) {
    if (threadIdx.x == 0) {
        atomicAdd(counter, 1);
        seen[blockIdx.x] = wait_at_least(counter, n, timeout_ns);
    }
}
// rank 0 writes i to the peer's flag and waits for i back in its own; rank 1 echoes. Gives up after 1 s per trip.
extern "C" __global__ void pingpong(int* mine, int* peer, int trips, int is_first, int* done) {
    for (int i = 1; i <= trips; ++i) {
        if (is_first) *((volatile int*)peer) = i;
        if (wait_at_least(mine, i, 1000000000LL) < i) { *done = -i; return; }
        if (!is_first) { __threadfence_system(); *((volatile int*)peer) = i; }
        __threadfence_system();
    }
    *done = trips;
}
'''


def main():
    comm = MPI.COMM_WORLD
    rank, R = comm.Get_rank(), comm.Get_size()
    dev = rank % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(dev).use()
    share = bootstrap.gpu_sm_share(comm, dev, R)  # one machine: all R ranks on it
    mps, provisioned, gpu_sms, device_sms = share.mps, share.provisioned_sms, share.gpu_sms, share.device_sms
    mod = cupy.RawModule(code=SRC)
    lines = [f"rank {rank}: gpu {dev} mps={mps} device_sms={device_sms} provisioned={provisioned} gpu_sms={gpu_sms} "
             f"per_rank={share.per_rank} normal_mode_sms={share.normal_mode_sms} ({share.describe()})"]

    for n in sorted({share.per_rank, device_sms}):
        counter, seen = cupy.zeros(1, cupy.int32), cupy.zeros(n, cupy.int32)
        comm.Barrier()
        t0 = time.perf_counter()
        mod.get_function("coresident")((n,), (32,), (counter, np.int32(n), np.int64(200_000_000), seen))
        cupy.cuda.runtime.deviceSynchronize()
        dt = time.perf_counter() - t0
        lines.append(f"rank {rank}: coresident n={n}: min seen {int(seen.min())} of {n} in {dt * 1e3:.1f} ms "
                     f"({'all resident' if int(seen.min()) == n else 'NOT all resident'})")

    if R == 2:
        ipc = bootstrap.IpcBuffer(comm, 256)
        flags = cupy.ndarray((1,), cupy.int32, cupy.cuda.MemoryPointer(
            cupy.cuda.UnownedMemory(ipc.ptr, 256, ipc, dev), 0))
        peer_ptr = ipc.ptrs[1 - rank]
        done = cupy.zeros(1, cupy.int32)
        for trips in (10, 1000):
            flags.fill(0)
            cupy.cuda.runtime.deviceSynchronize()
            comm.Barrier()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            mod.get_function("pingpong")((1,), (1,), (flags, np.uint64(peer_ptr), np.int32(trips),
                                                      np.int32(rank == 0), done))
            end.record()
            end.synchronize()
            ms = cupy.cuda.get_elapsed_time(start, end)
            lines.append(f"rank {rank}: ping-pong {trips} trips: done={int(done[0])} "
                         f"{ms * 1e3 / trips:.2f} us per round trip")
            comm.Barrier()
        ipc.close()
    gathered = comm.gather(lines)
    if rank == 0:
        print("\n".join(line for chunk in gathered for line in chunk), flush=True)


if __name__ == "__main__":
    main()
