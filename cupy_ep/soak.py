"""``python -m cupy_ep.soak``: many randomly shaped dispatch/cached dispatch/combine rounds, checked against
the reference.

Run under mpirun (any backend). Every iteration draws its shape (tokens, hidden, top-k, routing skew, dtype)
from a generator seeded identically on all ranks, and its data from a per-rank generator, so any iteration
can be replayed alone with ``--start``. Each iteration's outputs are checksummed; every ``--check-every``-th
iteration and a random tenth of the others are compared bit for bit with ``cupy_ep.reference``. The first
mismatch stops all ranks with a non-zero exit and the seed/iteration to replay.
"""
from __future__ import annotations

import argparse
import sys
import zlib

import numpy as np

from . import Buffer, Config, reference
from .bench import make_routing


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


def main(argv=None) -> int:
    from mpi4py import MPI
    p = argparse.ArgumentParser(prog="python -m cupy_ep.soak", description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=10000)
    p.add_argument("--start", type=int, default=0, help="first iteration (replay)")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--check-every", type=int, default=50)
    p.add_argument("--num-sms", type=int, default=12)
    p.add_argument("--backend", choices=["cuda", "host"], default=None)
    args = p.parse_args(argv)

    comm = MPI.COMM_WORLD
    rank, R = comm.Get_rank(), comm.Get_size()
    cfg = Config(args.num_sms, 8, 256)
    buf = Buffer(comm, num_nvl_bytes=cfg.get_nvl_buffer_size_hint(7168 * 2, R), backend=args.backend)
    gpu = buf.backend == "cuda"
    if gpu:
        import cupy
        from .interop import BF16
        device = cupy.cuda.Device(buf.device_id)
        device.use()

    def dev(a):
        if not gpu or a is None:
            return a
        if a.dtype == reference.bfloat16:
            return cupy.asarray(a.view(np.uint16)).view(BF16)
        return cupy.asarray(a)

    def host(a):
        return None if a is None else (a.get() if hasattr(a, "get") else np.asarray(a))

    try:
        from tqdm import tqdm
        bar = tqdm(range(args.start, args.start + args.iters), disable=rank != 0, desc="soak", unit="it")
    except ImportError:
        bar = range(args.start, args.start + args.iters)
    checked = 0
    for it in bar:
        shape = iteration_shape(args.seed, it, args.max_tokens, R)
        rng = np.random.default_rng([args.seed, it, rank])
        T, H, K, E = shape["tokens"], shape["hidden"], shape["topk"], shape["experts"]
        idx = make_routing(rng, T, K, E, R, shape["skew"])
        w = rng.random((T, K), dtype=np.float32)
        if shape["fp8"]:
            x = (rng.integers(0, 256, size=(T, H), dtype=np.uint8), rng.random((T, -(-H // 128)), dtype=np.float32))
        else:
            x = rng.standard_normal((T, H), dtype=np.float32).astype(reference.bfloat16)
        dx = tuple(dev(a) for a in x) if shape["fp8"] else dev(x)
        layout = buf.get_dispatch_layout(dev(idx), E)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            dx, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
            topk_idx=dev(idx), topk_weights=dev(w), config=cfg)
        data = recv_x[0] if shape["fp8"] else recv_x
        cached = buf.dispatch(dx, handle=handle, config=cfg)[0]  # must equal the non-cached rows bit for bit
        cached_crc = checksum(host(cached[0] if shape["fp8"] else cached))
        y = rng.standard_normal((int(data.shape[0]), H), dtype=np.float32).astype(reference.bfloat16)
        combined, combined_w, _ = buf.combine(dev(y), handle, topk_weights=recv_w, config=cfg)
        got = [host(data), host(recv_x[1]) if shape["fp8"] else None, host(recv_idx), host(recv_w),
               host(combined), host(combined_w)]
        crc = checksum(*got)
        if cached_crc != checksum(got[0]):
            print(f"[rank {rank}] cached dispatch differs from dispatch at iteration {it}", flush=True)
            shape["check"] = True  # the reference comparison below names the culprit; then stop
            cached_mismatch = True
        else:
            cached_mismatch = False
        if comm.allreduce(shape["check"] or it % args.check_every == 0, op=MPI.LOR):
            checked += 1
            everyone = comm.allgather((x, idx, w, y))
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
            bar.set_postfix(checked=checked, crc=f"{crc:08x}", refresh=False)
    buf.destroy()
    if rank == 0:
        print(f"cupy_ep.soak: {args.iters} iterations from {args.start} (seed {args.seed}, backend "
              f"{buf.backend}, {R} ranks): 0 mismatches, {checked} compared with the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
