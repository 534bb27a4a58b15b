"""Zero-copy dispatch, own rows by bulk copies (session 12): how many of G blocks should copy the own rows (L)?
Cached BF16 dispatch, 4096 x 7168, top-8 of 256, steady (GpuTimer.steady, n = 10), each variant first checked bit for
bit against the ring dispatch. Config.zero_copy_local_blocks is replaced by the variant's L (the knob).
    mpirun -n 2 python benchmarks/experiments/s12/exp_local_split.py 24:4,24:6,24:8"""
import dataclasses
import sys

import numpy as np
from mpi4py import MPI

import cupy
import cupy_ep
from cupy_ep import Buffer, Config
from cupy_ep.bench import GpuTimer, make_inputs

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
T, H, K, E = 4096, 7168, 8, 256
variants = [(int(g), int(l)) for g, l in (v.split(":") for v in sys.argv[1].split(","))]
buf = Buffer(comm, num_nvl_bytes=Buffer.get_zero_copy_nvl_size_hint(T, 2 * H, R, K), check_values=False)
timer = GpuTimer(comm, 30, 3)
with cupy.cuda.Device(buf.device_id):
    x_np, _, idx_np, w_np = make_inputs(rank, R, T, H, K, E, 0.0)
    x = cupy.asarray(x_np.view(np.uint16)).view(cupy_ep.interop.BF16)
    idx, w = cupy.asarray(idx_np), cupy.asarray(w_np)
    layout = buf.get_dispatch_layout(idx, E)
    for sms, local in variants:
        Config.zero_copy_local_blocks = lambda self, num_ranks, n=local: n
        cfg = dataclasses.replace(Buffer.get_dispatch_config(R, 2 * H), num_sms=sms)
        ring_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                  num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w,
                                                  config=cfg)
        ring = ring_x.view(cupy.uint16).get()
        z = buf.dispatch(x, handle=handle, config=cfg, zero_copy=True)[0].view(cupy.uint16).get()
        ok = all(comm.allgather(bool(np.array_equal(ring, z))))
        t = timer.steady(lambda: buf.dispatch(x, handle=handle, config=cfg, zero_copy=True), 10)
        if rank == 0:
            print(f"sms={sms:2d} local_blocks={local:2d}  steady {t.median_us:7.1f} us (min {t.min_us:7.1f})  "
                  f"matches ring: {ok}", flush=True)
buf.destroy()
