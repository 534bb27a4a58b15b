"""The host backend's low-latency mode against the reference, bit for bit, under mpiexec -n 2 / -n 4.

Every rank builds its own random inputs (rank-dependent stream), runs ``low_latency_dispatch`` /
``low_latency_combine`` on a ``Buffer(low_latency_mode=True)``, and compares with
:func:`reference.low_latency_dispatch` / :func:`reference.low_latency_combine` computed from all ranks'
inputs (all-gathered). Every rank reaches the same verdict through ``all_ok``. Bad arguments raise on
every rank with the argument named first, and the buffer then still gives the reference's answers.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

from cupy_ep import config, reference
from cupy_ep import Buffer
from cupy_ep.ll_handle import LowLatencyHandle
from tests.helpers import (BF16, HOST_NVL_BYTES, HOST_RDMA_BYTES, all_ok, bad_input_problem, gather_all,
                           make_inputs, random_bf16, reference_combine, reference_dispatch, same_bytes)

pytestmark = pytest.mark.mpi(min_size=2)

FP8 = reference.float8_e4m3


@pytest.fixture
def ll_buffer(comm):
    """A fresh low-latency host Buffer on COMM_WORLD, destroyed after the test."""
    buf = Buffer(comm, HOST_NVL_BYTES, HOST_RDMA_BYTES, low_latency_mode=True, backend="host")
    yield buf
    buf.destroy()


def _inputs(comm, seed, tokens, hidden, topk, local_experts, mask_prob=0.0, duplicates=False,
            zero_tokens_rank=None, idx_dtype=np.int64):
    """This rank's ``(x [T, H] bf16, topk_idx [T, K], topk_weights [T, K] float32)`` and E; T shrinks with
    the rank (3 fewer per rank) so the ranks differ."""
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    num_experts = local_experts * num_ranks
    num_tokens = 0 if rank == zero_tokens_rank else max(0, tokens - 3 * rank)
    rng = np.random.default_rng([seed, rank])
    inp = make_inputs(rng, num_tokens, 16, topk, num_experts, num_ranks, mask_prob=mask_prob,
                      duplicates=duplicates)
    x = random_bf16(rng, (num_tokens, hidden))
    return x, inp.topk_idx.astype(idx_dtype), inp.topk_weights, num_experts


def _want_dispatch(comm, x, topk_idx, max_tokens, num_experts, **cast):
    gathered = gather_all(comm, (x, topk_idx))
    return reference.low_latency_dispatch([g[0] for g in gathered], [g[1] for g in gathered], max_tokens,
                                          num_experts, comm.Get_rank(), **cast)


def _want_combine(comm, y, topk_idx, topk_weights, max_tokens, num_experts, bf16_partials=False,
                  use_logfmt=False):
    gathered = gather_all(comm, (y, topk_idx, topk_weights))
    return reference.low_latency_combine([g[0] for g in gathered], [g[1] for g in gathered],
                                         [g[2] for g in gathered], max_tokens, num_experts, comm.Get_rank(),
                                         bf16_partials=bf16_partials, use_logfmt=use_logfmt)


def _check_dispatch(bad, prefix, got, want, max_tokens, hidden, num_experts, use_fp8, use_ue8m0):
    """Append to ``bad`` what differs between a low_latency_dispatch result and the reference."""
    recv_x, recv_count, handle, event, _ = got

    def check(name, ok):
        if not ok:
            bad.append(f"{prefix}{name}")

    if use_fp8:
        data, scales = recv_x
        check("recv_x.dtype", data.dtype == FP8)
        check("recv_x", same_bytes(data, want.recv_x))
        check("scales.dtype", scales.dtype == (np.int32 if use_ue8m0 else np.float32))
        check("scales", scales.shape == want.recv_x_scales.shape
              and np.array_equal(scales, want.recv_x_scales))
        # column-major in the last two dims: a transposed view of a contiguous [L, S, R*M] array
        check("scales.column_major", scales.transpose(0, 2, 1).flags.c_contiguous)
    else:
        check("recv_x.dtype", recv_x.dtype == BF16)
        check("recv_x", same_bytes(recv_x, want.recv_x))
    check("recv_count", recv_count.dtype == np.int32 and same_bytes(recv_count, want.recv_count))
    check("handle.len", len(handle) == 5 and isinstance(handle, LowLatencyHandle))
    check("handle.src_info", same_bytes(handle[0], want.src_info))
    check("handle.layout_range", same_bytes(handle[1], want.layout_range))
    check("handle.ints", tuple(handle[2:]) == (max_tokens, hidden, num_experts))
    check("event", event.event is None)


# name: tokens (rank 0; 3 fewer per rank), hidden, topk, local experts, M, and options
CASES = {
    "bf16": dict(tokens=24, hidden=128, topk=4, local_experts=3, max_tokens=32),
    "fp8": dict(tokens=20, hidden=512, topk=6, local_experts=2, max_tokens=24, use_fp8=True),
    "fp8-round-scale": dict(tokens=20, hidden=512, topk=3, local_experts=4, max_tokens=20, use_fp8=True,
                            round_scale=True),
    "fp8-ue8m0": dict(tokens=16, hidden=1024, topk=8, local_experts=4, max_tokens=16, use_fp8=True,
                      round_scale=True, use_ue8m0=True),
    "masked-duplicates": dict(tokens=30, hidden=256, topk=5, local_experts=2, max_tokens=32, mask_prob=0.3,
                              duplicates=True),
    "masked-fp8-hook": dict(tokens=12, hidden=512, topk=4, local_experts=2, max_tokens=12, mask_prob=0.4,
                            use_fp8=True, hook=True),
    "zero-tokens-on-rank1-fp8": dict(tokens=10, hidden=512, topk=3, local_experts=2, max_tokens=12,
                                     zero_tokens_rank=1, use_fp8=True),
    "all-masked": dict(tokens=9, hidden=128, topk=2, local_experts=2, max_tokens=12, mask_prob=1.0),
    "full-M-int32-top11": dict(tokens=8, hidden=128, topk=11, local_experts=3, max_tokens=8,
                               idx_dtype=np.int32, stats=True),
    "top1-one-expert-per-rank-out": dict(tokens=17, hidden=256, topk=1, local_experts=1, max_tokens=20,
                                         use_out=True),
    "zero-copy-stats": dict(tokens=14, hidden=128, topk=3, local_experts=3, max_tokens=16, zero_copy=True,
                            stats=True),
    "zero-copy-out-hook-ue8m0": dict(tokens=8, hidden=512, topk=2, local_experts=2, max_tokens=8,
                                     use_fp8=True, round_scale=True, use_ue8m0=True, zero_copy=True,
                                     use_out=True, hook=True),
}


def _run_case(comm, buf, seed, tokens, hidden, topk, local_experts, max_tokens, use_fp8=False,
              round_scale=False, use_ue8m0=False, mask_prob=0.0, duplicates=False, zero_tokens_rank=None,
              idx_dtype=np.int64, hook=False, zero_copy=False, use_out=False, stats=False):
    """One low-latency dispatch and combine; returns what differed on this rank."""
    num_ranks = comm.Get_size()
    x, topk_idx, topk_weights, num_experts = _inputs(comm, seed, tokens, hidden, topk, local_experts,
                                                     mask_prob, duplicates, zero_tokens_rank, idx_dtype)
    cast = dict(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
    recv_stats = np.full(local_experts, 5, np.int32) if stats else None
    wait_stats = np.zeros(num_ranks, np.int64)
    bad = []
    got = buf.low_latency_dispatch(x, topk_idx, max_tokens, num_experts, cumulative_local_expert_recv_stats=
                                   recv_stats, dispatch_wait_recv_cost_stats=wait_stats,
                                   return_recv_hook=hook, **cast)
    if hook:
        if not callable(got[4]):
            bad.append("dispatch.hook")
        else:
            got[4]()
    elif got[4] is not None:
        bad.append("dispatch.hook-not-None")
    want = _want_dispatch(comm, x, topk_idx, max_tokens, num_experts, **cast)
    _check_dispatch(bad, "dispatch.", got, want, max_tokens, hidden, num_experts, use_fp8, use_ue8m0)
    if stats and not np.array_equal(recv_stats, 5 + want.recv_count):
        bad.append("cumulative_local_expert_recv_stats")
    if wait_stats.any():
        bad.append("dispatch_wait_recv_cost_stats")

    # expert outputs: random rows laid out as the dispatch output (rows past recv_count are never read)
    rng = np.random.default_rng([seed, 99, comm.Get_rank()])
    y = random_bf16(rng, (local_experts, num_ranks * max_tokens, hidden))
    handle = got[2]
    kwargs = dict(return_recv_hook=hook, combine_wait_recv_cost_stats=wait_stats)
    out = np.full((x.shape[0], hidden), 7, BF16) if use_out else None
    if zero_copy:
        buffer = buf.get_next_low_latency_combine_buffer(handle)
        buffer[:] = y
        combined, event, combine_hook = buf.low_latency_combine(None, topk_idx, topk_weights, handle,
                                                                zero_copy=True, out=out, **kwargs)
    else:
        combined, event, combine_hook = buf.low_latency_combine(y, topk_idx, topk_weights, handle, out=out,
                                                                **kwargs)
    if hook:
        combine_hook()
    elif combine_hook is not None:
        bad.append("combine.hook-not-None")
    want_x = _want_combine(comm, y, topk_idx, topk_weights, max_tokens, num_experts)
    if not (combined.dtype == BF16 and same_bytes(combined, want_x)):
        bad.append("combined_x")
    if use_out and combined is not out:
        bad.append("combined_x-is-not-out")
    if event.event is not None or wait_stats.any():
        bad.append("combine.event-or-stats")
    return bad


@pytest.mark.parametrize("name", list(CASES))
def test_low_latency_matches_reference(comm, ll_buffer, name):
    bad = _run_case(comm, ll_buffer, sum(map(ord, name)), **CASES[name])
    assert all_ok(comm, not bad), f"rank {comm.Get_rank()}: {bad}"


def test_two_consecutive_calls_with_different_shapes(comm, ll_buffer):
    """Two dispatches (bf16 then FP8, other M and H) before their combines; the stats accumulate and the
    first call's outputs are unchanged by the second."""
    num_ranks, local_experts = comm.Get_size(), 2
    stats = np.zeros(local_experts, np.int32)
    first = _inputs(comm, 1, 12, 128, 3, local_experts)
    second = _inputs(comm, 2, 20, 512, 4, local_experts, mask_prob=0.2)
    out1 = ll_buffer.low_latency_dispatch(*first[:2], 16, first[3], stats, use_fp8=False)
    snapshot = [np.copy(out1[0]), np.copy(out1[1]), np.copy(out1[2][0]), np.copy(out1[2][1])]
    out2 = ll_buffer.low_latency_dispatch(*second[:2], 20, second[3], stats, round_scale=True)
    want1 = _want_dispatch(comm, *first[:2], 16, first[3], use_fp8=False)
    want2 = _want_dispatch(comm, *second[:2], 20, second[3], round_scale=True)
    bad = []
    _check_dispatch(bad, "first.", out1, want1, 16, 128, first[3], False, False)
    _check_dispatch(bad, "second.", out2, want2, 20, 512, second[3], True, False)
    if not all(same_bytes(a, b) for a, b in zip(snapshot, [out1[0], out1[1], out1[2][0], out1[2][1]])):
        bad.append("first-changed")
    if not np.array_equal(stats, want1.recv_count + want2.recv_count):
        bad.append("stats")
    rng = np.random.default_rng([3, comm.Get_rank()])
    ys = [random_bf16(rng, (local_experts, num_ranks * m, h)) for m, h in ((16, 128), (20, 512))]
    # combine the second dispatch first, then the first one
    for (inp, m, y, out) in ((second, 20, ys[1], out2), (first, 16, ys[0], out1)):
        combined, _, _ = ll_buffer.low_latency_combine(y, inp[1], inp[2], out[2])
        if not same_bytes(combined, _want_combine(comm, y, inp[1], inp[2], m, inp[3])):
            bad.append(f"combined-M{m}")
    assert all_ok(comm, not bad), f"rank {comm.Get_rank()}: {bad}"


