"""cupy_ep quick start: one MoE layer's dispatch and combine, checked against the numpy reference.

    mpiexec -n 2 python examples/quickstart.py
    torchrun --nproc-per-node 2 examples/quickstart.py      # the same, over torch.distributed (gloo)

Every rank makes random tokens and a random top-k routing, dispatches the tokens to the ranks that own their
experts, runs a stand-in expert step there and combines the outputs back on the tokens' owners. It runs on the
GPUs when CuPy sees one (rank i on GPU i modulo the visible GPUs), else on the host backend (numpy + MPI).
"""
import ml_dtypes
import numpy as np
import cupy_ep
from cupy_ep import Buffer, bootstrap, reference

BF16 = np.dtype(ml_dtypes.bfloat16)


def expert_step(xp, recv_x, recv_topk_weights):
    """Stand-in for this rank's experts: each received row times the sum of its weights for this rank's experts
    (the weights of other ranks' experts arrive as 0), computed in fp32. ``xp`` is numpy or cupy. CuPy has no
    bfloat16 arithmetic, so the bf16 <-> fp32 conversions are done on the bits."""
    scale = recv_topk_weights[:, 0]
    for k in range(1, recv_topk_weights.shape[1]):
        scale = scale + recv_topk_weights[:, k]
    rows = (recv_x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)   # bf16 -> fp32 is exact
    bits = (rows * scale[:, None]).view(xp.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(xp.uint16).view(BF16)  # fp32 -> bf16, nearest even


comm = bootstrap.world()                     # MPI.COMM_WORLD, or under torchrun torch.distributed's default group
rank, num_ranks = comm.Get_rank(), comm.Get_size()
num_tokens, hidden, num_topk = 512, 2048, 4
num_experts = 8 * num_ranks                  # rank r owns experts [8r, 8r + 8)

buf = Buffer(comm, num_nvl_bytes=Buffer.get_nvl_buffer_size_hint(hidden * 2, num_ranks))
if buf.backend == "cuda":                    # inputs as CuPy arrays (torch tensors work too)
    import cupy as xp
    to_host = xp.asnumpy

    def to_device(a):
        return xp.asarray(a.view(np.uint16)).view(BF16) if a.dtype == BF16 else xp.asarray(a)
else:                                        # the host backend takes numpy arrays
    xp, to_host, to_device = np, np.asarray, np.asarray

# This rank's tokens and routing: num_topk distinct experts per token, about a tenth of the slots empty (-1).
rng = np.random.default_rng(rank)
x_np = rng.standard_normal((num_tokens, hidden), dtype=np.float32).astype(BF16)
topk_idx_np = np.argsort(rng.random((num_tokens, num_experts)), axis=1)[:, :num_topk].astype(np.int64)
topk_idx_np[rng.random((num_tokens, num_topk)) < 0.1] = -1
topk_weights_np = rng.random((num_tokens, num_topk), dtype=np.float32)
x, topk_idx, topk_weights = to_device(x_np), to_device(topk_idx_np), to_device(topk_weights_np)

num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert, handle, _ = buf.dispatch(
    x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
    is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert)
expert_out = expert_step(xp, recv_x, recv_topk_weights)
combined_x, _, _ = buf.combine(expert_out, handle)

# The same layer from cupy_ep.reference (numpy), given every rank's inputs.
inputs = comm.allgather((x_np, topk_idx_np, topk_weights_np))
xs, idxs, weights = ([g[i] for g in inputs] for i in range(3))
want = [reference.dispatch(xs, idxs, weights, num_experts, r) for r in range(num_ranks)]
want_x, _ = reference.combine([expert_step(np, w.recv_x, w.recv_topk_weights) for w in want],
                              [w.is_token_in_rank for w in want], rank)
mine = want[rank]
ok = (np.array_equal(to_host(recv_x).view(np.uint16), mine.recv_x.view(np.uint16))
      and np.array_equal(to_host(recv_topk_idx), mine.recv_topk_idx)
      and np.array_equal(to_host(recv_topk_weights), mine.recv_topk_weights)
      and list(num_recv_tokens_per_expert) == mine.num_recv_tokens_per_expert_list
      and np.array_equal(to_host(combined_x).view(np.uint16), want_x.view(np.uint16)))
ok = bool(bootstrap.allreduce(comm, int(ok), "min"))
rows = bootstrap.allreduce(comm, int(recv_x.shape[0]), "sum")
buf.destroy()
if rank == 0:
    print(f"cupy_ep {cupy_ep.__version__}, {buf.backend} backend, {num_ranks} ranks: {rows} token rows dispatched and "
          f"combined, {'bit-exact against' if ok else 'MISMATCH against'} cupy_ep.reference")
raise SystemExit(0 if ok else 1)
