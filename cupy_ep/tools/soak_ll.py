"""``python -m cupy_ep.soak --mode low-latency``: many randomly shaped low-latency dispatch/combine rounds,
checked against ``cupy_ep.reference``.

One ``Buffer(low_latency_mode=True)`` sized for the largest shape (M = ``--max-tokens``, the largest of
``--hiddens``, ``max(LOCAL_EXPERTS) * R`` experts). Every iteration draws its shape from a generator seeded by
(seed, iteration), identical on all ranks: tokens in [0, M] per rank, hidden, experts (a multiple of R), top-k
1..8, masked top-k slots, ``use_fp8`` / ``round_scale`` / ``use_ue8m0`` / ``return_recv_hook`` / ``zero_copy``;
its data from a per-rank generator. M stays fixed (every call passes it as
``num_max_dispatch_tokens_per_rank``), but hidden and experts change, and on the GPU a new (M, H, E) makes the
low-latency state clean its signal regions before the call (host-side: a device drain, two MPI barriers and a
memset; cheap, and it covers that path too). Combine takes bf16 expert outputs that are small integers and
power-of-two weights, so the fp32 sums are exact. Every ``--check-every``-th iteration and a random tenth of
the others are compared bit for bit with :func:`reference.low_latency_dispatch` / ``low_latency_combine``:
recv_count, the cumulative recv stats, src_info, layout_range, the valid rows (bf16, or fp8 bytes and their
scales) and the combined output. The first mismatch stops all ranks with exit code 1; rank 0 prints the
seed and iteration to replay.
"""
from __future__ import annotations

import argparse

import numpy as np

from .. import Buffer, reference
from .. import config as cfgmod
from .harness import progress, to_device, to_host

HIDDENS = (2048, 4096, 7168)        # multiples of 512: any of them may take the FP8 cast
LOCAL_EXPERTS = (1, 4, 16, 32)      # experts per rank; E = L * R always divides by R
DEFAULT_MAX_TOKENS = 128            # DeepEP's decode M


def hidden_list(text: str) -> tuple[int, ...]:
    """``--hiddens`` "2048,4096": positive multiples of 128 (the low-latency kernels' only constraint; FP8 is
    drawn only for multiples of 512)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of ints, got {text!r}") from None
    if not values or any(v <= 0 or v % 128 for v in values):
        raise argparse.ArgumentTypeError(f"hidden sizes must be positive multiples of 128, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The low-latency soak's own options, on ``python -m cupy_ep.soak``'s parser."""
    p.add_argument("--hiddens", type=hidden_list, default=",".join(map(str, HIDDENS)),
                   help="low-latency mode: comma-separated hidden sizes to draw from (positive multiples of 128)")


def iteration_shape(seed: int, it: int, max_tokens: int, num_ranks: int, hiddens=HIDDENS) -> dict:
    """The shape of iteration ``it``, the same on every rank: ``tokens`` is a list (one per rank, each in
    [0, max_tokens]); ``experts`` a multiple of ``num_ranks``; the cast flags nest (ue8m0 => round_scale =>
    fp8, fp8 only when hidden % 512 == 0)."""
    rng = np.random.default_rng([seed, it])
    hidden = int(rng.choice(hiddens))
    u = rng.random(6)    # drawn whatever the hidden size, so later draws do not depend on it
    use_fp8 = bool(hidden % 512 == 0 and u[0] < 0.5)
    round_scale = bool(use_fp8 and u[1] < 0.5)
    return dict(tokens=[int(t) for t in rng.integers(0, max_tokens + 1, size=num_ranks)], hidden=hidden,
                experts=int(rng.choice(LOCAL_EXPERTS)) * num_ranks, topk=int(rng.integers(1, 9)),
                mask=float(rng.choice([0.0, 0.0, 0.2])), use_fp8=use_fp8, round_scale=round_scale,
                use_ue8m0=bool(round_scale and u[2] < 0.5), hook=bool(u[3] < 0.3), zero_copy=bool(u[4] < 0.2),
                check=bool(u[5] < 0.1))


def routing(rng, tokens: int, topk: int, experts: int, mask: float) -> np.ndarray:
    """``[T, K] int64``: distinct experts per token (a token naming one expert twice is a DeepEP corner the
    GPU path documents as lossy past M rows), ``-1`` past ``experts`` columns and with probability ``mask``."""
    idx = np.full((tokens, topk), -1, dtype=np.int64)
    width = min(topk, experts)
    idx[:, :width] = np.argsort(rng.random((tokens, experts)), axis=1)[:, :width]
    idx[rng.random(idx.shape) < mask] = -1
    return idx


