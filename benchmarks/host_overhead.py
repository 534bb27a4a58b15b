"""Host (Python) time per call of the GPU path: mpirun -n 2 python benchmarks/host_overhead.py [out_dir].

Prints the median host-side time of get_dispatch_layout, cached dispatch and combine calls, and of the
low-latency pair (low_latency_dispatch, low_latency_combine; over the CUDA-IPC transport, which also runs with
the ranks sharing one GPU), each call timed alone from a synchronized start (no device sync inside the timed
call), and writes a cProfile of the cached dispatch calls to out_dir/host_profile.txt. It uses only the public
API, so the same script times any tree of cupy_ep (scripts/bench_ab.sh runs it over two)."""
import cProfile
import io
import pstats
import sys
import time

import numpy as np
from mpi4py import MPI

import cupy
from cupy_ep import Buffer, Config
from cupy_ep import config as ep_config
from cupy_ep.interop import BF16

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
T, H, K, E = 4096, 7168, 8, 256
M = 128  # low-latency tokens per rank (a decode batch)


def time_calls(calls: dict) -> None:
    """Per call: 30 host times, each from a synchronized start (device idle, ranks lined up by a barrier)."""
    for name, fn in calls.items():
        times = []
        for _ in range(30):
            cupy.cuda.runtime.deviceSynchronize()
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        cupy.cuda.runtime.deviceSynchronize()
        if rank == 0:
            print(f"host time per call, {name}: median {np.median(times):.1f} us, min {np.min(times):.1f} us")


buf = Buffer(comm, num_nvl_bytes=Config(24, 6, 256).get_nvl_buffer_size_hint(2 * H, R), check_values=False)
rng = np.random.default_rng(rank)
with cupy.cuda.Device(buf.device_id):
    x = cupy.asarray(rng.standard_normal((T, H), dtype=np.float32).astype(BF16).view(np.uint16)).view(BF16)
    idx = cupy.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64))
    w = cupy.ones((T, K), dtype=cupy.float32)
    cfg = Config(24, 32, 256)
    layout = buf.get_dispatch_layout(idx, E)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                              num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w, config=cfg)
    calls = {"get_dispatch_layout": lambda: buf.get_dispatch_layout(idx, E),
             "cached dispatch": lambda: buf.dispatch(x, handle=handle, config=cfg),
             "combine": lambda: buf.combine(recv_x, handle, config=cfg)}
    time_calls(calls)
    prof = cProfile.Profile()
    for _ in range(20):
        cupy.cuda.runtime.deviceSynchronize()
        comm.Barrier()
        prof.enable()
        calls["cached dispatch"]()
        prof.disable()
    cupy.cuda.runtime.deviceSynchronize()
    # the low-latency pair, check_values=False as in a decode loop
    ll = Buffer(comm, 0, ep_config.low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True,
                low_latency_transport="ipc", check_values=False)
    ll_x, ll_idx, ll_w = x[:M], idx[:M], cupy.ones((M, K), dtype=cupy.float32)
    _, _, ll_handle, _, _ = ll.low_latency_dispatch(ll_x, ll_idx, M, E, use_fp8=True)
    ll_y = cupy.zeros((E // R, R * M, H), dtype=cupy.uint16).view(BF16)
    ll.low_latency_combine(ll_y, ll_idx, ll_w, ll_handle)
    time_calls({"low_latency_dispatch": lambda: ll.low_latency_dispatch(ll_x, ll_idx, M, E, use_fp8=True),
                "low_latency_combine": lambda: ll.low_latency_combine(ll_y, ll_idx, ll_w, ll_handle)})
    cupy.cuda.runtime.deviceSynchronize()
if rank == 0:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    text = s.getvalue()
    print(text[:3000])
    if len(sys.argv) > 1:
        open(f"{sys.argv[1]}/host_profile.txt", "w").write(text)
comm.Barrier()
ll.destroy()
buf.destroy()
