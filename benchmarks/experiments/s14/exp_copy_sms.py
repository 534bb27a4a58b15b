"""S14 experiment: the plain P2P copy kernel (every GPU writing to its peer at once, as the ceiling) at small sizes
and many SMs, to see whether the low-latency combine's ~200-220 GB/s of partial rows (66 or 132 SMs storing
2.75 MB) is what the link gives such transfers, or whether many storing SMs cost bandwidth.

    mpirun -n 2 python3 benchmarks/experiments/s14/exp_copy_sms.py
"""
from mpi4py import MPI

from cupy_ep import Buffer, bench

comm = MPI.COMM_WORLD
buf = Buffer(comm, num_nvl_bytes=256 << 20)
timer = bench.GpuTimer(comm, iters=50, warmup=5)
for nbytes in (1_800_000, 2_750_000, 7_340_000, 58_720_256):
    sms = [8, 16, 32, 66, 132]
    graph, steady = bench.measure_ceiling(buf, timer, nbytes, sms, steady_n=10)
    if comm.Get_rank() == 0:
        for s in sms:
            print(f"bytes {nbytes:9d} sms {s:3d}: graph {graph[s]:6.1f} GB/s ({nbytes / graph[s] / 1e3:7.1f} us)  "
                  f"steady {steady[s]:6.1f} GB/s ({nbytes / steady[s] / 1e3:7.1f} us)", flush=True)
buf.destroy()
