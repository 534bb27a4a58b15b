"""S22D: the low-latency start-up on each transport, one process per measurement (the kernel cache warm after the
first): Buffer(low_latency_mode=True) at the decode shape's size, then the first dispatch + combine (cleaning and
kernel loads included), each synchronised. Prints one line: transport, buffer_s, first_calls_s.

    mpirun -n 1 python3 benchmarks/experiments/s22/ll_startup.py ipc|nvshmem
"""
import sys
import time

import numpy as np

import cupy_ep
from cupy_ep import config as cfgmod, reference
from mpi4py import MPI


def main(transport: str) -> None:
    import cupy
    comm = MPI.COMM_WORLD
    R, M, H, E = comm.Get_size(), 128, 7168, 256
    comm.Barrier()
    t0 = time.perf_counter()
    buf = cupy_ep.Buffer(comm, num_rdma_bytes=cfgmod.low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True,
                         backend="cuda", low_latency_transport=transport)
    cupy.cuda.runtime.deviceSynchronize()
    t1 = time.perf_counter()
    with cupy.cuda.Device(buf.device_id):
        rng = np.random.default_rng(comm.Get_rank())
        x_np = rng.standard_normal((M, H), dtype=np.float32).astype(reference.bfloat16)
        x = cupy.asarray(x_np.view(np.uint16)).view(cupy_ep.interop.BF16)
        idx = cupy.asarray(np.argsort(rng.random((M, E)), axis=1)[:, :8].astype(np.int64))
        w = cupy.ones((M, 8), dtype=cupy.float32)
        cupy.cuda.runtime.deviceSynchronize()
        t2 = time.perf_counter()
        (recv, _), _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=True)
        y = cupy.zeros(recv.shape, dtype=cupy.uint16).view(cupy_ep.interop.BF16)
        buf.low_latency_combine(y, idx, w, handle)
        cupy.cuda.runtime.deviceSynchronize()
        t3 = time.perf_counter()
    buf.destroy()
    t4 = time.perf_counter()
    if comm.Get_rank() == 0:
        print(f"ll_startup transport={transport} ranks={R} buffer_s={t1 - t0:.3f} first_calls_s={t3 - t2:.3f} "
              f"destroy_s={t4 - t3:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
