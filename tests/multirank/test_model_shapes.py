"""Every model shape of cupy_ep.tools.models in every mode of the host backend, against the reference, under
mpiexec -n 2 / -n 4.

The experts, top-k and hidden size are the published ones; the token counts are a few per rank, so that the
suite stays fast. Normal mode: layout, dispatch (bf16, FP8, zero-copy), the cached dispatch and combine, inside one
node and over ranks of one GPU per node (internode). Low-latency mode: dispatch (bf16, FP8) and combine, with the
receive hooks and with the zero-copy combine buffer. Every rank reaches the same verdict through ``all_ok``.
"""
from __future__ import annotations

import numpy as np
import pytest

from cupy_ep import config, reference
from cupy_ep import Buffer
from cupy_ep.tools import models
from tests.multirank import test_host_backend as normal
from tests.multirank import test_host_low_latency as ll
from tests.helpers import BF16, HOST_NVL_BYTES, HOST_RDMA_BYTES, all_ok, gather_all, random_bf16, same_bytes

pytestmark = pytest.mark.mpi(min_size=2)

SHAPES = list(models.MODELS)
TOKENS = 5  # per rank (the low-latency inputs give rank r 3 r fewer, so the ranks differ and some send none)
NORMAL_MODES = {"bf16": {}, "fp8": dict(dtype="fp8"), "zero-copy": dict(zero_copy=True),
                "internode": dict(per_node=1)}
LL_MODES = {"bf16": {}, "fp8": dict(use_fp8=True), "fp8-ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True),
            "hook": dict(hook=True), "zero-copy": dict(zero_copy=True)}


@pytest.mark.parametrize("mode", list(NORMAL_MODES))
@pytest.mark.parametrize("model", SHAPES)
def test_normal_mode_matches_reference(comm, model, mode):
    shape, opts = models.MODELS[model], dict(NORMAL_MODES[mode])
    per_node = opts.pop("per_node", None)
    buf = Buffer(comm, HOST_NVL_BYTES, HOST_RDMA_BYTES if per_node else 0, backend="host",
                 num_ranks_per_node=per_node)
    try:
        bad = normal._run_case(comm, buf, sum(map(ord, model + mode)), TOKENS, shape.hidden, shape.topk,
                               shape.experts, **opts)
    finally:
        buf.destroy()
    assert all_ok(comm, not bad), f"rank {comm.Get_rank()}: {bad}"


def _sparse_expert_outputs(comm, seed, counts, shape_lrh):
    """Every rank's expert outputs ``[L, R*M, H]`` bf16 as the reference reads them: random in the rows each local
    expert received (``counts[e]`` of rank r's), zero elsewhere. Only the received rows are exchanged (the whole
    arrays are tens of MB at these shapes); zero pages are never touched."""
    rng = np.random.default_rng([seed, 99, comm.Get_rank()])
    rows = [random_bf16(rng, (int(c), shape_lrh[2])) for c in counts]
    ys = []
    for theirs in gather_all(comm, rows):
        y = np.zeros(shape_lrh, BF16)
        for e, block in enumerate(theirs):
            y[e, :block.shape[0]] = block
        ys.append(y)
    return ys


@pytest.mark.parametrize("mode", list(LL_MODES))
@pytest.mark.parametrize("model", SHAPES)
def test_low_latency_matches_reference(comm, model, mode):
    shape, opts = models.MODELS[model], dict(LL_MODES[mode])
    hook, zero_copy = opts.pop("hook", False), opts.pop("zero_copy", False)
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    local = shape.experts // num_ranks
    seed = sum(map(ord, model + mode))
    max_tokens = 8  # >= TOKENS; R * M a multiple of 4 (DeepEP's TMA rule, validate.py)
    cast = dict(use_fp8=False, round_scale=False, use_ue8m0=False) | opts
    x, topk_idx, topk_weights, num_experts = ll._inputs(comm, seed, TOKENS, shape.hidden, shape.topk, local)
    assert num_experts == shape.experts and topk_idx.shape[1] == shape.topk
    buf = Buffer(comm, HOST_NVL_BYTES, HOST_RDMA_BYTES, low_latency_mode=True, backend="host")
    bad = []
    try:
        got = buf.low_latency_dispatch(x, topk_idx, max_tokens, num_experts, return_recv_hook=hook, **cast)
        if hook:
            got[4]()
        want = ll._want_dispatch(comm, x, topk_idx, max_tokens, num_experts, **cast)
        ll._check_dispatch(bad, "dispatch.", got, want, max_tokens, shape.hidden, num_experts, cast["use_fp8"],
                           cast["use_ue8m0"])
        ys = _sparse_expert_outputs(comm, seed, want.recv_count, (local, num_ranks * max_tokens, shape.hidden))
        handle = got[2]
        if zero_copy:
            buf.get_next_low_latency_combine_buffer(handle)[:] = ys[rank]
            combined, _, combine_hook = buf.low_latency_combine(None, topk_idx, topk_weights, handle,
                                                                zero_copy=True, return_recv_hook=hook)
        else:
            combined, _, combine_hook = buf.low_latency_combine(ys[rank], topk_idx, topk_weights, handle,
                                                                return_recv_hook=hook)
        if hook:
            combine_hook()
        gathered = gather_all(comm, (topk_idx, topk_weights))
        want_x = reference.low_latency_combine(ys, [g[0] for g in gathered], [g[1] for g in gathered], max_tokens,
                                               num_experts, rank)
        if not (combined.dtype == BF16 and same_bytes(combined, want_x)):
            bad.append("combined_x")
    finally:
        buf.destroy()
    assert all_ok(comm, not bad), f"rank {rank}: {bad}"


def test_every_shape_is_within_every_modes_limits():
    """The limits the host backend shares with the CUDA one (validate.py, config.py) admit every model shape: top-k
    within both modes' (low-latency up to 32), experts per rank within MAX_LOCAL_EXPERTS at one rank and more."""
    for shape in models.MODELS.values():
        assert shape.topk <= min(config.MAX_TOPK, reference.LOW_LATENCY_MAX_TOPK)
        assert shape.experts <= config.LL_MAX_EXPERTS and shape.experts <= config.MAX_LOCAL_EXPERTS
        assert config.low_latency_topk_bound(shape.topk) >= shape.topk
