"""``python -m cupy_ep.soak``: many randomly shaped dispatch/cached dispatch/combine rounds, checked against
the reference.

Run under mpirun or torchrun (any backend). Every iteration draws its shape (tokens, hidden, top-k, routing
skew, dtype) from a generator seeded identically on all ranks, and its data from a per-rank generator, so any
iteration can be replayed alone with ``--start``. Each iteration's outputs are checksummed; every ``--check-every``-th
iteration and a random tenth of the others are compared bit for bit with ``cupy_ep.reference``. The first
mismatch stops all ranks with a non-zero exit and the seed/iteration to replay.

``--zero-copy`` makes every dispatch and combine zero-copy (the rows stay in the buffer: each iteration copies
recv_x out before the next call overwrites it, as a user would). ``--mode low-latency`` runs the low-latency
dispatch/combine soak instead (:mod:`cupy_ep.tools.soak_ll`).
"""
from __future__ import annotations

import zlib

import numpy as np

from .. import Buffer, Config, reference
from ..bootstrap import allreduce
from .cli import CliParser, fail_once, non_negative_int, positive_int, sm_count
from .harness import make_routing, progress, to_device, to_host


def iteration_shape(seed: int, it: int, max_tokens: int, num_ranks: int) -> dict:
    rng = np.random.default_rng([seed, it])
    epr = int(rng.choice([1, 4, 16, 32]))
    experts = epr * num_ranks
    return dict(tokens=int(rng.integers(0, max_tokens + 1)), hidden=int(rng.choice([128, 512, 2048, 4096, 7168])),
                topk=int(rng.integers(1, min(8, experts) + 1)), experts=experts,
                skew=float(rng.choice([0.0, 0.0, 0.5, 1.0])), fp8=bool(rng.random() < 0.3),
                check=bool(rng.random() < 0.1))


def checksum(*arrays) -> int:
    crc = 0
    for a in arrays:
        if a is not None:
            crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8).tobytes(), crc)
    return crc


DEFAULT_MAX_TOKENS = 1024  # normal mode's tokens per rank at most


def build_parser(rank: int | None = None) -> CliParser:
    """The soak's options (``python -m cupy_ep.soak --help``)."""
    from . import soak_ll
    p = CliParser(prog="python -m cupy_ep.soak", rank=rank, description=(
        "Many randomly shaped dispatch / cached dispatch / combine rounds (or low-latency ones), checked against "
        "cupy_ep.reference; start it under mpirun or torchrun, on any backend. The first mismatch stops every rank "
        "with exit status 1 and the command that replays it."))
    p.add_argument("--mode", choices=["normal", "low-latency"], default="normal",
                   help="normal: intranode dispatch/combine; low-latency: the low-latency kernels "
                        "(cupy_ep/tools/soak_ll.py)")
    p.add_argument("--iters", type=positive_int, default=10000, help="iterations to run")
    p.add_argument("--start", type=non_negative_int, default=0,
                   help="first iteration (replay one: --start N --iters 1 with the same --seed)")
    p.add_argument("--seed", type=non_negative_int, default=2026, help="seed of every iteration's shape and data")
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help=f"tokens per rank at most (default: {DEFAULT_MAX_TOKENS}; {soak_ll.DEFAULT_MAX_TOKENS} in "
                        "--mode low-latency, where it is the buffer's M)")
    p.add_argument("--check-every", type=positive_int, default=50,
                   help="compare every N-th iteration with the reference (and a random tenth of the others)")
    p.add_argument("--num-sms", type=sm_count, default=12, help="normal mode: Config.num_sms (even, >= 4)")
    p.add_argument("--backend", choices=["cuda", "host"], default=None,
                   help="cuda: the GPU kernels; host: numpy + MPI (default: cuda when a GPU is visible, else host)")
    p.add_argument("--zero-copy", action="store_true", help="normal mode: zero-copy dispatch and combine")
    soak_ll.add_arguments(p)
    return p


def parse_args(argv=None, rank: int | None = None):
    """The soak's arguments; argparse only, so that --help and bad values end before MPI starts (printed by rank 0
    only). ``--max-tokens`` gets its mode's default."""
    from . import soak_ll
    args = build_parser(rank).parse_args(argv)
    if args.max_tokens is None:
        args.max_tokens = soak_ll.DEFAULT_MAX_TOKENS if args.mode == "low-latency" else DEFAULT_MAX_TOKENS
    return args


