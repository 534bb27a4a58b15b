"""Helpers shared by the CPU tests and the GPU tests (``from tests.helpers import make_inputs``).

Nothing here needs a GPU; array arguments may be numpy, CuPy or torch (compared on the host).
"""
from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

from cupy_ep import reference

BF16 = np.dtype(ml_dtypes.bfloat16)
# Buffer sizes of the host-backend tests: the host refuses a call whose rings do not fit num_nvl_bytes (or whose
# low-latency layout does not fit num_rdma_bytes), as the GPU does, but allocates nothing of that size.
HOST_NVL_BYTES = 1 << 30
HOST_RDMA_BYTES = 1 << 36


class Inputs(NamedTuple):
    """One rank's dispatch inputs (numpy)."""
    x: object                 # [T, H] bf16, or the FP8 pair (uint8 e4m3 bytes [T, H], float32 scales [T, S])
    topk_idx: np.ndarray      # [T, K] int64, -1 = no expert
    topk_weights: np.ndarray  # [T, K] float32


def make_inputs(rng: np.random.Generator, num_tokens: int, hidden: int, num_topk: int, num_experts: int,
                num_ranks: int, skew_to_rank: int | None = None, dtype: str = "bf16", mask_prob: float = 0.0,
                duplicates: bool = False) -> Inputs:
    """Random dispatch inputs of one rank.

    Args:
        num_tokens, hidden, num_topk, num_experts, num_ranks: T, H, K, E, R.
        skew_to_rank: route every expert of every token into this rank's expert range (slots beyond
            that range's size stay -1 unless ``duplicates``).
        dtype: ``"bf16"`` (x is bf16) or ``"fp8"`` (x is the pair ``(uint8 [T, H] raw e4m3 bytes,
            float32 [T, ceil(H/128)] scales)``).
        mask_prob: probability that a top-k slot is -1.
        duplicates: allow an expert to appear several times in one row (else distinct per row).
    """
    lo, size = 0, num_experts
    if skew_to_rank is not None:
        size = num_experts // num_ranks
        lo = skew_to_rank * size
    if duplicates:
        topk_idx = rng.integers(lo, lo + size, size=(num_tokens, num_topk), dtype=np.int64)
    else:
        width = min(num_topk, size)
        topk_idx = np.full((num_tokens, num_topk), -1, dtype=np.int64)
        topk_idx[:, :width] = np.argsort(rng.random((num_tokens, size)), axis=1)[:, :width] + lo
    if mask_prob > 0:
        topk_idx[rng.random(topk_idx.shape) < mask_prob] = -1
    topk_weights = rng.random((num_tokens, num_topk), dtype=np.float32) + np.float32(0.5)
    if dtype == "bf16":
        x = rng.standard_normal((num_tokens, hidden), dtype=np.float32).astype(BF16)
    elif dtype == "fp8":
        data = rng.integers(0, 256, size=(num_tokens, hidden), dtype=np.uint8)
        scales = rng.random((num_tokens, -(-hidden // 128)), dtype=np.float32)
        x = (data, scales)
    else:
        raise ValueError(f"dtype: 'bf16' or 'fp8', got {dtype!r}")
    return Inputs(x, topk_idx, topk_weights)


def random_bf16(rng: np.random.Generator, shape) -> np.ndarray:
    """Standard-normal bf16 values of mixed magnitudes (so that fp32 sums round non-trivially)."""
    scale = np.float32(2.0) ** rng.integers(-4, 5, size=shape).astype(np.float32)
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(BF16)


def all_ok(comm, ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (so all ranks pass or fail a test together)."""
    from cupy_ep import bootstrap
    return bool(bootstrap.allreduce(comm, bool(ok), "land"))


def refused_after_failure(rank: int, call, what: str = "the timeout") -> bool:
    """True iff ``call()`` raises ``BufferUnusableError`` (a buffer must refuse use after a failed call)."""
    from cupy_ep import BufferUnusableError
    try:
        call()
    except BufferUnusableError:
        return True
    print(f"rank {rank}: a call after {what} did not raise", flush=True)
    return False


def bad_input_problem(call, prefix: str, errors: tuple) -> str | None:
    """None iff ``call()`` raises one of ``errors`` whose message starts with ``prefix`` (the argument's name);
    else what went wrong instead."""
    try:
        call()
    except errors as e:
        return None if str(e).startswith(prefix) else f"{type(e).__name__}({e}) does not start with {prefix!r}"
    return "no exception"


def gather_all(comm, obj) -> list:
    """Every rank's ``obj`` (numpy arrays, tuples of them, ...), in rank order, on every rank. One broadcast per
    rank rather than one allgather: MPI counts are ints, and the low-latency decode shape's expert outputs (470 MB
    a rank) put more than 2 GiB into one allgather at 8 ranks (MPI_ERR_ARG)."""
    return [comm.bcast(obj if r == comm.Get_rank() else None, root=r) for r in range(comm.Get_size())]


def to_numpy(a):
    """A numpy copy/view of a numpy, CuPy or torch array (None stays None; tuples map element-wise)."""
    if a is None:
        return None
    if isinstance(a, (tuple, list)):
        return type(a)(to_numpy(v) for v in a)
    if isinstance(a, np.ndarray):
        return a
    if type(a).__module__.startswith("cupy"):
        return a.get()
    if type(a).__module__.startswith("torch"):
        from cupy_ep import interop
        name = interop.dtype_name(a)
        raw = interop.unwrap(a.detach().cpu())
        return raw.view(BF16 if name == "bfloat16" else np.dtype(ml_dtypes.float8_e4m3fn)
                        if name == "float8_e4m3fn" else raw.dtype)
    return np.asarray(a)


def same_bytes(a, b) -> bool:
    """Exact equality: same shape, same element size and the same bytes (NaN payloads included)."""
    a, b = to_numpy(a), to_numpy(b)
    if a is None or b is None:
        return a is None and b is None
    return (a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize
            and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())


def reference_dispatch(comm, x, topk_idx, topk_weights, num_experts: int, expert_alignment: int = 1,
                       num_channels: int | None = None) -> reference.DispatchResult:
    """The reference's answer for this rank, from every rank's inputs (gathered here)."""
    x = to_numpy(x)
    data, scales = (x if isinstance(x, tuple) else (x, None))
    gathered = gather_all(comm, (data, scales, to_numpy(topk_idx), to_numpy(topk_weights)))
    has_scales = scales is not None
    return reference.dispatch([g[0] for g in gathered], [g[2] for g in gathered],
                              None if topk_weights is None else [g[3] for g in gathered], num_experts,
                              comm.Get_rank(), expert_alignment,
                              [g[1] for g in gathered] if has_scales else None, num_channels)


def reference_combine(comm, y, is_token_in_rank, recv_topk_weights=None, bias=None):
    """The reference's combine for this rank, from every rank's expert outputs ``y`` ``[N_r, H]``."""
    gathered = gather_all(comm, (to_numpy(y), to_numpy(is_token_in_rank), to_numpy(recv_topk_weights)))
    weights = None if recv_topk_weights is None else [g[2] for g in gathered]
    return reference.combine([g[0] for g in gathered], [g[1] for g in gathered], comm.Get_rank(), weights,
                             to_numpy(bias))
