"""Zero-copy block splits (session 12): dispatch G:L (G blocks, the last L copy the own rows) and combine G:S (the
first S of G blocks store, the rest reduce). Cached BF16 dispatch / BF16 combine with weights, 4096 x 7168, top-8
of 256, steady (GpuTimer.steady, n = 10); every variant first checked bit for bit against the ring path.
Config.zero_copy_local_blocks / zero_copy_combine_senders are replaced by the variant's numbers (the knobs).
    mpirun -n 2 python exp_split2.py TAG "16:8,24:8" "24:9,24:6"   (dispatch variants, combine variants)"""
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
tag = sys.argv[1]
parse = lambda arg: [(int(g), int(n)) for g, n in (v.split(":") for v in arg.split(",") if v)]
dispatch_variants, combine_variants = parse(sys.argv[2]), parse(sys.argv[3] if len(sys.argv) > 3 else "")
buf = Buffer(comm, num_nvl_bytes=Buffer.get_zero_copy_nvl_size_hint(T, 2 * H, R, K), check_values=False)
timer = GpuTimer(comm, 30, 3)


def same(a, b):
    return all(comm.allgather(bool(np.array_equal(a.view(cupy.uint16).get(), b.view(cupy.uint16).get()))))


with cupy.cuda.Device(buf.device_id):
    x_np, _, idx_np, w_np = make_inputs(rank, R, T, H, K, E, 0.0)
    x = cupy.asarray(x_np.view(np.uint16)).view(cupy_ep.interop.BF16)
    idx, w = cupy.asarray(idx_np), cupy.asarray(w_np)
    layout = buf.get_dispatch_layout(idx, E)
    base = Buffer.get_dispatch_config(R, 2 * H)
    ring_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                   num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w,
                                                   config=base)
    y = ring_x.copy()
    ring_c = buf.combine(y, handle, topk_weights=recv_w)[0]
    for sms, local in dispatch_variants:
        Config.zero_copy_local_blocks = lambda self, num_ranks, n=local: n
        cfg = dataclasses.replace(base, num_sms=sms)
        rx, _, _, _, h, _ = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                         num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w, config=cfg)
        ok = same(rx, buf.dispatch(x, handle=h, config=cfg, zero_copy=True)[0])  # a handle is for its dispatch's SMs
        t = timer.steady(lambda: buf.dispatch(x, handle=h, config=cfg, zero_copy=True), 10)
        if rank == 0:
            print(f"[{tag}] dispatch sms={sms:2d} local_blocks={local:2d}  steady {t.median_us:7.1f} us "
                  f"(min {t.min_us:7.1f})  matches ring: {ok}", flush=True)
    for sms, senders in combine_variants:
        Config.zero_copy_combine_senders = lambda self, num_ranks, n=senders: n
        cfg = dataclasses.replace(Buffer.get_combine_config(R, 2 * H), num_sms=sms)
        ok = same(ring_c, buf.combine(y, handle, topk_weights=recv_w, config=cfg, zero_copy=True)[0])
        t = timer.steady(lambda: buf.combine(y, handle, topk_weights=recv_w, config=cfg, zero_copy=True), 10)
        if rank == 0:
            print(f"[{tag}] combine  sms={sms:2d} senders={senders:2d}  steady {t.median_us:7.1f} us "
                  f"(min {t.min_us:7.1f})  matches ring: {ok}", flush=True)
buf.destroy()
