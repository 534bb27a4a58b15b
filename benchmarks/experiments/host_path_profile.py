"""Host-side profile of low_latency_dispatch / combine (run on the GPU machine: `mpirun -n 2 python3 benchmarks/experiments/host_path_profile.py`): us per plain call, then cProfile of 300 calls."""
import cProfile, pstats, time, io
import numpy as np
from mpi4py import MPI
import cupy
import cupy_ep
from cupy_ep import config as cfgmod, reference

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
M, H, E, K = 128, 7168, 256, 8
buf = cupy_ep.Buffer(comm, num_nvl_bytes=1 << 26, num_rdma_bytes=cfgmod.low_latency_rdma_size_hint(M, H, R, E),
                     low_latency_mode=True, check_values=False, backend="cuda")
with cupy.cuda.Device(buf.device_id):
    rng = np.random.default_rng(rank)
    x = cupy.asarray(rng.standard_normal((M, H), dtype=np.float32).astype(reference.bfloat16).view(np.uint16)).view(cupy_ep.interop.BF16)
    idx = cupy.asarray(np.argsort(-rng.random((M, E)), axis=1)[:, :K].astype(np.int64))
    w = cupy.asarray(rng.random((M, K), dtype=np.float32))
    out = buf.low_latency_dispatch(x, idx, M, E, use_fp8=True)
    y = cupy.zeros((E // R, R * M, H), dtype=cupy.uint16).view(cupy_ep.interop.BF16)
    buf.low_latency_combine(y, idx, w, out[2])
    cupy.cuda.runtime.deviceSynchronize()
    for name, fn in (("ll_dispatch", lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=True)),
                     ("ll_combine", lambda: buf.low_latency_combine(y, idx, w, out[2]))):
        comm.Barrier()
        n = 300
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        cupy.cuda.runtime.deviceSynchronize()
        t2 = time.perf_counter()
        comm.Barrier()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            fn()
        pr.disable()
        cupy.cuda.runtime.deviceSynchronize()
        if rank == 0:
            print(f"{name}: host {1e6 * (t1 - t0) / n:.1f} us/call enqueued, {1e6 * (t2 - t0) / n:.1f} us/call incl. drain")
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
            print("\n".join(s.getvalue().splitlines()[:40]))
buf.destroy()