def same(a, b) -> bool:
    """Exact equality of shape and bytes."""
    return a.shape == b.shape and np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                                                 np.ascontiguousarray(b).view(np.uint8))


def compare(got: dict, want, want_c) -> list[str]:
    """Names of what differs. ``got`` (numpy): ``count [L] int32``, ``stats [L] int32``, ``layout_range [L, R]
    int64``, ``combined [T, H] bf16``, and only the valid rows (those below ``count[e]``, expert by expert, so
    N = sum(count)): ``data [N, H]`` (bf16 or fp8 bytes), ``scales [N, S]`` or None, ``src_info [N] int32``.
    Rows past ``recv_count`` are undefined on the GPU and never compared."""
    if not same(got["count"], want.recv_count):
        return ["recv_count"]
    valid = np.arange(want.src_info.shape[1])[None, :] < want.recv_count[:, None]      # [L, R*M]
    checks = {"cumulative_local_expert_recv_stats": same(got["stats"], want.recv_count),
              "layout_range": same(got["layout_range"], want.layout_range),
              "src_info": same(got["src_info"], want.src_info[valid]),
              "recv_x": same(got["data"], want.recv_x[valid]),
              "recv_x_scales": (got["scales"] is None) == (want.recv_x_scales is None) and (
                  got["scales"] is None or same(got["scales"], want.recv_x_scales[valid])),
              "combined_x": same(got["combined"], want_c)}
    return [name for name, ok in checks.items() if not ok]


def device_failure(buf) -> str | None:
    """After this rank's calls of an iteration: why its buffer failed on the device (a wait that timed out, ranks
    that disagreed), or None. Waits for the device first (every device wait ends, at the latest at its timeout)."""
    if buf.backend != "cuda":
        return None
    import cupy
    from ..errors import CommError
    cupy.cuda.runtime.deviceSynchronize()
    try:
        buf.check_health()
    except CommError as e:
        return f"{type(e).__name__}: {e}"
    return None