def main(argv=None) -> int:
    """``python -m cupy_ep.soak``: returns the exit status (0: no mismatch, 1: a mismatch)."""
    from . import soak_ll
    args = parse_args(argv)
    from ..mpi_start import start_world
    comm = start_world().comm  # MPI.COMM_WORLD, or torch.distributed's default group under torchrun
    if args.backend == "cuda":
        from ..buffer import gpu_available
        fail_once(comm, build_parser(),
                  None if gpu_available() else "argument --backend: cuda, but this rank sees no GPU")
    if args.mode == "low-latency":
        return soak_ll.main(args, comm)
    rank, R = comm.Get_rank(), comm.Get_size()
    cfg = Config(args.num_sms, 8, 256)
    nvl = cfg.get_nvl_buffer_size_hint(7168 * 2, R)
    if args.zero_copy:
        nvl = max(nvl, Buffer.get_zero_copy_nvl_size_hint(args.max_tokens, 7168 * 2, R, 8))
    buf = Buffer(comm, num_nvl_bytes=nvl, backend=args.backend)
    zc = args.zero_copy
    gpu = buf.backend == "cuda"
    if gpu:
        import cupy
        from ..interop import BF16
        cupy.cuda.Device(buf.device_id).use()

    xp = cupy if gpu else np

    def dev(a):
        return to_device(a) if gpu else a

    def random_rows(gen, shape, kind):
        """Random payload made where it is used (device arrays on the GPU: no host generation or copy).
        bf16: finite values with exponents 2^-27..2^12 and both signs; fp8: any e4m3 byte (dispatch copies it)."""
        if kind == "bf16":
            sign = gen.randint(0, 2, size=shape, dtype=xp.int32) << 15
            bits = sign | (gen.randint(100, 140, size=shape, dtype=xp.int32) << 7) | gen.randint(0, 128, size=shape,
                                                                                                  dtype=xp.int32)
            return bits.astype(xp.uint16).view(BF16 if gpu else reference.bfloat16)
        return gen.randint(0, 256, size=shape, dtype=xp.int32).astype(xp.uint8)

    def digest(*arrays) -> int:
        """Position-sensitive 64-bit sum of 16-bit words, computed where the arrays live (one host sync)."""
        total = []
        for a in arrays:
            if a is None:
                continue
            words = xp.ascontiguousarray(a).reshape(-1).view(xp.uint8)
            if words.size % 2:
                words = xp.concatenate([words, xp.zeros(1, xp.uint8)])
            words = words.view(xp.uint16).astype(xp.uint64)
            weights = xp.arange(1, 2 * words.size, 2, dtype=xp.uint64)
            total.append(xp.sum(words * weights * xp.uint64(0x9E3779B1)))
        return int(xp.stack(total).sum()) if total else 0

    bar = progress(range(args.start, args.start + args.iters), rank, "soak")
    checked = 0
    for it in bar:
        shape = iteration_shape(args.seed, it, args.max_tokens, R)
        rng = np.random.default_rng([args.seed, it, rank])
        gen = xp.random.RandomState(int(rng.integers(1 << 31)))
        T, H, K, E = shape["tokens"], shape["hidden"], shape["topk"], shape["experts"]
        idx = make_routing(rng, T, K, E, R, shape["skew"])
        w = rng.random((T, K), dtype=np.float32)
        if shape["fp8"]:
            dx = (random_rows(gen, (T, H), "fp8"), dev(rng.random((T, -(-H // 128)), dtype=np.float32)))
        else:
            dx = random_rows(gen, (T, H), "bf16")
        layout = buf.get_dispatch_layout(dev(idx), E)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            dx, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
            topk_idx=dev(idx), topk_weights=dev(w), config=cfg, zero_copy=zc)
        data = recv_x[0] if shape["fp8"] else recv_x
        if zc:
            data = data.copy()  # a view of the buffer: the next call overwrites it
        cached = buf.dispatch(dx, handle=handle, config=cfg, zero_copy=zc)[0]  # must equal the rows bit for bit
        cached_digest = digest(cached[0] if shape["fp8"] else cached)
        dy = random_rows(gen, (int(data.shape[0]), H), "bf16")
        combined, combined_w, _ = buf.combine(dy, handle, topk_weights=recv_w, config=cfg, zero_copy=zc)
        outputs = [data, recv_x[1] if shape["fp8"] else None, recv_idx, recv_w, combined, combined_w]
        crc = digest(*outputs)
        if cached_digest != digest(data):
            print(f"[rank {rank}] cached dispatch differs from dispatch at iteration {it}", flush=True)
            shape["check"] = True  # the reference comparison below names the culprit; then stop
            cached_mismatch = True
        else:
            cached_mismatch = False
        if allreduce(comm, shape["check"] or it % args.check_every == 0, "lor"):
            checked += 1
            got = [to_host(a) for a in outputs]
            x = to_host(dx)
            everyone = comm.allgather((x, idx, w, to_host(dy)))
            ref = reference.dispatch([e[0][0] if shape["fp8"] else e[0] for e in everyone], [e[1] for e in everyone],
                                     [e[2] for e in everyone], E, rank, 1,
                                     [e[0][1] for e in everyone] if shape["fp8"] else None)
            in_rank_all = comm.allgather(ref.is_token_in_rank)
            recv_w_all = comm.allgather(ref.recv_topk_weights)
            ref_c, ref_cw = reference.combine([e[3] for e in everyone], in_rank_all, rank, recv_w_all)
            want = [ref.recv_x, ref.recv_x_scales, ref.recv_topk_idx, ref.recv_topk_weights, ref_c, ref_cw]
            bad = [name for name, g, r in zip(("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights",
                                                "combined_x", "combined_topk_weights"), got, want)
                   if (g is None) != (r is None) or (g is not None and checksum(g) != checksum(r))]
            if counts != ref.num_recv_tokens_per_expert_list:
                bad.append("num_recv_tokens_per_expert_list")
            if cached_mismatch:
                bad.append("cached dispatch")
            bad_all = comm.allgather(bad)
            if any(bad_all):
                if rank == 0:
                    print(f"\nMISMATCH at iteration {it} (seed {args.seed}, shape {shape}): {bad_all}\n"
                          f"replay: python -m cupy_ep.soak --seed {args.seed} --start {it} --iters 1", flush=True)
                buf.destroy()
                return 1
        if rank == 0 and hasattr(bar, "set_postfix"):
            bar.set_postfix(checked=checked, digest=f"{crc & 0xFFFFFFFF:08x}", refresh=False)
    buf.destroy()
    if rank == 0:
        print(f"cupy_ep.soak: {args.iters} iterations from {args.start} (seed {args.seed}, backend "
              f"{buf.backend}, {R} ranks{', zero-copy' if zc else ''}): 0 mismatches, {checked} compared with the "
              "reference")
    return 0


