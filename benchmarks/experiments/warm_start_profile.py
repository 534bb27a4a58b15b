"""Warm-start breakdown (run on the GPU machine: `mpirun -n 2 python3 benchmarks/experiments/warm_start_profile.py`): stamps per phase from process start to the first dispatch, cProfile of Buffer() and the first calls."""
import time
T0 = time.perf_counter()
import cProfile, io, pstats, os, sys
import cupy_ep  # first, as `python -m cupy_ep.bench` does: starts the preinit thread before numpy/cupy/MPI
T_np = time.perf_counter()
from mpi4py import MPI
T_mpi = time.perf_counter()
import cupy
T_cupy = time.perf_counter()
import numpy as np
from cupy_ep import bench as B
T_ep = time.perf_counter()
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
def age():
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        up = float(f.read().split()[0])
    return up - start / os.sysconf("SC_CLK_TCK")
pr = cProfile.Profile()
comm.Barrier()
t0 = time.perf_counter()
pr.enable()
cupy.cuda.Device(rank).use()
cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(256))
t_ctx = time.perf_counter()
buf = cupy_ep.Buffer(comm, num_nvl_bytes=1 << 30, check_values=False)
t_buf = time.perf_counter()
x_np, _, idx_np, w_np = B.make_inputs(rank, 2, 128, 7168, 8, 256, 0.0, seed=7)
x = cupy.asarray(x_np.view(np.uint16)).view(cupy_ep.interop.BF16)
idx, w = cupy.asarray(idx_np), cupy.asarray(w_np)
t_in = time.perf_counter()
layout = buf.get_dispatch_layout(idx, 256)
t_lay = time.perf_counter()
out = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                   topk_idx=idx, topk_weights=w)
cupy.cuda.get_current_stream().synchronize()
t_disp = time.perf_counter()
pr.disable()
a = age()
if rank == 0:
    print(f"age {a:.2f}s: cupy_ep(+numpy) {T_np-T0:.3f} mpi4py+init {T_mpi-T_np:.3f} cupy {T_cupy-T_mpi:.3f} "
          f"bench {T_ep-T_cupy:.3f} preinit {cupy_ep.preinit.status} | ctx {t_ctx-t0:.3f} Buffer {t_buf-t_ctx:.3f} inputs {t_in-t_buf:.3f} "
          f"layout {t_lay-t_in:.3f} dispatch {t_disp-t_lay:.3f}", flush=True)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30)
    print("\n".join(s.getvalue().splitlines()[:50]), flush=True)
buf.destroy()
