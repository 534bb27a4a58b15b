"""Experiment: which side bounds the intranode dispatch/combine? Kernel variants (-D<MACRO>=<v>; with the default
EP_EXP the bits of exp_intranode.patch: 1 receiver skips ring copies, 2 skips own rows, 4 sender skips its copy,
8 combine receiver skips the reduction, 16 combine sender skips its copy) x SMs, timed steady (10 ops back to back per graph, as the benchmark).
  git apply benchmarks/experiments/exp_intranode.patch   # for the EP_EXP bits; revert afterwards
  mpirun -n 2 python benchmarks/experiments/exp_intranode.py 0,1,3,4,8,16 [MACRO] [8,16,24,32]
Results are NOT checked (the variants drop work on purpose); never commit the patch."""
import sys, time
import numpy as np
import cupy
from mpi4py import MPI
from cupy_ep import jit, Buffer, Config
from cupy_ep.bench import GpuTimer, make_inputs, measure_ceiling
from cupy_ep.interop import BF16

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
hidden, tokens, topk, experts = 7168, 4096, 8, 256
base = jit._OPTIONS
NAMES = {0: "baseline", 1: "recv: no ring copy", 3: "recv: no copies", 4: "send: no copy",
         8: "comb recv: no reduce", 16: "comb send: no copy"}
variants = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "0,1,3,4,8,16").split(",")]
MACRO = sys.argv[2] if len(sys.argv) > 2 else "EP_EXP"
sms_arg = sys.argv[3] if len(sys.argv) > 3 else "8,16,24,32"

sms_list = [int(v) for v in sms_arg.split(",")]
slots_list = [256]
x_np, _, idx_np, w_np = make_inputs(rank, R, tokens, hidden, topk, experts, 0.0)
for flags in variants:
    jit._OPTIONS = base + (f"-D{MACRO}={flags}",)
    jit._loaded.clear()
    nvl = Config(max(sms_list), 8, max(slots_list)).get_nvl_buffer_size_hint(2 * hidden, R)
    buf = Buffer(comm, num_nvl_bytes=nvl, check_values=False)
    with cupy.cuda.Device(buf.device_id):
        x = cupy.asarray(x_np.view(np.uint16)).view(BF16)
        idx, w = cupy.asarray(idx_np), cupy.asarray(w_np)
        timer = GpuTimer(comm, 20, 3)
        if flags == 0:
            g, st = measure_ceiling(buf, timer, tokens * hidden * 2, [4, 6, 8, 12, 16], steady_n=10)
            if rank == 0:
                print("ceiling GB/s graph", {k: round(v, 1) for k, v in g.items()}, "steady",
                      {k: round(v, 1) for k, v in st.items()}, flush=True)
        layout = buf.get_dispatch_layout(idx, experts)
        for sms in sms_list:
            for slots in slots_list:
                for chunk in (24,):
                    cfg = Config(sms, chunk, slots)
                    ccfg = Config(sms, 48, slots)
                    recv_x, _, _, _, handle, _ = buf.dispatch(
                        x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                        num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w, config=cfg)
                    nvl_rows = int(cupy.asnumpy(layout[0])[1 - rank]) if R == 2 else 0
                    td = timer.steady(lambda: buf.dispatch(x, handle=handle, config=cfg), 10)
                    tc = timer.steady(lambda: buf.combine(recv_x, handle, config=ccfg), 10)
                    gb = nvl_rows * hidden * 2 / 1e3
                    if rank == 0:
                        print(f"{MACRO}={flags:2d} sms={sms:2d} slots={slots:4d} "
                              f"dispatch {td.median_us:7.1f} us {gb / td.median_us:6.1f} GB/s | "
                              f"combine {tc.median_us:7.1f} us {gb / tc.median_us:6.1f} GB/s", flush=True)
    buf.destroy()