def main(args, comm) -> int:
    """Entry from :func:`cupy_ep.tools.soak.main` (``--mode low-latency``). Returns the exit code (0, or 1 on a
    mismatch)."""
    rank, R = comm.Get_rank(), comm.Get_size()
    M, hiddens = args.max_tokens, tuple(args.hiddens)
    rdma = cfgmod.low_latency_rdma_size_hint(M, max(hiddens), R, max(LOCAL_EXPERTS) * R)  # monotone in M, H, E
    buf = Buffer(comm, num_nvl_bytes=0, num_rdma_bytes=rdma, low_latency_mode=True, backend=args.backend)
    gpu = buf.backend == "cuda"
    if gpu:
        import cupy
        cupy.cuda.Device(buf.device_id).use()
    xp = cupy if gpu else np
    BF16 = reference.bfloat16

    def dev(a):
        return to_device(a) if gpu else a

    host = to_host

    def valid_rows(a, count):
        """numpy ``[sum(count), ...]``: rows ``[0, count[e])`` of each expert of an ``[L, R*M, ...]`` array,
        copied expert by expert so that no unwritten row leaves the GPU (initcheck reports such copies)."""
        return None if a is None else np.concatenate([host(a[e, :n]) for e, n in enumerate(count)])

    def bf16_bits(bits):
        return bits.astype(xp.uint16).view(BF16)

    bar = progress(range(args.start, args.start + args.iters), rank, "soak-ll")
    checked = 0
    for it in bar:
        s = iteration_shape(args.seed, it, M, R, hiddens)
        T, H, K, E = s["tokens"][rank], s["hidden"], s["topk"], s["experts"]
        L = E // R
        rng = np.random.default_rng([args.seed, it, rank])
        gen = xp.random.RandomState(int(rng.integers(1 << 31)))
        idx = routing(rng, T, K, E, s["mask"])
        w = (np.float32(2.0) ** rng.integers(-2, 3, size=(T, K))).astype(np.float32)  # exact products
        # x: finite bf16 of both signs, exponents 2^-27..2^12, made where it is used (no host copy on the GPU)
        x = bf16_bits((gen.randint(0, 2, size=(T, H), dtype=xp.int32) << 15)
                      | (gen.randint(100, 140, size=(T, H), dtype=xp.int32) << 7)
                      | gen.randint(0, 128, size=(T, H), dtype=xp.int32))
        # expert outputs: integers in [-8, 8] (their bf16 bits are the top half of the fp32 bits): exact sums
        y = bf16_bits(gen.randint(-8, 9, size=(L, R * M, H), dtype=xp.int32).astype(xp.float32).view(xp.uint32)
                      >> 16)
        idx_d, w_d, stats = dev(idx), dev(w), xp.zeros(L, dtype=xp.int32)
        # each rank's own wire for its tokens' partials: bf16 (30 %), LogFMT-10 (20 %, not with zero_copy), 24 bits
        pick = np.random.default_rng([args.seed, it, rank, 7]).random()
        bf16_partials, use_logfmt = bool(pick < 0.3), bool(0.3 <= pick < 0.5 and not s["zero_copy"])

        recv_x, count, handle, _, hook = buf.low_latency_dispatch(
            x, idx_d, M, E, cumulative_local_expert_recv_stats=stats, use_fp8=s["use_fp8"],
            round_scale=s["round_scale"], use_ue8m0=s["use_ue8m0"], return_recv_hook=s["hook"])
        if hook is not None:
            hook()
        y_arg = y
        if s["zero_copy"]:   # the outputs go straight into the buffer the next call sends from
            buf.get_next_low_latency_combine_buffer(handle)[...] = y
            y_arg = None
        combined, _, hook = buf.low_latency_combine(y_arg, idx_d, w_d, handle, zero_copy=s["zero_copy"],
                                                    return_recv_hook=s["hook"], bf16_partials=bf16_partials,
                                                    use_logfmt=use_logfmt)
        if hook is not None:
            hook()

        if s["check"] or it % args.check_every == 0:   # the same decision on every rank
            # A device wait that timed out leaves garbage outputs: say so (on every rank alike), not "mismatch".
            # (Unchecked iterations stay asynchronous; after a timeout there the next call raises.)
            failures = comm.allgather(device_failure(buf))
            if any(failures):
                if rank == 0:
                    print(f"\nDEVICE WAIT FAILED at iteration {it} (seed {args.seed}, shape {s}): "
                          + "; ".join(f"rank {r}: {f}" for r, f in enumerate(failures) if f) + "\n"
                          f"replay: python -m cupy_ep.soak --mode low-latency --seed {args.seed} --start {it} "
                          f"--iters 1 --max-tokens {M} --hiddens {','.join(map(str, hiddens))}", flush=True)
                buf.destroy()
                return 1
            checked += 1
            data, scales = recv_x if s["use_fp8"] else (recv_x, None)
            n = host(count)
            got = dict(count=n, stats=host(stats), layout_range=host(handle[1]), combined=host(combined),
                       data=valid_rows(data, n), scales=valid_rows(scales, n), src_info=valid_rows(handle[0], n))
            everyone = comm.allgather((host(x), idx, w))
            idx_all = [e[1] for e in everyone]
            want = reference.low_latency_dispatch([e[0] for e in everyone], idx_all, M, E, rank,
                                                  use_fp8=s["use_fp8"], round_scale=s["round_scale"],
                                                  use_ue8m0=s["use_ue8m0"])
            # the combine reference reads only rows below the (reference's) recv_count of each owner: gather
            # those, not all R*M rows per expert (hundreds of MB at M=128, H=7168)
            y_all = comm.allgather(host(y[:, :int(want.recv_count.max())]))
            want_c = reference.low_latency_combine(y_all, idx_all, [e[2] for e in everyone], M, E, rank,
                                                   bf16_partials=bf16_partials, use_logfmt=use_logfmt)
            bad_all = comm.allgather(compare(got, want, want_c))
            if any(bad_all):
                if rank == 0:
                    print(f"\nMISMATCH at iteration {it} (seed {args.seed}, shape {s}): {bad_all}\n"
                          f"replay: python -m cupy_ep.soak --mode low-latency --seed {args.seed} --start {it} "
                          f"--iters 1 --max-tokens {M} --hiddens {','.join(map(str, hiddens))}", flush=True)
                buf.destroy()
                return 1
        if rank == 0 and hasattr(bar, "set_postfix"):
            bar.set_postfix(checked=checked, refresh=False)
    buf.destroy()
    if rank == 0:
        print(f"cupy_ep.soak --mode low-latency: {args.iters} iterations from {args.start} (seed {args.seed}, "
              f"backend {buf.backend}, {R} ranks, M={M}): 0 mismatches, {checked} compared with the reference")
    return 0
