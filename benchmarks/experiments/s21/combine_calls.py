"""Session 21: N plain low-latency combines of the decode shape (one dispatch first), for ncu to profile one of them:
the 24-bit default or, with --logfmt, LogFMT-10 partials (S21D: 16.2 against 10.8 us aligned at one rank).

    mpirun -n 1 ncu --kernel-name regex:combine --launch-skip 5 --launch-count 1 ... \\
        python3 benchmarks/experiments/s21/combine_calls.py [--logfmt]
"""
from __future__ import annotations

import argparse

import cupy
import numpy as np
from mpi4py import MPI

import cupy_ep
from cupy_ep import config as cfgmod, interop, reference


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--logfmt", action="store_true")
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    R, T, H, E, K = comm.Get_size(), 128, 7168, 256, 8
    buf = cupy_ep.Buffer(comm, num_rdma_bytes=cfgmod.low_latency_rdma_size_hint(T, H, R, E), low_latency_mode=True,
                         check_values=False, backend="cuda")
    with cupy.cuda.Device(buf.device_id):
        rng = np.random.default_rng(comm.Get_rank())
        x = cupy.asarray(rng.standard_normal((T, H), dtype=np.float32).astype(reference.bfloat16).view(np.uint16))
        x = x.view(interop.BF16)
        idx = cupy.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64))
        w = cupy.asarray(rng.random((T, K), dtype=np.float32))
        y = cupy.asarray((rng.standard_normal((E // R, R * T, H), dtype=np.float32) * 0.1).astype(reference.bfloat16)
                         .view(np.uint16)).view(interop.BF16)
        handle = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[2]
        for _ in range(a.calls):
            buf.low_latency_combine(y, idx, w, handle, use_logfmt=a.logfmt)
            buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)  # (the buffers alternate per call)
        cupy.cuda.runtime.deviceSynchronize()
    print(f"{a.calls} combines ({'LogFMT-10' if a.logfmt else '24-bit'} partials) done", flush=True)
    buf.destroy()


if __name__ == "__main__":
    main()
