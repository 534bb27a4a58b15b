"""One launcher per ``__global__`` the low-latency path launches (``cuda_src/low_latency.cu``: dispatch, combine).

As :mod:`.kernels` for the intranode path: each kernel has an argument record (a NamedTuple whose fields are the
kernel's parameters in the kernel's order; ``tests/unit/test_kernel_records.py`` compares them with the sources) and one
function with its grid, block and dynamic shared memory rule. Both kernels run one resident block per SM the rank
may hold (``LowLatencyState.num_blocks``: the blocks wait for each other, so every one must be resident); the
stream is the caller's or the comm stream, chosen by ``LowLatencyState.run``.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

from .. import config as _config
from .. import ids

LOW_LATENCY = "low_latency.cu"
DISPATCH_THREADS = ids.LL_DISPATCH_THREADS      # kLLThreads (dispatch)
COMBINE_THREADS = ids.LL_COMBINE_THREADS        # kLLCombineThreads
COMBINE_CHUNKS = ids.LL_COMBINE_CHUNKS          # kCombineChunks
COMBINE_STAGE_ENTRIES = 11                      # kCombineStageEntries
#: how every combine instantiation's name begins (kernel_name), which tells the two kernels' launchers apart
COMBINE_PREFIX = "ep::combine"
# the blocks as CuPy takes them, made once (a launch is on every call's host path)
_DISPATCH_BLOCK, _COMBINE_BLOCK = (DISPATCH_THREADS,), (COMBINE_THREADS,)


def combine_stage_bytes(num_topk: int) -> int:
    """The combine's dynamic shared memory: partial_sums' cp.async slots, 16 bytes per (thread, chunk, top-k
    entry) for at most COMBINE_STAGE_ENTRIES entries: kLLCombineThreads x kCombineChunks x min(K, 11) x 16 (176 KB
    at K >= 11, with the kernel's 19-25 KB of static shared memory under the 227 KB a block may have; a larger
    top-k stages its rows 11 at a time)."""
    return COMBINE_THREADS * COMBINE_CHUNKS * min(num_topk, COMBINE_STAGE_ENTRIES) * 16


@functools.lru_cache(maxsize=None)
def kernel_name(op: str, use_fp8: bool, ctype: str, num_topk: int) -> str:
    """The name expression of the low-latency ``op`` ("dispatch" or "combine") for a top-k of ``num_topk``: its
    top-k bound (config.low_latency_topk_bound) the kernels' default for top-k up to 11, else explicit. Cached:
    built once per (op, use_fp8, index type, K), not per call."""
    bound = _config.low_latency_topk_bound(num_topk)
    tail = "" if bound == _config.LL_TOPK_BOUNDS[0] else f", {bound}"
    if op == "dispatch":
        return f"ep::dispatch<{'true' if use_fp8 else 'false'}, {ctype}{tail}>"
    return f"{COMBINE_PREFIX}<{ctype}{tail}>"


class Dispatch(NamedTuple):
    packed_recv_x: Any
    packed_recv_scales: Any
    packed_recv_count: Any
    packed_recv_src_info: Any
    packed_recv_layout_range: Any
    cumulative_stats: Any
    wait_stats: Any
    x: Any
    topk_idx: Any
    topk_slots: Any
    num_tokens: Any
    num_topk: Any
    round_scale: Any
    use_ue8m0: Any
    base: Any
    peer_bases: Any
    buffer_idx: Any
    max_tokens: Any
    hidden: Any
    num_experts: Any
    rank: Any
    num_ranks: Any
    workspace: Any
    shrink_mask: Any
    phases: Any
    stamps: Any
    ctx: Any


def dispatch(kernel, args: Dispatch, num_blocks: int, stream) -> None:
    """``num_blocks`` blocks of kLLThreads on ``stream``; no dynamic shared memory."""
    kernel((num_blocks,), _DISPATCH_BLOCK, args, shared_mem=0, stream=stream)


class Combine(NamedTuple):
    combined_x: Any
    x: Any
    layout_range: Any
    topk_idx: Any
    topk_slots: Any
    topk_weights: Any
    wait_stats: Any
    num_tokens: Any
    num_topk: Any
    zero_copy: Any
    wire: Any
    base: Any
    peer_bases: Any
    buffer_idx: Any
    max_tokens: Any
    hidden: Any
    num_experts: Any
    rank: Any
    num_ranks: Any
    workspace: Any
    shrink_mask: Any
    phases: Any
    stamps: Any
    ctx: Any


def combine(kernel, args: Combine, num_blocks: int, stream, shared_mem: int) -> None:
    """``num_blocks`` blocks of kLLCombineThreads on ``stream``; ``shared_mem``: :func:`combine_stage_bytes` of
    the call's top-k (the caller computes it once per call: a receive hook launches again with the same)."""
    kernel((num_blocks,), _COMBINE_BLOCK, args, shared_mem=shared_mem, stream=stream)


#: every record by its kernel's name (tests/unit/test_kernel_records.py reads the sources' signatures against these)
RECORDS = {"dispatch": (LOW_LATENCY, Dispatch), "combine": (LOW_LATENCY, Combine)}