def _rank0_chooses(comm, buf, wire: str):
    """A dispatch, then a combine where only rank 0 passes ``wire=True`` (``bf16_partials`` / ``use_logfmt``: each
    rank chooses for its own tokens). ``(combined, want, plain, num_tokens)``: the output, the reference with this
    rank's choice, and the reference with 24-bit partials."""
    x, topk_idx, topk_weights, num_experts = _inputs(comm, 8, 24, 256, 4, 2)
    rank = comm.Get_rank()
    _, _, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, 24, num_experts, use_fp8=False)
    y = random_bf16(np.random.default_rng([8, rank]), (2, comm.Get_size() * 24, 256))
    combined, _, _ = buf.low_latency_combine(y, topk_idx, topk_weights, handle, **{wire: rank == 0})
    want = _want_combine(comm, y, topk_idx, topk_weights, 24, num_experts, **{wire: rank == 0})
    plain = _want_combine(comm, y, topk_idx, topk_weights, 24, num_experts)
    return combined, want, plain, x.shape[0]


def test_bf16_partials_are_each_ranks_own_choice(comm, ll_buffer):
    """bf16_partials on rank 0 only: rank 0's output is the reference with bf16 partials, the others' with 24-bit
    ones; on rank 0 the inputs are such that the two formats give other bytes."""
    combined, want, plain, T = _rank0_chooses(comm, ll_buffer, "bf16_partials")
    differs = comm.Get_rank() != 0 or T == 0 or not same_bytes(want, plain)
    bad = [name for name, ok in (("combined_x", same_bytes(combined, want)), ("formats-tell-apart", differs))
           if not ok]
    assert all_ok(comm, not bad), f"rank {comm.Get_rank()}: {bad}"


