"""Zero-copy combine: how many of the num_sms blocks store rows into the owners' buffers (the rest reduce),
BF16 4096 x 7168, top-8 of 256, steady timing (cupy_ep.bench.GpuTimer.steady, n = 10), each variant checked
bit for bit against the ring combine's output first. The split comes from Config.zero_copy_combine_senders and
the rows per flag from config.DIRECT_COMBINE_ROWS_PER_FLAG, which this script replaces (the experiment's knobs).
    mpirun -n 2 python benchmarks/experiments/zero_copy_s11/exp_direct_combine.py [sms:senders[:rows_per_flag],...]"""
import dataclasses
import sys

import numpy as np
from mpi4py import MPI

import cupy
import cupy_ep
from cupy_ep import Buffer, Config, config as cfgmod
from cupy_ep.bench import GpuTimer, make_inputs

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
T, H, K, E = 4096, 7168, 8, 256
variants = [tuple(int(p) for p in v.split(":")) + (8,) for v in (sys.argv[1] if len(sys.argv) > 1 else
            "8:2,8:3,16:4,16:6,24:6,24:8,24:10,32:8,32:12").split(",")]
nvl = cfgmod.NOTIFY_BYTES + cfgmod.direct_combine_bytes(R, T, 2 * H, K) + (64 << 20)
buf = Buffer(comm, num_nvl_bytes=cfgmod.align_up(max(nvl, Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(2 * H, R))),
             check_values=False)
timer = GpuTimer(comm, 30, 3)
with cupy.cuda.Device(buf.device_id):
    x_np, _, idx_np, w_np = make_inputs(rank, R, T, H, K, E, 0.0)
    x = cupy.asarray(x_np.view(np.uint16)).view(cupy_ep.interop.BF16)
    idx, w = cupy.asarray(idx_np), cupy.asarray(w_np)
    layout = buf.get_dispatch_layout(idx, E)
    dcfg = dataclasses.replace(Buffer.get_dispatch_config(R, 2 * H), num_sms=24)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                              num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w,
                                              config=dcfg)
    ccfg = dataclasses.replace(Buffer.get_combine_config(R, 2 * H), num_sms=24)
    ring = buf.combine(recv_x, handle, config=ccfg)[0].view(cupy.uint16).get()
    t = timer.steady(lambda: buf.combine(recv_x, handle, config=ccfg), 10)
    if rank == 0:
        print(f"ring combine, 24 SMs: steady {t.median_us:7.1f} us", flush=True)
    for sms, senders, rows_per_flag, *_ in variants:
        Config.zero_copy_combine_senders = lambda self, num_ranks, n=senders: n
        cfgmod.DIRECT_COMBINE_ROWS_PER_FLAG = rows_per_flag
        cfg = dataclasses.replace(ccfg, num_sms=sms)
        z = buf.combine(recv_x, handle, config=cfg, zero_copy=True)[0].view(cupy.uint16).get()
        ok = all(comm.allgather(bool(np.array_equal(ring, z))))
        t = timer.steady(lambda: buf.combine(recv_x, handle, config=cfg, zero_copy=True), 10)
        gbps = (T * 2 * H) * (1 - 0.5 ** K) / (t.median_us * 1e-6) / 1e9  # ~the rows that cross NVLink
        if rank == 0:
            print(f"sms={sms:2d} senders={senders:2d} rows_per_flag={rows_per_flag}  steady {t.median_us:7.1f} us (min {t.min_us:7.1f})  "
                  f"~{gbps:5.1f} GB/s  matches ring: {ok}", flush=True)
buf.destroy()
