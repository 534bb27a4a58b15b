"""A small MoE block trained with expert parallelism (cupy_ep.torch), checked against the same model computed
densely in one process.

    mpiexec -n 4 python examples/moe_layer.py                          # on the GPU (one rank per GPU)
    CUPY_EP_BACKEND=host mpiexec -n 2 python examples/moe_layer.py     # without a GPU: CPU tensors
    torchrun --nproc-per-node 2 examples/moe_layer.py                  # the same under torchrun (gloo)

The block: a router (linear, top-k of the logits, softmax over the k chosen), ``E`` expert MLPs
(``H -> F -> H``, GELU), each rank holding ``E / R`` of them, and the token dispatch / combine between. Every rank
holds the router and its own experts and ``T`` tokens of the batch; the router's gradient is summed over the ranks
(data parallel), the experts' gradients are complete on their rank (every token that chose an expert reached it).

Each step compares the loss and every gradient (router, the local experts, the input tokens) with a dense
computation of the same model on the whole batch (every expert on every token, no communication), within bf16
tolerance (the rows travel in bf16), then takes an SGD step. Exits non-zero on a mismatch on any rank, or when the
loss did not go down.
"""
from __future__ import annotations

import sys

import torch

import cupy_ep
import cupy_ep.torch as ep_torch
from cupy_ep import bootstrap

TOKENS, HIDDEN, FFN, EXPERTS_PER_RANK, TOPK, STEPS, LR = 32, 64, 32, 2, 2, 4, 0.5
RTOL = 1e-2  # relative to the largest magnitude of each compared tensor: a few bf16 roundings (2^-8 each)


def make_params(num_experts: int, generator: torch.Generator) -> dict:
    """The whole model's parameters (float32), the same on every rank (one seed)."""
    def rand(*shape, scale):
        return torch.randn(*shape, generator=generator) * scale
    return {"router": rand(HIDDEN, num_experts, scale=HIDDEN ** -0.5),
            "w1": rand(num_experts, HIDDEN, FFN, scale=HIDDEN ** -0.5),
            "w2": rand(num_experts, FFN, HIDDEN, scale=FFN ** -0.5)}


def route(x: torch.Tensor, router: torch.Tensor):
    """``(topk_idx [T, K] int64, topk_weights [T, K] float32)``: the top-k logits' experts, softmax over them."""
    logits = x @ router
    values, idx = logits.topk(TOPK, dim=1)
    return idx, torch.softmax(values, dim=1)


def expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ w1) @ w2


def moe_expert_parallel(buf, x, router, w1_local, w2_local, num_experts: int) -> torch.Tensor:
    """This rank's tokens through the block: route, dispatch (bf16 rows), the local experts weighted by the routing
    weights, combine. ``w1_local`` / ``w2_local``: this rank's experts, ``[E/R, H, F]`` / ``[E/R, F, H]``."""
    topk_idx, topk_weights = route(x, router)
    recv_x, recv_idx, recv_w, _, handle = ep_torch.dispatch(buf, x.to(torch.bfloat16), topk_idx, topk_weights,
                                                            num_experts)
    rows = recv_x.float()
    out = torch.zeros_like(rows)
    for e in range(w1_local.shape[0]):
        chosen = recv_idx == e                            # [N, K]: the top-k slot naming local expert e, if any
        take = chosen.any(dim=1).nonzero().squeeze(1)
        if take.numel():
            weight = (recv_w * chosen).sum(dim=1)[take]   # the experts of a token are distinct: one slot
            out = out.index_add(0, take, expert(rows[take], w1_local[e], w2_local[e]) * weight[:, None])
    return ep_torch.combine(buf, out.to(torch.bfloat16), handle).float()


def moe_dense(x, router, w1, w2) -> torch.Tensor:
    """The same block on any batch in one process, with the expert-parallel path's bf16 roundings of the rows."""
    topk_idx, topk_weights = route(x, router)
    rows = x.to(torch.bfloat16).float()
    out = torch.zeros_like(rows)
    for k in range(TOPK):
        for e in range(w1.shape[0]):
            take = (topk_idx[:, k] == e).nonzero().squeeze(1)
            if take.numel():
                out = out.index_add(0, take, expert(rows[take], w1[e], w2[e]) * topk_weights[take, k, None])
    return out.to(torch.bfloat16).float()


