"""Autograd over dispatch and combine, for training an MoE layer with torch (``import cupy_ep.torch``; importing
``cupy_ep`` alone never imports torch).

The two calls are each other's adjoint for a fixed routing (the handle):

* ``dispatch`` copies each token to every rank that holds one of its experts, so the gradient of ``x`` is the sum
  of the gradients of those copies: a ``combine`` of ``grad_recv_x``. ``recv_topk_weights[r, k]`` is
  ``topk_weights[t, k]`` on the rank that owns expert ``k`` (0 elsewhere), so the gradient of ``topk_weights`` is
  the combine of ``grad_recv_topk_weights`` with the slots of other ranks' experts zeroed.
* ``combine`` sums the rows of every rank that received a token, so the gradient of each row is the gradient of
  its token: a cached ``dispatch`` of ``grad_combined_x`` with the same handle.

Backward calls are collective like the forward ones: every rank must run the backward pass (they do, when every
rank computes the same graph). Works on both backends: CUDA tensors on the GPU, CPU tensors on the host backend.
Rows travel in bf16 (``x`` must be bf16), so the gradients of ``x`` are bf16 sums, rounded once.
"""
from __future__ import annotations

import torch

__all__ = ["dispatch", "combine", "Dispatch", "Combine"]


class Dispatch(torch.autograd.Function):
    """``recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle`` of a (non-cached)
    dispatch, differentiable in ``x`` and ``topk_weights``; see :func:`dispatch`."""

    @staticmethod
    def forward(ctx, buffer, x, topk_idx, topk_weights, num_experts, config, combine_config):
        x, topk_idx, topk_weights = x.detach(), topk_idx.detach(), topk_weights.detach()
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights, config=config)
        ctx.buffer, ctx.handle, ctx.combine_config, ctx.hidden = buffer, handle, combine_config, x.shape[1]
        ctx.recv_foreign = recv_idx < 0  # slots of other ranks' experts: their weights do not depend on the input
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_w, counts, handle

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_idx, grad_recv_w, *_):
        _, need_x, _, need_w, *_ = ctx.needs_input_grad
        if not (need_x or need_w):
            return (None,) * 7
        if grad_recv_x is None:  # recv_x unused (only the weights reach the loss): the combine still runs on every rank
            grad_recv_x = torch.zeros((ctx.recv_foreign.shape[0], ctx.hidden), dtype=torch.bfloat16,
                                      device=ctx.recv_foreign.device)
        grad_w = None
        if need_w and grad_recv_w is not None:
            grad_w = grad_recv_w.float().masked_fill(ctx.recv_foreign, 0.0).contiguous()
        grad_x, grad_topk_w, _ = ctx.buffer.combine(grad_recv_x.to(torch.bfloat16).contiguous(), ctx.handle,
                                                    topk_weights=grad_w, config=ctx.combine_config)
        return None, grad_x if need_x else None, None, grad_topk_w, None, None, None


class Combine(torch.autograd.Function):
    """``combined_x`` of a combine, differentiable in ``x``; see :func:`combine`."""

    @staticmethod
    def forward(ctx, buffer, x, handle, config, dispatch_config):
        combined_x, _, _ = buffer.combine(x.detach(), handle, config=config)
        ctx.buffer, ctx.handle, ctx.dispatch_config = buffer, handle, dispatch_config
        return combined_x

    @staticmethod
    def backward(ctx, grad_combined_x):
        if not ctx.needs_input_grad[1]:
            return (None,) * 5
        grad_x, *_ = ctx.buffer.dispatch(grad_combined_x.to(torch.bfloat16).contiguous(), handle=ctx.handle,
                                         config=ctx.dispatch_config)
        return None, grad_x, None, None, None


def dispatch(buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
             config=None, combine_config=None):
    """Send each token to the ranks of its top-k experts (collective; the layout is computed here), with autograd.

    Args:
        buffer: a :class:`cupy_ep.Buffer` of the expert-parallel group.
        x: ``[T, H]`` bf16, the tokens (CUDA tensors on the CUDA backend, CPU tensors on the host backend).
        topk_idx: ``[T, K]`` int64 (or int32), expert ids, -1 for none (no gradient).
        topk_weights: ``[T, K]`` float32, the routing weights.
        num_experts: E, all experts (a multiple of the rank count; rank ``r`` owns ``[r*E/R, (r+1)*E/R)``).
        config: the dispatch's :class:`cupy_ep.Config` (default: the buffer's); a cached dispatch of the backward
            pass of :func:`combine` must get the same one (its ``dispatch_config``).
        combine_config: the config of the combine that computes this call's gradients.

    Returns:
        ``(recv_x [N, H] bf16, recv_topk_idx [N, K] (local expert ids, -1: another rank's expert),
        recv_topk_weights [N, K] float32 (0 where recv_topk_idx is -1), num_recv_tokens_per_expert_list (list of
        int), handle)``: rows ordered by (source rank, source token). ``recv_x`` and ``recv_topk_weights`` carry
        gradients back to ``x`` and ``topk_weights``.
    """
    return Dispatch.apply(buffer, x, topk_idx, topk_weights, num_experts, config, combine_config)


def combine(buffer, x: torch.Tensor, handle, config=None, dispatch_config=None) -> torch.Tensor:
    """Sum each token's expert-output rows back on its own rank (collective), with autograd.

    Args:
        buffer: the :class:`cupy_ep.Buffer` of the dispatch that made ``handle``.
        x: ``[N, H]`` bf16, one row per received row of that dispatch (already weighted as the model wants).
        handle: the dispatch's handle.
        config: the combine's :class:`cupy_ep.Config` (default: the buffer's).
        dispatch_config: the config of the cached dispatch that computes this call's gradient (that of the
            dispatch that made ``handle``).

    Returns:
        ``combined_x [T, H]`` bf16: per token the fp32 sum of its rows, rounded once; gradients flow back to ``x``.
    """
    return Combine.apply(buffer, x, handle, config, dispatch_config)

