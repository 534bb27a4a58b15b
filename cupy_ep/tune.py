"""``python -m cupy_ep.tune``: sweep SM counts and ring/chunk sizes of dispatch and combine on this machine,
and write the best configs where ``Buffer`` finds them by default (``config.tuned_config_path()``).

Run under mpirun with one rank per GPU (``scripts/bench.sh`` style). Every candidate is timed as CUDA-graph
replays of a cached dispatch / a combine (device time), on the benchmark's default workload. For each
operation the chosen entry is the fastest config with at most ``--max-sms`` SMs; the whole sweep is kept in
the JSON under ``"sweep"`` for reference. Explicit ``Config`` arguments always override tuned ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

from . import config as cfgmod
from .bench import GpuTimer, make_inputs


def main(argv=None):
    from mpi4py import MPI
    import cupy
    from tqdm import tqdm
    from . import Buffer, Config
    from .interop import BF16

    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    p = argparse.ArgumentParser(prog="python -m cupy_ep.tune", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--sms", type=ints, default=list(range(8, 49, 8)))
    p.add_argument("--max-sms", type=int, default=24, help="the chosen config uses at most this many SMs")
    p.add_argument("--dispatch-chunks", type=ints, default=[8, 16, 24, 32, 48])
    p.add_argument("--combine-chunks", type=ints, default=[12, 24, 48, 72, 96])
    p.add_argument("--slots", type=ints, default=[256, 512])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None, help="JSON to write (default: config.tuned_config_path())")
    args = p.parse_args(argv)

    comm = MPI.COMM_WORLD
    rank, R = comm.Get_rank(), comm.Get_size()
    hidden_bytes = 2 * args.hidden
    max_slots = max(args.slots)
    nvl = Config(max(args.sms), 8, max_slots).get_nvl_buffer_size_hint(hidden_bytes, R)
    buf = Buffer(comm, num_nvl_bytes=nvl, check_values=False)
    x_np, _, idx_np, w_np = make_inputs(rank, R, args.tokens, args.hidden, args.topk, args.experts, 0.0)
    results = {"dispatch": [], "combine": []}
    with cupy.cuda.Device(buf.device_id):
        x = cupy.asarray(x_np.view(np.uint16)).view(BF16)
        idx, w = cupy.asarray(idx_np), cupy.asarray(w_np)
        layout = buf.get_dispatch_layout(idx, args.experts)
        timer = GpuTimer(comm, args.iters, 3)
        candidates = [(s, c, q) for s in args.sms for q in args.slots
                      for c in sorted(set(args.dispatch_chunks + args.combine_chunks)) if c < q]
        bar = tqdm(candidates, disable=rank != 0, desc="tuning", unit="config")
        for sms, chunk, slots in bar:
            cfg = Config(sms, chunk, slots)
            recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                      num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w,
                                                      config=cfg)
            if chunk in args.dispatch_chunks:
                t = timer.graph(lambda: buf.dispatch(x, handle=handle, config=cfg))
                results["dispatch"].append(dict(dataclasses.asdict(cfg), time_us=t.median_us))
            batch = (24 // R) * R * 2  # combine receiver batch (cuda_backend._COMBINE_TOKENS_PER_WARP)
            if chunk in args.combine_chunks and slots - chunk >= batch:
                t = timer.graph(lambda: buf.combine(recv_x, handle, config=cfg))
                results["combine"].append(dict(dataclasses.asdict(cfg), time_us=t.median_us))
            bar.set_postfix(sms=sms, chunk=chunk, slots=slots)
    buf.destroy()
    if rank != 0:
        return
    path = args.out or str(cfgmod.tuned_config_path())
    try:
        doc = json.loads(open(path).read())
    except (OSError, ValueError):
        doc = {}
    for kind, rows in results.items():
        allowed = [r for r in rows if r["num_sms"] <= args.max_sms] or rows
        best = min(allowed, key=lambda r: r["time_us"])
        key = f"{kind}/{R}/{hidden_bytes}"
        doc[key] = {k: v for k, v in best.items() if k != "time_us"}
        doc.setdefault("sweep", {})[key] = rows
        print(f"{key}: best {best['time_us']:.1f} us with {doc[key]}")
        for s in sorted({r["num_sms"] for r in rows}):
            b = min((r for r in rows if r["num_sms"] == s), key=lambda r: r["time_us"])
            print(f"  {s:3d} SMs: {b['time_us']:8.1f} us  chunk {b['num_max_nvl_chunked_send_tokens']:3d}"
                  f"  slots {b['num_max_nvl_chunked_recv_tokens']}")
    doc["meta"] = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "tokens": args.tokens, "hidden": args.hidden,
                   "topk": args.topk, "experts": args.experts, "num_ranks": R}
    import os
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"cupy_ep.tune: wrote {path}")


if __name__ == "__main__":
    main()