def test_use_logfmt_is_each_ranks_own_choice(comm, ll_buffer):
    """use_logfmt on rank 0 only: rank 0's output is the reference with LogFMT-10 partials, the others' with
    24-bit ones; rank 0's differs from its 24-bit result, but within LogFMT's bound (2.2 % of the partials) of it."""
    combined, want, plain, T = _rank0_chooses(comm, ll_buffer, "use_logfmt")
    diff = np.abs(want.astype(np.float32) - plain.astype(np.float32))
    close = diff.size == 0 or diff.max() <= 0.03 * np.abs(plain.astype(np.float32)).max()
    differs = comm.Get_rank() != 0 or T == 0 or diff.max() > 0
    bad = [name for name, ok in (("combined_x", same_bytes(combined, want)), ("logfmt-close", close),
                                 ("logfmt-differs", differs)) if not ok]
    assert all_ok(comm, not bad), f"rank {comm.Get_rank()}: {bad}"


def test_combine_buffer_is_owned_by_the_buffer_and_reused(comm, ll_buffer):
    x, topk_idx, _, num_experts = _inputs(comm, 4, 8, 128, 2, 2)
    _, _, handle, _, _ = ll_buffer.low_latency_dispatch(x, topk_idx, 8, num_experts, use_fp8=False)
    a = ll_buffer.get_next_low_latency_combine_buffer(handle)
    b = ll_buffer.get_next_low_latency_combine_buffer(handle)
    ok = (a.shape == (2, comm.Get_size() * 8, 128) and a.dtype == BF16 and np.shares_memory(a, b)
          and a.flags.c_contiguous)
    assert all_ok(comm, ok)


