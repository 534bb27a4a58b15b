"""Per-kernel device times of the internode path: CUDA events around every internode launch, on every rank.

    mpirun -n 2 python scripts/probe_internode.py          # 2 nodes x 1 GPU; SMS=8 for 8 SMs
    CUPY_EP_INTERNODE_TRANSPORT=ipc mpirun -n 4 python scripts/probe_internode.py   # 2 x 2

For each token count it runs a dispatch, a cached dispatch, a combine and a barrier, and prints per rank every
kernel's device time and when (host us after the start) it was launched. A kernel that waits for its peer
shows the peer's lateness; times that alternate between the ranks mean the ranks are not running at once
(both processes of a 2 x 1 job on GPU 0 show this way: every barrier kernel takes ~4.4 ms).
"""
import os
import time

import numpy as np
from mpi4py import MPI

import cupy
import cupy_ep
from cupy_ep import config as cfgmod
from cupy_ep.tools.harness import make_routing


def main():
    comm = MPI.COMM_WORLD
    rank, R = comm.Get_rank(), comm.Get_size()
    H, K, E = 7168, 8, 256
    sms = int(os.environ.get("SMS", "24"))
    G = max(1, R // 2)
    dcfg, ccfg = cfgmod.get_dispatch_config(R, sms, 2 * H), cfgmod.get_combine_config(R, sms, 2 * H)
    sizes = [cfgmod.internode_buffer_bytes(R // G, G, 2 * H, c, K) for c in (dcfg, ccfg)]
    buf = cupy_ep.Buffer(comm, num_nvl_bytes=max(s[0] for s in sizes), num_rdma_bytes=max(s[1] for s in sizes),
                         num_ranks_per_node=G, check_values=False, backend="cuda")
    state, log, start = buf.impl._internode, [], [0.0]
    launch = state.launch

    def timed_launch(name, grid, block, args):
        stream, before, after = buf.comm_stream, cupy.cuda.Event(), cupy.cuda.Event()
        host_us = (time.perf_counter() - start[0]) * 1e6
        before.record(stream)
        launch(name, grid, block, args)
        after.record(stream)
        log.append((name.split("<")[0].split("::")[-1], before, after, host_us))

    state.launch = timed_launch
    with cupy.cuda.Device(buf.device_id):
        for T in (64, 512, 4096):
            rng = np.random.default_rng(rank + T)
            x = cupy.asarray(rng.integers(0, 1 << 14, size=(T, H)).astype(np.uint16)).view(cupy_ep.interop.BF16)
            idx = cupy.asarray(make_routing(rng, T, K, E, R, 0.0))
            w = cupy.asarray(rng.random((T, K), dtype=np.float32))
            lay = buf.get_dispatch_layout(idx, E)
            kw = dict(num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1], is_token_in_rank=lay[3],
                      num_tokens_per_expert=lay[2], topk_idx=idx, topk_weights=w, config=dcfg)
            for _ in range(3):  # the last round is printed (the first ones compile and warm up)
                log.clear()
                comm.Barrier()
                start[0] = time.perf_counter()
                recv, _, _, _, handle, _ = buf.dispatch(x, **kw)
                buf.dispatch(x, handle=handle, config=dcfg)
                buf.combine(recv, handle, config=ccfg)
                state.barrier()
                cupy.cuda.runtime.deviceSynchronize()
            line = f"rank {rank} T={T} sms={sms}: " + ", ".join(
                f"{n} {cupy.cuda.get_elapsed_time(a, b) * 1e3:.0f}us@host+{h:.0f}" for n, a, b, h in log)
            lines = comm.gather(line)
            if rank == 0:
                print("\n".join(lines), flush=True)
    buf.destroy()


if __name__ == "__main__":
    main()