def close(name: str, got: torch.Tensor, want: torch.Tensor, errors: list) -> None:
    got, want = got.detach().cpu().float(), want.detach().cpu().float()
    scale = max(float(want.abs().max()), 1e-6)
    err = float((got - want).abs().max()) / scale
    if got.shape != want.shape or not err <= RTOL:
        errors.append(f"{name}: max |diff| / max |dense| = {err:.3g} (tolerance {RTOL})")


def main() -> int:
    comm = bootstrap.world()  # MPI.COMM_WORLD, or under torchrun torch.distributed's default group (gloo)
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    num_experts = EXPERTS_PER_RANK * num_ranks
    buf = cupy_ep.Buffer(comm, num_nvl_bytes=cupy_ep.Buffer.get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks))
    device = torch.device("cuda", buf.device_id) if buf.backend == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    gen = torch.Generator().manual_seed(0)
    params = {k: v.to(device) for k, v in make_params(num_experts, gen).items()}
    batch = torch.randn(num_ranks * TOKENS, HIDDEN, generator=gen).to(device)   # the global batch
    target = torch.randn(num_ranks * TOKENS, HIDDEN, generator=gen).to(device)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    local = slice(rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK)
    errors: list[str] = []
    losses = []
    for step in range(STEPS):
        # expert parallel: this rank's tokens and experts; the loss is this rank's share of the global mean
        router = params["router"].clone().requires_grad_()
        w1, w2 = (params[k][local].clone().requires_grad_() for k in ("w1", "w2"))
        x = batch[mine].clone().requires_grad_()
        y = moe_expert_parallel(buf, x, router, w1, w2, num_experts)
        loss = ((y - target[mine]) ** 2).sum() / (num_ranks * TOKENS)
        loss.backward()
        global_loss = bootstrap.allreduce(comm, float(loss.detach()), "sum")
        router_grad = torch.from_numpy(bootstrap.allreduce(comm, router.grad.cpu().numpy(), "sum")).to(device)

        # dense: the same parameters, the whole batch, one process
        d_router, d_w1, d_w2 = (params[k].clone().requires_grad_() for k in ("router", "w1", "w2"))
        d_x = batch.clone().requires_grad_()
        d_loss = ((moe_dense(d_x, d_router, d_w1, d_w2) - target) ** 2).sum() / (num_ranks * TOKENS)
        d_loss.backward()

        close(f"step {step} loss", torch.tensor(global_loss), d_loss, errors)
        close(f"step {step} router grad", router_grad, d_router.grad, errors)
        close(f"step {step} w1 grad", w1.grad, d_w1.grad[local], errors)
        close(f"step {step} w2 grad", w2.grad, d_w2.grad[local], errors)
        close(f"step {step} x grad", x.grad, d_x.grad[mine], errors)
        losses.append(global_loss)

        with torch.no_grad():  # SGD: the router's summed gradient on every rank, each expert on its own rank
            params["router"] -= LR * router_grad
            w1_all = torch.from_numpy(bootstrap.allreduce(comm, _scatter(d_w1.grad, w1.grad, local).cpu().numpy()))
            w2_all = torch.from_numpy(bootstrap.allreduce(comm, _scatter(d_w2.grad, w2.grad, local).cpu().numpy()))
            params["w1"] -= LR * w1_all.to(device)
            params["w2"] -= LR * w2_all.to(device)
    if not losses[-1] < losses[0]:
        errors.append(f"the loss did not go down: {losses}")
    buf.destroy()
    failed = comm.allgather(errors)
    if rank == 0:
        print(f"moe_layer: {num_ranks} ranks, {buf.backend} backend, loss per step "
              + " ".join(f"{v:.5f}" for v in losses))
        for r, errs in enumerate(failed):
            for e in errs:
                print(f"rank {r}: {e}")
        print("moe_layer: OK" if not any(failed) else "moe_layer: MISMATCH")
    return 1 if any(failed) else 0


def _scatter(like: torch.Tensor, local_grad: torch.Tensor, local: slice) -> torch.Tensor:
    """A zero tensor shaped as all experts' ``like`` with this rank's expert gradients in its slots (summed over
    the ranks, every expert's gradient from its own rank)."""
    full = torch.zeros_like(like)
    full[local] = local_grad
    return full


if __name__ == "__main__":
    sys.exit(main())
