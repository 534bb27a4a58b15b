"""Where a low-latency call's host time goes (prepared in session 18, not run): the benchmark's `host us per call`
is 55-100 us for a dispatch or a combine (S18B/S18E), all of it Python and launch cost. This profiles N plain calls
(no sync inside the loop) under cProfile and prints the functions by their own time, per call.

    mpirun -n 1 python3 benchmarks/experiments/s18/ll_host_profile.py [--calls 2000]   (one GPU is enough)
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
from mpi4py import MPI

import cupy
import cupy_ep
from cupy_ep import config as cfgmod, interop, reference


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--check-values", action="store_true",
                   help="the Buffer's default check_values=True (value checks on the host, a sync each call)")
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    R, M = comm.Get_size(), a.tokens
    rdma = cfgmod.low_latency_rdma_size_hint(M, a.hidden, R, a.experts)
    buf = cupy_ep.Buffer(comm, num_rdma_bytes=rdma, low_latency_mode=True, check_values=a.check_values, backend="cuda")
    with cupy.cuda.Device(buf.device_id):
        rng = np.random.default_rng(comm.Get_rank())
        x_host = rng.standard_normal((a.tokens, a.hidden), dtype=np.float32).astype(reference.bfloat16)
        x = cupy.asarray(x_host.view(np.uint16)).view(interop.BF16)
        idx = cupy.asarray(np.argsort(rng.random((a.tokens, a.experts)), axis=1)[:, :a.topk].astype(np.int64))
        w = cupy.asarray(rng.random((a.tokens, a.topk), dtype=np.float32))
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, a.experts, use_fp8=True)
        y = cupy.zeros((a.experts // R, R * M, a.hidden), dtype=cupy.uint16).view(interop.BF16)
        ops = {"dispatch": lambda: buf.low_latency_dispatch(x, idx, M, a.experts, use_fp8=True),
               "combine": lambda: buf.low_latency_combine(y, idx, w, handle)}
        for name, fn in ops.items():
            for _ in range(50):
                fn()
            cupy.cuda.runtime.deviceSynchronize()
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(a.calls):
                fn()
            plain = (time.perf_counter() - t0) / a.calls * 1e6
            cupy.cuda.runtime.deviceSynchronize()
            comm.Barrier()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls):
                fn()
            prof.disable()
            cupy.cuda.runtime.deviceSynchronize()
            if comm.Get_rank() == 0:
                print(f"\n== {name}: {plain:.1f} us per call on the host without the profiler; under cProfile, "
                      f"per call (tottime / {a.calls}):", flush=True)
                stats = pstats.Stats(prof)
                rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]
                for (file, line, func), (cc, nc, tt, ct, _) in rows:
                    print(f"  {tt / a.calls * 1e6:7.2f} us own {ct / a.calls * 1e6:7.2f} us cum {nc / a.calls:6.1f} "
                          f"calls  {func} ({file.split('/')[-1]}:{line})")
    buf.destroy()


if __name__ == "__main__":
    main()
