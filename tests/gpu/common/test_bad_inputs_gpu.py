"""Bad arguments on the CUDA backend: each raises ValueError/TypeError whose message starts with the
argument's name, before any kernel is launched (every rank passes the same bad argument, so no rank is
left waiting), and the same buffer then still gives the reference's answer.

(Written without a GPU at hand; first run by scripts/gpu_check.sh on the GPU machine.)"""
from __future__ import annotations

import types

import numpy as np
import pytest

from cupy_ep import Buffer, Config, handles
from tests.helpers import BF16, all_ok, make_inputs, reference_combine, reference_dispatch, same_bytes


def _gpu(a):
    import cupy
    if isinstance(a, tuple):
        return tuple(_gpu(v) for v in a)
    if a.dtype == BF16:
        return cupy.asarray(a.view(np.uint16)).view(BF16)
    return cupy.asarray(a)


def _context(comm, buf, seed=5):
    import cupy
    rank, R = comm.Get_rank(), comm.Get_size()
    E, T, H = 4 * R, 24 + rank, 256
    inp = make_inputs(np.random.default_rng([seed, rank]), T, H, 3, E, R)
    fp8 = make_inputs(np.random.default_rng([seed, rank]), T, H, 3, E, R, dtype="fp8").x
    x, idx, w = _gpu(inp.x), _gpu(inp.topk_idx), _gpu(inp.topk_weights)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **layout, topk_idx=idx, topk_weights=w)
    return types.SimpleNamespace(
        comm=comm, buf=buf, R=R, E=E, T=T, H=H, x=x, x_np=inp.x, fp8=_gpu(fp8), idx=idx, idx_np=inp.topk_idx,
        w=w, w_np=inp.topk_weights, layout=layout, topk=dict(topk_idx=idx, topk_weights=w), handle=handle,
        recv_x=recv_x, recv_w=recv_w, N=int(recv_x.shape[0]), bias=cupy.zeros((T, H), np.uint16).view(BF16),
        cp=cupy)


def _h(c, index, value):
    h = list(c.handle)
    h[index] = value
    return tuple(h)


