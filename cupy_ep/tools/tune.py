"""``python -m cupy_ep.tune``: sweep SM counts and ring/chunk sizes of dispatch and combine on this machine,
and write the best configs where ``Buffer`` finds them by default (``config.tuned_config_path()``).

Run under mpirun or torchrun with one rank per GPU (``scripts/bench.sh`` style). Every candidate is timed as
CUDA-graph replays of a cached dispatch / a combine (device time), on the benchmark's default workload. For each
operation the chosen entry is the fastest config with at most ``--max-sms`` SMs; the whole sweep is kept in
the JSON under ``"sweep"`` for reference. Explicit ``Config`` arguments always override tuned ones.
"""
from __future__ import annotations

import dataclasses
import json
import time


from .. import config as cfgmod
from .cli import CliParser, fail_once, int_list, positive_int, sm_count


def build_parser(rank: int | None = None) -> CliParser:
    """The tuner's options (``python -m cupy_ep.tune --help``)."""
    p = CliParser(prog="python -m cupy_ep.tune", rank=rank, description=(
        "Sweep SM counts and ring/chunk sizes of dispatch and combine on this machine (GPU only; start it under "
        "mpirun or torchrun, one rank per GPU) and write the fastest configs where Buffer finds them by default. "
        "Each candidate is timed as CUDA-graph replays on the benchmark's default workload."))
    p.add_argument("--tokens", type=positive_int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=positive_int, default=7168,
                   help="hidden size, bf16 values per token (a multiple of 16)")
    p.add_argument("--topk", type=positive_int, default=8, help="experts per token (at most --experts)")
    p.add_argument("--experts", type=positive_int, default=256, help="experts in all (a multiple of the rank count)")
    p.add_argument("--sms", type=int_list(sm_count, allow_empty=False), default="8,16,24,32,40,48",
                   help="comma-separated SM counts to sweep (even, >= 4)")
    p.add_argument("--max-sms", type=sm_count, default=24,
                   help="the chosen config uses at most this many SMs (the fastest overall if none of the swept fit)")
    p.add_argument("--dispatch-chunks", type=int_list(allow_empty=False), default="8,16,24,32,48",
                   help="comma-separated dispatch chunk sizes (num_max_nvl_chunked_send_tokens) to sweep")
    p.add_argument("--combine-chunks", type=int_list(allow_empty=False), default="12,24,48,72,96",
                   help="comma-separated combine chunk sizes to sweep")
    p.add_argument("--slots", type=int_list(allow_empty=False), default="256,512",
                   help="comma-separated ring sizes in tokens (num_max_nvl_chunked_recv_tokens) to sweep; a chunk "
                        "must be smaller than its ring")
    p.add_argument("--iters", type=positive_int, default=20, help="timed graph replays per candidate")
    p.add_argument("--out", default=None,
                   help="JSON to write (default: config.tuned_config_path(): env CUPY_EP_TUNED_CONFIG, else "
                        "cupy_ep/tuned_configs.json under $XDG_CACHE_HOME or ~/.cache)")
    return p


def parse_args(argv=None, rank: int | None = None):
    """The tuner's arguments; argparse only, so that --help and bad values end before MPI starts (printed by rank 0
    only)."""
    p = build_parser(rank)
    args = p.parse_args(argv)
    if args.hidden % 16:
        p.error(f"argument --hidden: must be a multiple of 16, got {args.hidden}")
    if args.topk > min(args.experts, cfgmod.MAX_TOPK):
        p.error(f"argument --topk: must be at most --experts {args.experts} and {cfgmod.MAX_TOPK}, got {args.topk}")
    if not any(c < q for q in args.slots for c in args.dispatch_chunks + args.combine_chunks):
        p.error(f"argument --slots: no chunk size is below a ring size {args.slots}: nothing to sweep")
    return args


def main(argv=None):
    """``python -m cupy_ep.tune``."""
    args = parse_args(argv)
    from ..mpi_start import start_world
    comm = start_world().comm  # MPI.COMM_WORLD, or torch.distributed's default group under torchrun
    from ..buffer import gpu_available
    problem = None
    if not gpu_available():
        problem = "cupy_ep.tune times the GPU kernels, and this rank sees no GPU"
    elif args.experts % comm.Get_size():
        problem = f"argument --experts: must be a multiple of the rank count {comm.Get_size()}, got {args.experts}"
    fail_once(comm, build_parser(), problem)  # one error, printed once, before any buffer
    import cupy

    from .. import Buffer, Config
    from .harness import GpuTimer, make_inputs, progress, to_device
    rank, R = comm.Get_rank(), comm.Get_size()
    hidden_bytes = 2 * args.hidden
    max_slots = max(args.slots)
    nvl = Config(max(args.sms), 8, max_slots).get_nvl_buffer_size_hint(hidden_bytes, R)
    buf = Buffer(comm, num_nvl_bytes=nvl, check_values=False)
    x_np, _, idx_np, w_np = make_inputs(rank, R, args.tokens, args.hidden, args.topk, args.experts, 0.0)
    results = {"dispatch": [], "combine": []}
    with cupy.cuda.Device(buf.device_id):
        x, idx, w = to_device(x_np), to_device(idx_np), to_device(w_np)
        layout = buf.get_dispatch_layout(idx, args.experts)
        timer = GpuTimer(comm, args.iters, 3)
        candidates = [(s, c, q) for s in args.sms for q in args.slots
                      for c in sorted(set(args.dispatch_chunks + args.combine_chunks)) if c < q]
        bar = progress(candidates, rank, "tuning", unit="config")
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
            if hasattr(bar, "set_postfix"):
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