def test_normal_mode_still_works_on_a_low_latency_buffer(comm, ll_buffer):
    num_ranks = comm.Get_size()
    inp = make_inputs(np.random.default_rng([6, comm.Get_rank()]), 30, 64, 3, 4 * num_ranks, num_ranks)
    layout = ll_buffer.get_dispatch_layout(inp.topk_idx, 4 * num_ranks)
    recv_x, _, _, _, handle, _ = ll_buffer.dispatch(
        inp.x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
        topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)
    want = reference_dispatch(comm, inp.x, inp.topk_idx, inp.topk_weights, 4 * num_ranks)
    combined, _, _ = ll_buffer.combine(recv_x, handle)
    want_x, _ = reference_combine(comm, recv_x, want.is_token_in_rank)
    assert all_ok(comm, same_bytes(recv_x, want.recv_x) and same_bytes(combined, want_x))


def test_clean_and_size_hint(comm, ll_buffer):
    num_ranks = comm.Get_size()
    ll_buffer.clean_low_latency_buffer(16, 512, 4 * num_ranks)
    ok = (Buffer.get_low_latency_rdma_size_hint(128, 7168, num_ranks, 32 * num_ranks)
          == config.low_latency_rdma_size_hint(128, 7168, num_ranks, 32 * num_ranks))
    assert all_ok(comm, ok)


