"""Zero-copy combine: rows per flag (config.DIRECT_COMBINE_ROWS_PER_FLAG, the knob) at 24 SMs, 9 store blocks; BF16
combine with weights, 4096 x 7168, top-8 of 256, steady (GpuTimer.steady, n = 10), each checked against the ring.
    mpirun -n 2 python exp_flags.py TAG 1,2,4,8"""
import sys

import numpy as np
from mpi4py import MPI

import cupy
import cupy_ep
from cupy_ep import Buffer, config as cfgmod
from cupy_ep.bench import GpuTimer, make_inputs

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
T, H, K, E = 4096, 7168, 8, 256
tag, values = sys.argv[1], [int(v) for v in sys.argv[2].split(",")]
buf = Buffer(comm, num_nvl_bytes=Buffer.get_zero_copy_nvl_size_hint(T, 2 * H, R, K), check_values=False)
timer = GpuTimer(comm, 30, 3)
with cupy.cuda.Device(buf.device_id):
    x_np, _, idx_np, w_np = make_inputs(rank, R, T, H, K, E, 0.0)
    x = cupy.asarray(x_np.view(np.uint16)).view(cupy_ep.interop.BF16)
    idx, w = cupy.asarray(idx_np), cupy.asarray(w_np)
    layout = buf.get_dispatch_layout(idx, E)
    ring_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                   num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w)
    y = ring_x.copy()
    ring = buf.combine(y, handle, topk_weights=recv_w)[0].view(cupy.uint16).get()
    for v in values:
        cfgmod.DIRECT_COMBINE_ROWS_PER_FLAG = v
        z = buf.combine(y, handle, topk_weights=recv_w, zero_copy=True)[0].view(cupy.uint16).get()
        ok = all(comm.allgather(bool(np.array_equal(ring, z))))
        t = timer.steady(lambda: buf.combine(y, handle, topk_weights=recv_w, zero_copy=True), 10)
        if rank == 0:
            print(f"[{tag}] combine zero-copy 24 SMs rows_per_flag={v:2d}  steady {t.median_us:7.1f} us "
                  f"(min {t.min_us:7.1f})  matches ring: {ok}", flush=True)
buf.destroy()