CASES = {
    "layout/topk_idx-float": (lambda c: c.buf.get_dispatch_layout(c.idx.astype(c.cp.float32), c.E), "topk_idx:"),
    "layout/topk_idx-host-array": (lambda c: c.buf.get_dispatch_layout(c.idx_np, c.E), "topk_idx:"),
    "layout/topk_idx-too-large": (lambda c: c.buf.get_dispatch_layout(c.idx + c.E, c.E), "topk_idx:"),
    "layout/topk_idx-k33": (lambda c: c.buf.get_dispatch_layout(c.cp.zeros((c.T, 33), c.cp.int64), c.E), "topk_idx:"),
    "layout/num_experts-not-multiple": (lambda c: c.buf.get_dispatch_layout(c.idx, c.E + 1), "num_experts:"),
    "layout/num_experts-too-many": (lambda c: c.buf.get_dispatch_layout(c.idx, 1025 * c.R), "num_experts:"),
    "dispatch/x-float32": (lambda c: c.buf.dispatch(c.x.view(c.cp.uint16).astype(c.cp.float32), **c.layout,
                                                    **c.topk), "x:"),
    "dispatch/x-host-array": (lambda c: c.buf.dispatch(c.x_np, **c.layout, **c.topk), "x:"),
    "dispatch/x-strided": (lambda c: c.buf.dispatch(c.x[:, ::2], **c.layout, **c.topk), "x:"),
    "dispatch/x-8-byte-rows": (lambda c: c.buf.dispatch(c.cp.ascontiguousarray(c.x[:, :4]), **c.layout, **c.topk),
                               "x:"),
    "dispatch/x[1]-scales-shape": (lambda c: c.buf.dispatch((c.fp8[0], c.cp.ones((c.T, 1), c.cp.float32)),
                                                            **c.layout), "x[1]:"),
    "dispatch/x[1]-scales-none": (lambda c: c.buf.dispatch((c.fp8[0], None), **c.layout), "x[1]:"),
    "dispatch/topk_idx-without-weights": (lambda c: c.buf.dispatch(c.x, **c.layout, topk_idx=c.idx), "topk_idx"),
    "dispatch/topk_weights-shape": (lambda c: c.buf.dispatch(c.x, **c.layout, topk_idx=c.idx,
                                                             topk_weights=c.cp.ascontiguousarray(c.w[:, :2])),
                                    "topk_weights:"),
    "dispatch/num_tokens_per_rank-missing": (lambda c: c.buf.dispatch(c.x, **{**c.layout, "num_tokens_per_rank": None}),
                                             "num_tokens_per_rank:"),
    "dispatch/is_token_in_rank-rows": (lambda c: c.buf.dispatch(c.x, **{**c.layout, "is_token_in_rank":
                                                                        c.layout["is_token_in_rank"][:-1].copy()}),
                                       "is_token_in_rank:"),
    "dispatch/expert_alignment-zero": (lambda c: c.buf.dispatch(c.x, **c.layout, **c.topk, expert_alignment=0),
                                       "expert_alignment:"),
    "dispatch/num_worst_tokens-negative": (lambda c: c.buf.dispatch(c.x, **c.layout, **c.topk, num_worst_tokens=-1),
                                           "num_worst_tokens:"),
    "dispatch/config-dict": (lambda c: c.buf.dispatch(c.x, **c.layout, **c.topk, config={"num_sms": 20}), "config:"),
    "dispatch/config-2-sms": (lambda c: c.buf.dispatch(c.x, **c.layout, **c.topk, config=Config(num_sms=2)),
                              "config:"),
    "dispatch/config-too-many-sms": (lambda c: c.buf.dispatch(c.x, **c.layout, **c.topk, config=Config(num_sms=264)),
                                     "config:"),
    "dispatch/config-ring-below-sender-batch": (lambda c: c.buf.dispatch(
        c.x, **c.layout, **c.topk, config=Config(num_sms=24, num_max_nvl_chunked_send_tokens=6,
                                                 num_max_nvl_chunked_recv_tokens=16)), "config:"),
    "dispatch/num_nvl_bytes-too-small": (lambda c: c.buf.dispatch(
        c.x, **c.layout, **c.topk, config=Config(num_sms=24, num_max_nvl_chunked_recv_tokens=1 << 16)),
        "num_nvl_bytes:"),
    "dispatch/allocate_on_comm_stream": (lambda c: c.buf.dispatch(c.x, **c.layout, **c.topk, async_finish=True,
                                                                  allocate_on_comm_stream=True),
                                         "allocate_on_comm_stream:"),
    "cached/topk_idx-given": (lambda c: c.buf.dispatch(c.x, handle=c.handle, **c.topk), "topk_idx"),
    "cached/handle-5-tuple": (lambda c: c.buf.dispatch(c.x, handle=c.handle[:5]), "handle:"),
    "cached/handle-other-num_sms": (lambda c: c.buf.dispatch(c.x, handle=c.handle, config=Config(num_sms=4)),
                                    "handle."),
    "combine/x-float32": (lambda c: c.buf.combine(c.recv_x.view(c.cp.uint16).astype(c.cp.float32), c.handle), "x:"),
    "combine/x-rows": (lambda c: c.buf.combine(c.cp.zeros((c.N + 1, c.H), c.cp.uint16).view(BF16), c.handle), "x:"),
    "combine/handle.send_head-int64": (lambda c: c.buf.combine(c.recv_x, _h(c, 5, c.handle[5].astype(c.cp.int64))),
                                       "handle.send_head:"),
    "combine/bias[0]-shape": (lambda c: c.buf.combine(c.recv_x, c.handle,
                                                      bias=c.cp.zeros((c.T + 1, c.H), c.cp.uint16).view(BF16)),
                              "bias[0]:"),
    "combine/bias-three": (lambda c: c.buf.combine(c.recv_x, c.handle, bias=(c.bias, c.bias, c.bias)), "bias:"),
    "combine/topk_weights-rows": (lambda c: c.buf.combine(c.recv_x, c.handle,
                                                          topk_weights=c.cp.zeros((c.N + 1, 3), c.cp.float32)),
                                  "topk_weights:"),
    "combine/config-str": (lambda c: c.buf.combine(c.recv_x, c.handle, config="fast"), "config:"),
    # the messages that name the real cause (validate.py, shared with the host backend)
    "dispatch/x-python-list": (lambda c: c.buf.dispatch(c.x_np.tolist(), **c.layout, **c.topk), "x: must be an array"),
    "dispatch/topk_idx-rows-unlike-x": (lambda c: c.buf.dispatch(c.x, **c.layout, topk_idx=c.idx[:-1],
                                                                 topk_weights=c.w[:-1]), "topk_idx: has"),
    "dispatch/previous_event-garbage": (lambda c: c.buf.dispatch(c.x, **c.layout, **c.topk, previous_event=object()),
                                        "previous_event:"),
    "combine/previous_event-garbage": (lambda c: c.buf.combine(c.recv_x, c.handle, previous_event="event"),
                                       "previous_event:"),
    "combine/handle-of-another-buffer": (lambda c: c.buf.combine(c.recv_x, handles.DispatchHandle(
        tuple(c.handle), c.buf.buffer_id ^ 1, 1)), "handle: was made by another Buffer"),
    "cached/handle-of-another-buffer": (lambda c: c.buf.dispatch(c.x, handle=handles.DispatchHandle(
        tuple(c.handle), c.buf.buffer_id ^ 1, 1)), "handle: was made by another Buffer"),
    "Buffer/comm-not-a-communicator": (lambda c: Buffer("COMM_WORLD", backend="cuda"), "comm:"),
    "Buffer/low_latency_mode_without_num_rdma_bytes": (lambda c: Buffer(c.comm, backend="cuda", low_latency_mode=True),
                                                       "num_rdma_bytes"),
    "Buffer/low_latency_transport-tcp": (lambda c: Buffer(c.comm, backend="cuda", low_latency_mode=True,
                                                          num_rdma_bytes=1 << 20, low_latency_transport="tcp"),
                                         "low_latency_transport:"),
}


def _valid_round_trip(comm, buf) -> bool:
    c = _context(comm, buf, seed=9)
    want = reference_dispatch(comm, c.x_np, c.idx_np, c.w_np, c.E)
    got_x, _, _ = buf.combine(c.recv_x, c.handle, bias=c.bias)
    want_x, _ = reference_combine(comm, c.recv_x, want.is_token_in_rank, None, c.bias)
    return same_bytes(c.recv_x, want.recv_x) and same_bytes(got_x, want_x)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_on_gpu_raises_and_buffer_stays_usable(comm, gpu_buffer, case):
    import cupy
    call, prefix = CASES[case]
    with cupy.cuda.Device(gpu_buffer.device_id):
        c = _context(comm, gpu_buffer)
        try:
            call(c)
            error = "no exception"
        except (ValueError, TypeError, NotImplementedError) as e:
            error = None if str(e).startswith(prefix) or prefix in str(e).split(":")[0] else f"message: {e}"
        ok = error is None and _valid_round_trip(comm, gpu_buffer)
    assert all_ok(comm, ok), f"rank {comm.Get_rank()}, {case}: {error}"