# ---- bad arguments ----------------------------------------------------------------------------------
M, H, K, LOCAL = 12, 512, 3, 2


def _context(comm, buf):
    """Valid inputs of this rank and one valid low-latency dispatch on ``buf``."""
    x, topk_idx, w, num_experts = _inputs(comm, 8, 10, H, K, LOCAL)
    out = buf.low_latency_dispatch(x, topk_idx, M, num_experts, use_fp8=False)
    y = random_bf16(np.random.default_rng([8, comm.Get_rank()]), (LOCAL, comm.Get_size() * M, H))
    return types.SimpleNamespace(comm=comm, buf=buf, R=comm.Get_size(), E=num_experts, T=x.shape[0], x=x,
                                 topk_idx=topk_idx, w=w, handle=out[2], y=y)


def _rank(c) -> int:
    return c.comm.Get_rank()


def _dispatch(c, **changes):
    kwargs = dict(x=c.x, topk_idx=c.topk_idx, num_max_dispatch_tokens_per_rank=M, num_experts=c.E,
                  use_fp8=False)
    kwargs.update(changes)
    return c.buf.low_latency_dispatch(**kwargs)


def _combine(c, **changes):
    kwargs = dict(x=c.y, topk_idx=c.topk_idx, topk_weights=c.w, handle=c.handle)
    kwargs.update(changes)
    return c.buf.low_latency_combine(**kwargs)


def _on_a_normal_buffer(c):
    buf = Buffer(c.comm, backend="host")
    try:
        buf.low_latency_dispatch(c.x, c.topk_idx, M, c.E)
    finally:
        buf.destroy()


def _handle(c, index, value):
    h = list(c.handle)
    h[index] = value
    return LowLatencyHandle(h, c.handle.topk_slots)


def _slots(c, value):
    return LowLatencyHandle(tuple(c.handle), value)


