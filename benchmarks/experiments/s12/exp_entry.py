"""Zero-copy ops with and without a notify kernel before them (session 12): run once per source tree, e.g.
    PYTHONPATH=<old tree> mpirun -n 2 python exp_entry.py old
    PYTHONPATH=$PWD       mpirun -n 2 python exp_entry.py new
Cached zero-copy BF16 dispatch at 16 / 24 / 32 SMs and a token sweep at 24 SMs, zero-copy combine at 24 SMs,
steady timing (cupy_ep.bench.GpuTimer.steady, n = 10, L2 flushed before each op), every output first checked
bit for bit against the ring path's."""
import dataclasses
import sys

import numpy as np
from mpi4py import MPI

import cupy
import cupy_ep
from cupy_ep import Buffer
from cupy_ep.bench import GpuTimer, make_inputs

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
tag = sys.argv[1] if len(sys.argv) > 1 else "?"
H, K, E = 7168, 8, 256
buf = Buffer(comm, num_nvl_bytes=Buffer.get_zero_copy_nvl_size_hint(8192, 2 * H, R, K), check_values=False)
timer = GpuTimer(comm, 30, 3)


def log(msg):
    if rank == 0:
        print(f"[{tag}] {msg}", flush=True)


def same(a, b):
    return all(comm.allgather(bool(np.array_equal(a.view(cupy.uint16).get(), b.view(cupy.uint16).get()))))


with cupy.cuda.Device(buf.device_id):
    for T, sms_list in ((4096, (16, 24, 32)), (512, (24,)), (1024, (24,)), (2048, (24,)), (8192, (24,))):
        x_np, _, idx_np, w_np = make_inputs(rank, R, T, H, K, E, 0.0)
        x = cupy.asarray(x_np.view(np.uint16)).view(cupy_ep.interop.BF16)
        idx, w = cupy.asarray(idx_np), cupy.asarray(w_np)
        layout = buf.get_dispatch_layout(idx, E)
        for sms in sms_list:
            cfg = dataclasses.replace(Buffer.get_dispatch_config(R, 2 * H), num_sms=sms)
            ring_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                           num_tokens_per_expert=layout[2], topk_idx=idx,
                                                           topk_weights=w, config=cfg)
            ok = same(ring_x, buf.dispatch(x, handle=handle, config=cfg, zero_copy=True)[0])
            t = timer.steady(lambda: buf.dispatch(x, handle=handle, config=cfg, zero_copy=True), 10)
            log(f"dispatch zero-copy cached T={T:5d} sms={sms:2d}: steady {t.median_us:7.1f} us (min {t.min_us:7.1f}) "
                f"matches ring: {ok}")
            if T == 4096 and sms == 24:
                tg = timer.graph(lambda: buf.dispatch(x, handle=handle, config=cfg, zero_copy=True))
                log(f"dispatch zero-copy cached T={T:5d} sms={sms:2d}: graph {tg.median_us:7.1f} us")
            if T in (512, 4096) and sms == 24:
                ccfg = dataclasses.replace(Buffer.get_combine_config(R, 2 * H), num_sms=sms)
                y = ring_x.copy()
                ring_c = buf.combine(y, handle, topk_weights=recv_w, config=ccfg)[0]
                ok = same(ring_c, buf.combine(y, handle, topk_weights=recv_w, config=ccfg, zero_copy=True)[0])
                t = timer.steady(lambda: buf.combine(y, handle, topk_weights=recv_w, config=ccfg, zero_copy=True), 10)
                log(f"combine  zero-copy        T={T:5d} sms={sms:2d}: steady {t.median_us:7.1f} us "
                    f"(min {t.min_us:7.1f}) matches ring: {ok}")
buf.destroy()
