"""Experiment (session 6): the intranode dispatch with own-row SMs. Which part bounds it, and which split of the
SMs into (channels C, own-row blocks O) is fastest? Kernel variants via the EP_EXP bits of exp_split.patch (1: ring
receivers skip their row copies, 2: own-row blocks skip theirs, 4: senders skip theirs) x splits, timed steady (10
cached dispatches back to back per graph, as the benchmark), BF16, the benchmark's default workload.
  git apply benchmarks/experiments/exp_split.patch        # for the EP_EXP bits; revert afterwards
  mpirun -n 2 python benchmarks/experiments/exp_split.py 0,1,2,4 8:8,9:6,10:4,7:10 [slots,...] [chunk,...]
A split C:O runs 2C + O SMs (O >= 1); ring slots default 256, send chunk 24.
Bit 8: senders skip the metadata stores (source index, top-k).
Results are NOT checked (the variants drop work on purpose); never commit the patch."""
import sys
import numpy as np
import cupy
from mpi4py import MPI
from cupy_ep import jit, Buffer, Config
from cupy_ep import config as cfgmod
from cupy_ep.bench import GpuTimer, make_inputs, measure_ceiling
from cupy_ep.interop import BF16

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
hidden, tokens, topk, experts = 7168, 4096, 8, 256
base = jit._OPTIONS
variants = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "0,1,2,4").split(",")]
splits = [tuple(int(p) for p in v.split(":")) for v in (sys.argv[2] if len(sys.argv) > 2 else "8:8").split(",")]
slots_list = [int(v) for v in (sys.argv[3] if len(sys.argv) > 3 else "256").split(",")]
chunk_list = [int(v) for v in (sys.argv[4] if len(sys.argv) > 4 else "24").split(",")]
x_np, _, idx_np, w_np = make_inputs(rank, R, tokens, hidden, topk, experts, 0.0)
split = [None]
cfgmod.Config.intranode_dispatch_split = lambda self, num_ranks: split[0]  # the experiment picks the split
for flags in variants:
    jit._OPTIONS = base + (f"-DEP_EXP={flags}",)
    jit._loaded.clear()
    max_sms = max(2 * c + o for c, o in splits)
    nvl = Config(max_sms, 8, max(slots_list)).get_nvl_buffer_size_hint(2 * hidden, R)
    buf = Buffer(comm, num_nvl_bytes=nvl, check_values=False)
    with cupy.cuda.Device(buf.device_id):
        x = cupy.asarray(x_np.view(np.uint16)).view(BF16)
        idx, w = cupy.asarray(idx_np), cupy.asarray(w_np)
        timer = GpuTimer(comm, 20, 3)
        if flags == variants[0]:
            g, st = measure_ceiling(buf, timer, tokens * hidden * 2, [4, 6, 8, 12, 16], steady_n=10)
            if rank == 0:
                print("ceiling GB/s steady", {k: round(v, 1) for k, v in st.items()}, flush=True)
        layout = buf.get_dispatch_layout(idx, experts)
        nvl_rows = int(cupy.asnumpy(layout[0])[1 - rank]) if R == 2 else 0
        for c, o in splits:
            for slots in slots_list:
                for chunk in chunk_list:
                    split[0] = (c, o)
                    cfg = Config(2 * c + o, chunk, slots)
                    recv_x, _, _, _, handle, _ = buf.dispatch(
                        x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                        num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w, config=cfg)
                    td = timer.steady(lambda: buf.dispatch(x, handle=handle, config=cfg), 10)
                    gb = nvl_rows * hidden * 2 / 1e3
                    if rank == 0:
                        print(f"EP_EXP={flags} C={c:2d} O={o:2d} sms={2 * c + o:2d} slots={slots:4d} chunk={chunk:3d} "
                              f"dispatch {td.median_us:7.1f} us {gb / td.median_us:6.1f} GB/s", flush=True)
    buf.destroy()