# name -> (bad call on the context, how the error message starts)
BAD = {
    "dispatch/x-float32": (lambda c: _dispatch(c, x=c.x.astype(np.float32)), "x:"),
    "dispatch/x-hidden-96": (lambda c: _dispatch(c, x=np.ascontiguousarray(c.x[:, :96])), "x:"),
    "dispatch/x-fp8-hidden-384": (lambda c: _dispatch(c, x=np.ascontiguousarray(c.x[:, :384]), use_fp8=True),
                                  "x:"),
    "dispatch/x-more-tokens-than-M": (lambda c: _dispatch(c, x=np.zeros((M + 1, H), BF16),
                                                          topk_idx=np.zeros((M + 1, K), np.int64)), "x:"),
    "dispatch/x-strided": (lambda c: _dispatch(c, x=np.repeat(c.x, 2, axis=1)[:, ::2]), "x:"),
    "dispatch/x-bad-on-rank-1-only": (lambda c: _dispatch(c, x=c.x.astype(np.float32) if _rank(c) == 1 else c.x),
                                      "x:"),
    "dispatch/topk_idx-rows": (lambda c: _dispatch(c, topk_idx=np.zeros((c.T + 1, K), np.int64)), "topk_idx:"),
    "dispatch/topk_idx-k33": (lambda c: _dispatch(c, topk_idx=np.zeros((c.T, 33), np.int64)), "topk_idx:"),
    "dispatch/topk_idx-out-of-range": (lambda c: _dispatch(c, topk_idx=c.topk_idx + c.E), "topk_idx:"),
    "dispatch/topk_idx-float": (lambda c: _dispatch(c, topk_idx=c.topk_idx.astype(np.float32)), "topk_idx:"),
    "dispatch/num_experts-not-multiple": (lambda c: _dispatch(c, num_experts=c.E + 1), "num_experts:"),
    "dispatch/num_max_dispatch_tokens_per_rank-zero": (
        lambda c: _dispatch(c, num_max_dispatch_tokens_per_rank=0), "num_max_dispatch_tokens_per_rank:"),
    "dispatch/num_max_dispatch_tokens_per_rank-differs": (
        lambda c: _dispatch(c, num_max_dispatch_tokens_per_rank=M if _rank(c) == 0 else M + 4),
        "num_max_dispatch_tokens_per_rank:"),
    "dispatch/use_fp8-not-bool": (lambda c: _dispatch(c, use_fp8="yes"), "use_fp8:"),
    "dispatch/use_fp8-differs": (lambda c: _dispatch(c, use_fp8=_rank(c) == 0), "use_fp8:"),
    "dispatch/use_ue8m0-without-round_scale": (lambda c: _dispatch(c, use_fp8=True, use_ue8m0=True), "use_ue8m0:"),
    "dispatch/return_recv_hook-with-async_finish": (
        lambda c: _dispatch(c, async_finish=True, return_recv_hook=True), "return_recv_hook:"),
    "dispatch/cumulative_local_expert_recv_stats-int64": (
        lambda c: _dispatch(c, cumulative_local_expert_recv_stats=np.zeros(LOCAL, np.int64)),
        "cumulative_local_expert_recv_stats:"),
    "dispatch/cumulative_local_expert_recv_stats-length": (
        lambda c: _dispatch(c, cumulative_local_expert_recv_stats=np.zeros(LOCAL + 1, np.int32)),
        "cumulative_local_expert_recv_stats:"),
    "dispatch/dispatch_wait_recv_cost_stats-2d": (
        lambda c: _dispatch(c, dispatch_wait_recv_cost_stats=np.zeros((c.R, c.R), np.int64)),
        "dispatch_wait_recv_cost_stats:"),
    "dispatch/normal-mode-buffer": (_on_a_normal_buffer, "low_latency_mode:"),
    "combine/x-shape": (lambda c: _combine(c, x=np.ascontiguousarray(c.y[:, :-1])), "x:"),
    "combine/x-none-without-zero_copy": (lambda c: _combine(c, x=None), "x:"),
    "combine/zero_copy-without-buffer": (lambda c: _combine(c, zero_copy=True), "zero_copy:"),
    "combine/handle-4-tuple": (lambda c: _combine(c, handle=c.handle[:4]), "handle:"),
    "combine/handle.layout_range-int32": (
        lambda c: _combine(c, handle=_handle(c, 1, c.handle[1].astype(np.int32))), "handle.layout_range:"),
    "combine/handle.layout_range-past-the-rows": (
        lambda c: _combine(c, handle=_handle(c, 1, c.handle[1] + (100 << 32))), "handle.layout_range:"),
    "combine/handle-other-M": (lambda c: _combine(c, handle=_handle(c, 2, M + 4)), "handle.src_info:"),
    "combine/handle.topk_slots-int64": (lambda c: _combine(c, handle=_slots(c, c.handle.topk_slots.astype(np.int64))),
                                        "handle.topk_slots:"),
    "combine/handle.topk_slots-past-M": (lambda c: _combine(c, handle=_slots(c, c.handle.topk_slots + M)),
                                         "handle.topk_slots:"),
    "combine/topk_idx-fewer-rows-than-the-dispatch": (
        lambda c: _combine(c, topk_idx=np.ascontiguousarray(c.topk_idx[1:]),
                           topk_weights=np.ascontiguousarray(c.w[1:])), "topk_idx:"),
    "combine/topk_idx-not-the-dispatch-routing": (
        lambda c: _combine(c, topk_idx=np.full_like(c.topk_idx, -1) if _rank(c) == 0 else c.topk_idx),
        "topk_idx:"),
    "combine/topk_weights-float64": (lambda c: _combine(c, topk_weights=c.w.astype(np.float64)), "topk_weights:"),
    "combine/topk_weights-shape": (lambda c: _combine(c, topk_weights=np.ascontiguousarray(c.w[:, :1])),
                                   "topk_weights:"),
    "combine/out-shape": (lambda c: _combine(c, out=np.zeros((c.T + 1, H), BF16)), "out:"),
    "combine/use_logfmt-with-bf16_partials": (lambda c: _combine(c, use_logfmt=True, bf16_partials=True),
                                              "use_logfmt:"),
    "combine/use_logfmt-with-zero_copy": (lambda c: _combine(c, use_logfmt=True, zero_copy=True), "use_logfmt:"),
    "combine/bf16_partials-not-bool": (lambda c: _combine(c, bf16_partials="yes"), "bf16_partials:"),
    "combine/return_recv_hook-with-async_finish": (
        lambda c: _combine(c, async_finish=True, return_recv_hook=True), "return_recv_hook:"),
    "combine/combine_wait_recv_cost_stats-int32": (
        lambda c: _combine(c, combine_wait_recv_cost_stats=np.zeros(c.R, np.int32)), "combine_wait_recv_cost_stats:"),
    "get_next/handle-not-a-tuple": (lambda c: c.buf.get_next_low_latency_combine_buffer(c.handle[0]), "handle:"),
    "clean/hidden": (lambda c: c.buf.clean_low_latency_buffer(M, 100, c.E), "hidden:"),
    "clean/num_experts": (lambda c: c.buf.clean_low_latency_buffer(M, H, c.E + 1), "num_experts:"),
}


