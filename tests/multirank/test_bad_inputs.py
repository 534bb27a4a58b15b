"""Bad arguments on the host backend: each raises ValueError/TypeError (or a cupy_ep error) whose message
starts with the argument's name, on every rank (no rank is left in a collective), and the same buffer
then still gives the reference's answer. Also: calls after ``destroy()`` raise BufferUnusableError.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

from cupy_ep import Buffer, BufferUnusableError, Config, CupyEpError, gpu_available
from tests.helpers import (BF16, HOST_NVL_BYTES, all_ok, bad_input_problem, make_inputs, reference_combine,
                           reference_dispatch, same_bytes)

pytestmark = pytest.mark.mpi(min_size=2)


def _context(comm, buf, seed=5):
    """Valid inputs of this rank and the outputs of one valid dispatch (for the combine/cached cases)."""
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    num_experts, num_tokens, hidden = 4 * num_ranks, 24 + rank, 64
    inp = make_inputs(np.random.default_rng([seed, rank]), num_tokens, hidden, 3, num_experts, num_ranks)
    fp8 = make_inputs(np.random.default_rng([seed, rank]), num_tokens, hidden, 3, num_experts, num_ranks,
                      dtype="fp8").x
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(inp.topk_idx, num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    topk = dict(topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(inp.x, **layout, **topk)
    return types.SimpleNamespace(
        comm=comm, buf=buf, R=num_ranks, E=num_experts, T=num_tokens, H=hidden, x=inp.x, fp8=fp8,
        topk_idx=inp.topk_idx, w=inp.topk_weights, layout=layout, topk=topk, handle=handle, recv_x=recv_x,
        recv_w=recv_w, N=recv_x.shape[0], bias=np.zeros((num_tokens, hidden), BF16))


def _valid_round_trip(comm, buf) -> bool:
    """A fresh valid layout + dispatch + combine on ``buf``, compared with the reference."""
    c = _context(comm, buf, seed=9)
    want = reference_dispatch(comm, c.x, c.topk_idx, c.w, c.E)
    got_x, got_w, _ = buf.combine(c.recv_x, c.handle, topk_weights=c.recv_w, bias=c.bias)
    want_x, want_w = reference_combine(comm, c.recv_x, want.is_token_in_rank, c.recv_w, c.bias)
    return (same_bytes(c.recv_x, want.recv_x) and same_bytes(c.recv_w, want.recv_topk_weights)
            and same_bytes(got_x, want_x) and same_bytes(got_w, want_w))


def _with(d: dict, **changes) -> dict:
    return {**d, **changes}


def _layout(c, **changes):
    return _with(c.layout, **changes)


def _handle(c, index, value):
    h = list(c.handle)
    h[index] = value
    return tuple(h)


def _rank(c) -> int:
    return c.comm.Get_rank()


def _no_gpu_cuda_backend(c):
    if gpu_available():
        pytest.skip("a GPU is visible here")
    Buffer(c.comm, backend="cuda")


# name -> (bad call on the context, how the error message starts)
CASES = {
    # get_dispatch_layout
    "layout/topk_idx-float": (lambda c: c.buf.get_dispatch_layout(c.topk_idx.astype(np.float32), c.E), "topk_idx:"),
    "layout/topk_idx-list": (lambda c: c.buf.get_dispatch_layout(c.topk_idx.tolist(), c.E), "topk_idx:"),
    "layout/topk_idx-1d": (lambda c: c.buf.get_dispatch_layout(c.topk_idx[:, 0].copy(), c.E), "topk_idx:"),
    "layout/topk_idx-too-large": (lambda c: c.buf.get_dispatch_layout(c.topk_idx + c.E, c.E), "topk_idx:"),
    "layout/topk_idx-below-minus-one": (lambda c: c.buf.get_dispatch_layout(c.topk_idx - c.E, c.E), "topk_idx:"),
    "layout/topk_idx-k33": (lambda c: c.buf.get_dispatch_layout(np.zeros((c.T, 33), np.int64), c.E), "topk_idx:"),
    "layout/topk_idx-strided": (lambda c: c.buf.get_dispatch_layout(np.repeat(c.topk_idx, 2, axis=1)[:, ::2], c.E),
                                "topk_idx:"),
    "layout/num_experts-not-multiple": (lambda c: c.buf.get_dispatch_layout(c.topk_idx, c.E + 1), "num_experts:"),
    "layout/num_experts-float": (lambda c: c.buf.get_dispatch_layout(c.topk_idx, float(c.E)), "num_experts:"),
    "layout/num_experts-too-many": (lambda c: c.buf.get_dispatch_layout(c.topk_idx, 1025 * c.R), "num_experts:"),
    "layout/allocate_on_comm_stream": (
        lambda c: c.buf.get_dispatch_layout(c.topk_idx, c.E, allocate_on_comm_stream=True), "allocate_on_comm_stream:"),
    # dispatch: x
    "dispatch/x-float32": (lambda c: c.buf.dispatch(c.x.astype(np.float32), **c.layout, **c.topk), "x:"),
    "dispatch/x-3d": (lambda c: c.buf.dispatch(c.x[None], **c.layout, **c.topk), "x:"),
    "dispatch/x-8-byte-rows": (lambda c: c.buf.dispatch(np.ascontiguousarray(c.x[:, :4]), **c.layout, **c.topk), "x:"),
    "dispatch/x-strided": (lambda c: c.buf.dispatch(np.repeat(c.x, 2, axis=1)[:, ::2], **c.layout, **c.topk), "x:"),
    "dispatch/x-bad-on-rank-1-only": (
        lambda c: c.buf.dispatch(c.x.astype(np.float32) if _rank(c) == 1 else c.x, **c.layout, **c.topk),
        "x:"),
    "dispatch/x-fp8-three-items": (lambda c: c.buf.dispatch((c.fp8[0], c.fp8[1], c.fp8[1]), **c.layout), "x:"),
    "dispatch/x[1]-scales-shape": (lambda c: c.buf.dispatch((c.fp8[0], np.ones((c.T, 2), np.float32)), **c.layout),
                                   "x[1]:"),
    "dispatch/x[1]-scales-none": (lambda c: c.buf.dispatch((c.fp8[0], None), **c.layout), "x[1]:"),
    "dispatch/x[1]-scales-float64": (lambda c: c.buf.dispatch((c.fp8[0], c.fp8[1].astype(np.float64)), **c.layout),
                                     "x[1]:"),
    "dispatch/x[0]-bf16-data": (lambda c: c.buf.dispatch((c.x, c.fp8[1]), **c.layout), "x[0]:"),
    # dispatch: top-k
    "dispatch/topk_idx-without-weights": (lambda c: c.buf.dispatch(c.x, **c.layout, topk_idx=c.topk_idx), "topk_idx"),
    "dispatch/topk_weights-shape": (lambda c: c.buf.dispatch(c.x, **c.layout, topk_idx=c.topk_idx,
                                                             topk_weights=np.ascontiguousarray(c.w[:, :2])),
                                    "topk_weights:"),
    "dispatch/topk_weights-float64": (lambda c: c.buf.dispatch(c.x, **c.layout, topk_idx=c.topk_idx,
                                                               topk_weights=c.w.astype(np.float64)), "topk_weights:"),
    "dispatch/topk_idx-rows": (lambda c: c.buf.dispatch(c.x, **c.layout, topk_idx=c.topk_idx[:-1],
                                                        topk_weights=c.w[:-1]), "topk_idx:"),
    "dispatch/topk_idx-out-of-range": (
        lambda c: c.buf.dispatch(c.x, **c.layout, **_with(c.topk, topk_idx=c.topk_idx + c.E)), "topk_idx:"),
    # dispatch: layout arguments
    "dispatch/num_tokens_per_rank-missing": (lambda c: c.buf.dispatch(c.x, **_layout(c, num_tokens_per_rank=None)),
                                             "num_tokens_per_rank:"),
    "dispatch/is_token_in_rank-missing": (lambda c: c.buf.dispatch(c.x, **_layout(c, is_token_in_rank=None)),
                                          "is_token_in_rank:"),
    "dispatch/num_tokens_per_expert-missing": (lambda c: c.buf.dispatch(c.x, **_layout(c, num_tokens_per_expert=None)),
                                               "num_tokens_per_expert:"),
    "dispatch/num_tokens_per_rank-int64": (lambda c: c.buf.dispatch(c.x, **_layout(
        c, num_tokens_per_rank=c.layout["num_tokens_per_rank"].astype(np.int64))), "num_tokens_per_rank:"),
    "dispatch/num_tokens_per_rank-shape": (lambda c: c.buf.dispatch(c.x, **_layout(
        c, num_tokens_per_rank=c.layout["num_tokens_per_rank"][:-1].copy())), "num_tokens_per_rank:"),
    "dispatch/num_tokens_per_rank-values": (lambda c: c.buf.dispatch(c.x, **_layout(
        c, num_tokens_per_rank=c.layout["num_tokens_per_rank"] + 1)), "num_tokens_per_rank:"),
    "dispatch/is_token_in_rank-int": (lambda c: c.buf.dispatch(c.x, **_layout(
        c, is_token_in_rank=c.layout["is_token_in_rank"].astype(np.int32))), "is_token_in_rank:"),
    "dispatch/is_token_in_rank-rows": (lambda c: c.buf.dispatch(c.x, **_layout(
        c, is_token_in_rank=c.layout["is_token_in_rank"][:-1].copy())), "is_token_in_rank:"),
    "dispatch/is_token_in_rank-vs-topk": (lambda c: c.buf.dispatch(c.x, **_layout(
        c, is_token_in_rank=~c.layout["is_token_in_rank"],
        num_tokens_per_rank=(~c.layout["is_token_in_rank"]).sum(axis=0).astype(np.int32)), **c.topk),
        "is_token_in_rank:"),
    "dispatch/num_tokens_per_expert-length": (lambda c: c.buf.dispatch(c.x, **_layout(
        c, num_tokens_per_expert=np.zeros(c.E + 1, np.int32))), "num_tokens_per_expert:"),
    "dispatch/num_tokens_per_expert-values": (lambda c: c.buf.dispatch(c.x, **_layout(
        c, num_tokens_per_expert=c.layout["num_tokens_per_expert"] + 1), **c.topk), "num_tokens_per_expert:"),
    # dispatch: options
    "dispatch/expert_alignment-zero": (lambda c: c.buf.dispatch(c.x, **c.layout, **c.topk, expert_alignment=0),
                                       "expert_alignment:"),
    "dispatch/expert_alignment-float": (lambda c: c.buf.dispatch(c.x, **c.layout, **c.topk, expert_alignment=2.0),
                                        "expert_alignment:"),
    "dispatch/num_worst_tokens-negative": (lambda c: c.buf.dispatch(c.x, **c.layout, **c.topk, num_worst_tokens=-1),
                                           "num_worst_tokens:"),
    "dispatch/num_worst_tokens-too-small": (lambda c: c.buf.dispatch(c.x, **c.layout, **c.topk, num_worst_tokens=1),
                                            "num_worst_tokens:"),
    "dispatch/num_worst_tokens-without-topk": (lambda c: c.buf.dispatch(c.x, **c.layout, num_worst_tokens=1000),
                                               "num_worst_tokens:"),
    "dispatch/config-dict": (lambda c: c.buf.dispatch(c.x, **c.layout, **c.topk, config={"num_sms": 20}), "config:"),
    "dispatch/allocate_on_comm_stream": (lambda c: c.buf.dispatch(c.x, **c.layout, **c.topk, async_finish=True,
                                                                  allocate_on_comm_stream=True),
                                         "allocate_on_comm_stream:"),
    # arguments that must agree across ranks (each rank alone is valid)
    "dispatch/x-hidden-differs-across-ranks": (
        lambda c: c.buf.dispatch(np.ascontiguousarray(c.x[:, :32]) if _rank(c) == 1 else c.x, **c.layout, **c.topk),
        "x:"),
    "dispatch/topk-on-rank-0-only": (
        lambda c: c.buf.dispatch(c.x, **c.layout, **(c.topk if _rank(c) == 0 else {})), "topk_idx:"),
    "dispatch/config-differs-across-ranks": (
        lambda c: c.buf.dispatch(c.x, **c.layout, **c.topk, config=Config(num_sms=4) if _rank(c) == 0 else None),
        "config:"),
    "dispatch/handle-on-rank-0-only": (
        lambda c: c.buf.dispatch(c.x, handle=c.handle) if _rank(c) == 0 else c.buf.dispatch(c.x, **c.layout),
        "handle:"),
    "combine/topk_weights-on-rank-0-only": (
        lambda c: c.buf.combine(c.recv_x, c.handle, topk_weights=c.recv_w if _rank(c) == 0 else None),
        "topk_weights:"),
    # cached dispatch
    "cached/topk_idx-given": (lambda c: c.buf.dispatch(c.x, handle=c.handle, **c.topk), "topk_idx"),
    "cached/handle-5-tuple": (lambda c: c.buf.dispatch(c.x, handle=c.handle[:5]), "handle:"),
    "cached/handle-other-tokens": (lambda c: c.buf.dispatch(np.concatenate([c.x, c.x[:1]]), handle=c.handle),
                                   "handle:"),
    "cached/handle.recv_src_idx-int64": (
        lambda c: c.buf.dispatch(c.x, handle=_handle(c, 3, c.handle[3].astype(np.int64))), "handle.recv_src_idx:"),
    "cached/config-channels": (lambda c: c.buf.dispatch(c.x, handle=c.handle, config=Config(num_sms=4)), "config:"),
    "dispatch/config-2-sms": (lambda c: c.buf.dispatch(c.x, **c.layout, **c.topk, config=Config(num_sms=2)),
                              "config:"),
    # combine
    "combine/x-float32": (lambda c: c.buf.combine(c.recv_x.astype(np.float32), c.handle), "x:"),
    "combine/x-rows": (lambda c: c.buf.combine(np.zeros((c.N + 1, c.H), BF16), c.handle), "x:"),
    "combine/x-fp8-pair": (lambda c: c.buf.combine((c.recv_x, np.ones((c.N, 1), np.float32)), c.handle), "x:"),
    "combine/handle-none": (lambda c: c.buf.combine(c.recv_x, None), "handle:"),
    "combine/handle.rank_prefix_matrix-shape": (
        lambda c: c.buf.combine(c.recv_x, _handle(c, 0, np.zeros((c.R + 1, c.R), np.int32))),
        "handle.rank_prefix_matrix:"),
    "combine/handle.is_token_in_rank-int": (
        lambda c: c.buf.combine(c.recv_x, _handle(c, 4, c.handle[4].astype(np.int32))), "handle.is_token_in_rank:"),
    "combine/handle.send_head-1d": (
        lambda c: c.buf.combine(c.recv_x, _handle(c, 5, c.handle[5][:, 0].copy())), "handle.send_head:"),
    "combine/bias[0]-shape": (lambda c: c.buf.combine(c.recv_x, c.handle, bias=np.zeros((c.T + 1, c.H), BF16)),
                              "bias[0]:"),
    "combine/bias-three": (lambda c: c.buf.combine(c.recv_x, c.handle, bias=(c.bias, c.bias, c.bias)), "bias:"),
    "combine/bias[1]-float32": (lambda c: c.buf.combine(c.recv_x, c.handle, bias=(c.bias, c.bias.astype(np.float32))),
                                "bias[1]:"),
    "combine/topk_weights-rows": (
        lambda c: c.buf.combine(c.recv_x, c.handle, topk_weights=np.zeros((c.N + 1, 3), np.float32)), "topk_weights:"),
    "combine/topk_weights-int": (lambda c: c.buf.combine(c.recv_x, c.handle, topk_weights=c.recv_w.astype(np.int32)),
                                 "topk_weights:"),
    "combine/config-str": (lambda c: c.buf.combine(c.recv_x, c.handle, config="fast"), "config:"),
    # construction and class-level knobs
    "Buffer/backend": (lambda c: Buffer(c.comm, backend="gpu"), "backend:"),
    "Buffer/backend-cuda-without-gpu": (_no_gpu_cuda_backend, "backend"),
    "Buffer/timeout_s": (lambda c: Buffer(c.comm, backend="host", timeout_s=0), "timeout_s:"),
    "Buffer/num_nvl_bytes": (lambda c: Buffer(c.comm, -1, backend="host"), "num_nvl_bytes:"),
    "Buffer/num_ranks_per_node": (lambda c: Buffer(c.comm, backend="host", num_ranks_per_node=c.R + 1),
                                  "num_ranks_per_node:"),
    "Buffer.set_num_sms": (lambda c: Buffer.set_num_sms(5), "new_num_sms:"),
    "Config.num_sms": (lambda c: Config(num_sms=5), "Config.num_sms"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_everywhere_and_buffer_stays_usable(comm, host_buffer, case):
    ctx = _context(comm, host_buffer)
    call, prefix = CASES[case]
    problem = bad_input_problem(lambda: call(ctx), prefix, (ValueError, TypeError, CupyEpError))
    ok = _valid_round_trip(comm, host_buffer)
    assert all_ok(comm, problem is None and ok), f"rank {comm.Get_rank()}: {problem}, valid call ok: {ok}"


def test_calls_after_destroy_raise(comm):
    buf = Buffer(comm, HOST_NVL_BYTES, backend="host")
    ctx = _context(comm, buf)
    buf.destroy()
    calls = [lambda: buf.get_dispatch_layout(ctx.topk_idx, ctx.E),
             lambda: buf.dispatch(ctx.x, **ctx.layout, **ctx.topk),
             lambda: buf.dispatch(ctx.x, handle=ctx.handle),
             lambda: buf.combine(ctx.recv_x, ctx.handle)]
    raised = 0
    for call in calls:
        try:
            call()
        except BufferUnusableError:
            raised += 1
    assert all_ok(comm, raised == len(calls))


def test_unusable_buffer_raises(comm):
    buf = Buffer(comm, HOST_NVL_BYTES, backend="host")
    ctx = _context(comm, buf)
    buf.impl._unusable_reason = "a previous call timed out"
    with pytest.raises(BufferUnusableError, match="timed out"):
        buf.combine(ctx.recv_x, ctx.handle)
    buf.destroy()
