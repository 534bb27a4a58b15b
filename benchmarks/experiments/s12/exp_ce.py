"""Copy engines for the combine's transfer? Both ranks cudaMemcpyAsync 58.7 MB (4096 rows of 14336 B) into the
peer's memory at once (CUDA IPC), in N chunks on one stream; events around, slowest rank, median of 20; alone and
next to an SM load (a CuPy elementwise add over 2 x 512 MB on another stream, as reducers would run).
    mpirun -n 2 python exp_ce.py"""
import numpy as np
from mpi4py import MPI

import cupy

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
peer = (rank + 1) % R
cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
nbytes = 4096 * 14336
src = cupy.ones(nbytes // 4, dtype=cupy.float32)
dst = cupy.zeros(nbytes // 4, dtype=cupy.float32)
handles = comm.allgather(cupy.cuda.runtime.ipcGetMemHandle(dst.data.ptr))
peer_ptr = cupy.cuda.runtime.ipcOpenMemHandle(handles[peer])
stream, other = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
a = cupy.ones(128 << 20, dtype=cupy.float32)
b = cupy.ones(128 << 20, dtype=cupy.float32)


def run(chunks, load):
    times = []
    for _ in range(22):
        cupy.cuda.runtime.deviceSynchronize()
        comm.Barrier()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        if load:
            with other:
                for _ in range(3):
                    a += b
        step = -(-nbytes // chunks) // 16 * 16
        for off in range(0, nbytes, step):
            n = min(step, nbytes - off)
            cupy.cuda.runtime.memcpyAsync(peer_ptr + off, src.data.ptr + off, n, 3, stream.ptr)
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
    t = max(comm.allgather(float(np.median(times[2:]))))
    if rank == 0:
        print(f"CE {'with SM load' if load else 'alone':12s} chunks={chunks:3d}: {t:7.1f} us  {nbytes / t / 1e3:6.1f} GB/s "
              "per direction (both ranks at once)", flush=True)


for chunks in (1, 8, 16, 32, 64):
    run(chunks, False)
for chunks in (1, 16):
    run(chunks, True)
cupy.cuda.runtime.deviceSynchronize()
comm.Barrier()
cupy.cuda.runtime.ipcCloseMemHandle(peer_ptr)