def _valid_round_trip(comm, buf, plain_tuple: bool = False) -> bool:
    """A fresh FP8 low-latency dispatch + combine on ``buf``, compared with the reference; ``plain_tuple``: the
    combine gets the handle as a plain tuple of its items."""
    x, topk_idx, w, num_experts = _inputs(comm, 9, 11, H, K, LOCAL, mask_prob=0.2)
    got = buf.low_latency_dispatch(x, topk_idx, M, num_experts)
    want = _want_dispatch(comm, x, topk_idx, M, num_experts)
    bad = []
    _check_dispatch(bad, "", got, want, M, H, num_experts, True, False)
    y = random_bf16(np.random.default_rng([10, comm.Get_rank()]), (LOCAL, comm.Get_size() * M, H))
    combined, _, _ = buf.low_latency_combine(y, topk_idx, w, tuple(got[2]) if plain_tuple else got[2])
    return not bad and same_bytes(combined, _want_combine(comm, y, topk_idx, w, M, num_experts))


def test_a_handle_rebuilt_as_a_plain_tuple_combines_as_the_handle(comm, ll_buffer):
    """DeepEP's callers may rebuild a low-latency handle as a plain 5-tuple: the combine computes its slots again
    from topk_idx and gives the reference's answer."""
    assert all_ok(comm, _valid_round_trip(comm, ll_buffer, plain_tuple=True))


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_everywhere_and_buffer_stays_usable(comm, ll_buffer, case):
    ctx = _context(comm, ll_buffer)
    call, prefix = BAD[case]
    problem = bad_input_problem(lambda: call(ctx), prefix, (ValueError, TypeError, NotImplementedError))
    ok = _valid_round_trip(comm, ll_buffer)
    assert all_ok(comm, problem is None and ok), f"rank {comm.Get_rank()}: {problem}, valid call ok: {ok}"


def test_receive_hooks_run_once_and_before_the_next_call(comm, ll_buffer):
    """The GPU backend's hook rule on the host too (``event.RecvHooks``): with a dispatch hook pending, the next
    combine, dispatch and clean raise RuntimeError naming return_recv_hook (the GPU kernels would reuse the
    hook's buffer); after the hook runs they work and give the reference's answers; a second run raises."""
    c = _context(comm, ll_buffer)
    out = c.buf.low_latency_dispatch(c.x, c.topk_idx, M, c.E, use_fp8=False, return_recv_hook=True)
    hook = out[4]
    problems = [bad_input_problem(lambda: c.buf.low_latency_combine(c.y, c.topk_idx, c.w, out[2]),
                                  "return_recv_hook:", (RuntimeError,)),
                bad_input_problem(lambda: c.buf.low_latency_dispatch(c.x, c.topk_idx, M, c.E),
                                  "return_recv_hook:", (RuntimeError,)),
                bad_input_problem(lambda: c.buf.clean_low_latency_buffer(M, H, c.E), "return_recv_hook:",
                                  (RuntimeError,))]
    hook()
    problems.append(bad_input_problem(hook, "return_recv_hook:", (RuntimeError,)))
    combined, _, combine_hook = c.buf.low_latency_combine(c.y, c.topk_idx, c.w, out[2], return_recv_hook=True)
    combine_hook()
    ok = same_bytes(combined, _want_combine(comm, c.y, c.topk_idx, c.w, M, c.E)) and _valid_round_trip(comm, c.buf)
    problems = [p for p in problems if p is not None]
    assert all_ok(comm, not problems and ok), f"rank {comm.Get_rank()}: {problems}, valid calls ok: {ok}"
