"""torch on the host backend (CPU tensors): ``cupy_ep.torch``'s autograd against the reference (the gradient of a
dispatch is the combine of its gradients, and the reverse, bit for bit), ``cupy_ep.deep_ep``'s names and its
``Buffer`` constructor, and ``import cupy_ep`` never importing torch. Skipped where torch is not installed."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import (BF16, HOST_NVL_BYTES, all_ok, make_inputs, random_bf16, reference_combine,
                           reference_dispatch, same_bytes)

HIDDEN, TOKENS, TOPK, EXPERTS_PER_RANK = 96, 40, 3, 3


def test_importing_cupy_ep_does_not_import_torch():
    code = ("import sys, cupy_ep\n"
            "from cupy_ep import Buffer, Config, EventOverlap\n"
            "Buffer.capture(); Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 64)\n"
            "sys.exit('torch' in sys.modules)\n")
    env = dict(os.environ, CUPY_EP_BACKEND="host")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"torch was imported (or the import failed): {result.stderr[-2000:]}"


def _torch():
    return pytest.importorskip("torch")


def _t(a: np.ndarray):
    torch = _torch()
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def test_deep_ep_names_and_constructor():
    torch = _torch()
    from mpi4py import MPI

    import cupy_ep
    from cupy_ep import deep_ep
    assert deep_ep.topk_idx_t is torch.int64
    assert deep_ep.Config is cupy_ep.Config and deep_ep.EventOverlap is cupy_ep.EventOverlap
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 64) == \
        cupy_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 64)
    for group, comm in ((MPI.COMM_SELF, None), (None, MPI.COMM_SELF)):
        buf = deep_ep.Buffer(group, 1 << 20, comm=comm, backend="host")
        try:
            assert isinstance(buf, deep_ep.Buffer) and isinstance(buf, cupy_ep.Buffer) and buf.backend == "host"
            assert (buf.group, buf.group_size, buf.rank, buf.num_nvl_bytes) == (MPI.COMM_SELF, 1, 0, 1 << 20)
            assert buf.capture().event.query()
        finally:
            buf.destroy()
    with pytest.raises(ValueError, match="^group, comm: pass one"):
        deep_ep.Buffer(MPI.COMM_SELF, comm=MPI.COMM_SELF, backend="host")
    with pytest.raises(TypeError, match="^group: must be a torch.distributed.ProcessGroup, an mpi4py communicator"):
        deep_ep.Buffer("world", backend="host")


def test_deep_ep_buffer_over_a_single_rank_process_group():
    """A process group is accepted and becomes the buffer's group (dispatch over a group of 2 and 4 ranks:
    tests/multirank/test_torch_bootstrap.py under torchrun)."""
    _torch()
    import torch.distributed as dist

    mpi_was_loaded = "mpi4py.MPI" in sys.modules
    from cupy_ep import deep_ep
    if not dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        buf = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=HOST_NVL_BYTES, backend="host")
        try:
            assert (buf.rank, buf.group_size, buf.group) == (0, 1, dist.group.WORLD)
            assert type(buf.comm).__name__ == "TorchComm"
            assert buf.comm.allgather(("rank", 0)) == [("rank", 0)]
            assert "mpi4py.MPI" not in sys.modules or mpi_was_loaded  # the torch path never starts MPI
        finally:
            buf.destroy()
    finally:
        dist.destroy_process_group()


@pytest.mark.mpi(min_size=2)
def test_autograd_dispatch_and_combine_are_each_others_adjoint(comm, host_buffer):
    _torch()  # skips without torch
    import cupy_ep.torch as ep_torch
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(5 + rank)
    num_experts = EXPERTS_PER_RANK * num_ranks
    inp = make_inputs(rng, TOKENS, HIDDEN, TOPK, num_experts, num_ranks, mask_prob=0.2)
    bad = []
    x = _t(inp.x).requires_grad_()
    w = _t(inp.topk_weights).requires_grad_()
    recv_x, recv_idx, recv_w, counts, handle = ep_torch.dispatch(host_buffer, x, _t(inp.topk_idx), w, num_experts)
    ref = reference_dispatch(comm, inp.x, inp.topk_idx, inp.topk_weights, num_experts)
    if not (same_bytes(recv_x, ref.recv_x) and same_bytes(recv_w, ref.recv_topk_weights)
            and counts == ref.num_recv_tokens_per_expert_list and not recv_idx.requires_grad):
        bad.append("dispatch forward")

    # d/dx and d/dw of <recv_x, g_x> + <recv_w, g_w>: the combine of g_x, and of g_w on the owner's slots only
    g_x = random_bf16(rng, (recv_x.shape[0], HIDDEN))
    g_w = rng.standard_normal(recv_w.shape, dtype=np.float32)
    ((recv_x.float() * _t(g_x).float()).sum() + (recv_w * _t(g_w)).sum()).backward()
    owned = np.where(ref.recv_topk_idx >= 0, g_w, np.float32(0))
    want_gx, want_gw = reference_combine(comm, g_x, ref.is_token_in_rank, owned)
    if not same_bytes(x.grad, want_gx):
        bad.append("x.grad")
    if not same_bytes(w.grad, want_gw):
        bad.append("topk_weights.grad")

    # combine: d/dy of <combined, g> is the cached dispatch of g
    y_np = random_bf16(rng, (recv_x.shape[0], HIDDEN))
    y = _t(y_np).requires_grad_()
    combined = ep_torch.combine(host_buffer, y, handle)
    g = random_bf16(rng, (TOKENS, HIDDEN))
    (combined.float() * _t(g).float()).sum().backward()
    want_combined, _ = reference_combine(comm, y_np, ref.is_token_in_rank)
    if not same_bytes(combined, want_combined):
        bad.append("combine forward")
    if not same_bytes(y.grad, reference_dispatch(comm, g, inp.topk_idx, None, num_experts).recv_x):
        bad.append("y.grad")
    assert all_ok(comm, not bad), f"rank {rank}: {bad}"
