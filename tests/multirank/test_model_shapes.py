"""Every model shape of cupy_ep.tools.models in every mode of the host backend, against the reference, under
mpiexec -n 2 / -n 4.

The experts, top-k and hidden size are the published ones; the token counts are a few per rank, so that the
suite stays fast. Normal mode: layout, dispatch (bf16, FP8, zero-copy), the cached dispatch and combine, inside one
node and over ranks of one GPU per node (internode). Low-latency mode: dispatch (bf16, FP8) and combine, with the
receive hooks and with the zero-copy combine buffer. Every rank reaches the same verdict through ``all_ok``.

Beside the presets, two shapes at the kernels' limits run in the same modes: top-32 (the low-latency top-k
limit, ``reference.LOW_LATENCY_MAX_TOPK``) and 1024 experts per rank (``config.MAX_LOCAL_EXPERTS``), with the
expert count scaled by the rank count so that every rank owns that many. Low-latency mode takes at most
``config.LL_MAX_EXPERTS`` experts in all (4096: 1024 per rank up to 4 ranks); past that (at 5 ranks and more)
the test checks that it refuses, naming the argument. One expert per rank more than the limit is refused in both
modes.
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


# name: experts per rank, top-k, hidden. Small hidden sizes and the few tokens of TOKENS keep them fast; the
# hidden sizes are multiples of 512 (the FP8 low-latency dispatch's unit, validate.py; 128 elsewhere).
EDGE_SHAPES = {"top32": (64, 32, 512), "local-experts-1024": (config.MAX_LOCAL_EXPERTS, 8, 512)}


def _edge_shape(name, num_ranks):
    """The :class:`models.Shape` of ``EDGE_SHAPES[name]`` over ``num_ranks`` ranks."""
    local, topk, hidden = EDGE_SHAPES[name]
    return models.Shape(name, local * num_ranks, topk, hidden)


def _normal_mode_case(comm, shape, mode):
    """Layout, dispatch, cached dispatch and combine of ``shape`` in normal ``mode``; returns what differed."""
    opts = dict(NORMAL_MODES[mode])
    per_node = opts.pop("per_node", None)
    buf = Buffer(comm, HOST_NVL_BYTES, HOST_RDMA_BYTES if per_node else 0, backend="host",
                 num_ranks_per_node=per_node)
    try:
        return normal._run_case(comm, buf, sum(map(ord, shape.name + mode)), TOKENS, shape.hidden, shape.topk,
                                shape.experts, **opts)
    finally:
        buf.destroy()


@pytest.mark.parametrize("mode", list(NORMAL_MODES))
@pytest.mark.parametrize("model", SHAPES)
def test_normal_mode_matches_reference(comm, model, mode):
    bad = _normal_mode_case(comm, models.MODELS[model], mode)
    assert all_ok(comm, not bad), f"rank {comm.Get_rank()}: {bad}"


@pytest.mark.parametrize("mode", list(NORMAL_MODES))
@pytest.mark.parametrize("name", list(EDGE_SHAPES))
def test_normal_mode_edge_shape_matches_reference(comm, name, mode):
    shape = _edge_shape(name, comm.Get_size())
    assert shape.experts // comm.Get_size() <= config.MAX_LOCAL_EXPERTS and shape.topk <= config.MAX_TOPK
    bad = _normal_mode_case(comm, shape, mode)
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


def _low_latency_case(comm, shape, mode):
    """Low-latency dispatch and combine of ``shape`` in ``mode``; returns what differed on this rank."""
    opts = dict(LL_MODES[mode])
    hook, zero_copy = opts.pop("hook", False), opts.pop("zero_copy", False)
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    local = shape.experts // num_ranks
    seed = sum(map(ord, shape.name + mode))
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
    return bad


@pytest.mark.parametrize("mode", list(LL_MODES))
@pytest.mark.parametrize("model", SHAPES)
def test_low_latency_matches_reference(comm, model, mode):
    bad = _low_latency_case(comm, models.MODELS[model], mode)
    assert all_ok(comm, not bad), f"rank {comm.Get_rank()}: {bad}"


@pytest.mark.parametrize("mode", list(LL_MODES))
@pytest.mark.parametrize("name", list(EDGE_SHAPES))
def test_low_latency_edge_shape_matches_reference(comm, name, mode):
    """Within ``config.LL_MAX_EXPERTS`` the shape matches the reference; beyond it (1024 experts per rank over
    more than 4 ranks) the dispatch refuses it, naming ``num_experts``."""
    shape = _edge_shape(name, comm.Get_size())
    assert shape.topk <= reference.LOW_LATENCY_MAX_TOPK
    if shape.experts > config.LL_MAX_EXPERTS:
        _check_too_many_low_latency_experts(comm, shape)
        return
    bad = _low_latency_case(comm, shape, mode)
    assert all_ok(comm, not bad), f"rank {comm.Get_rank()}: {bad}"


def _check_too_many_low_latency_experts(comm, shape):
    x, topk_idx, _, num_experts = ll._inputs(comm, 0, TOKENS, shape.hidden, shape.topk,
                                             shape.experts // comm.Get_size())
    buf = Buffer(comm, HOST_NVL_BYTES, HOST_RDMA_BYTES, low_latency_mode=True, backend="host")
    try:
        with pytest.raises(ValueError, match=f"num_experts: the low-latency kernels support up to "
                                             f"{config.LL_MAX_EXPERTS} experts, got {num_experts}"):
            buf.low_latency_dispatch(x, topk_idx, 8, num_experts)
    finally:
        buf.destroy()


@pytest.mark.parametrize("low_latency", [False, True], ids=["normal", "low-latency"])
def test_one_expert_per_rank_past_the_limit_is_refused(comm, low_latency):
    """``config.MAX_LOCAL_EXPERTS`` + 1 experts per rank: both modes refuse, naming ``num_experts`` and the limit."""
    local = config.MAX_LOCAL_EXPERTS + 1
    x, topk_idx, _, num_experts = ll._inputs(comm, 1, TOKENS, 512, 8, local)
    buf = Buffer(comm, HOST_NVL_BYTES, HOST_RDMA_BYTES if low_latency else 0, low_latency_mode=low_latency,
                 backend="host")
    try:
        with pytest.raises(ValueError, match=f"num_experts: {local} experts per rank exceed the limit "
                                             f"{config.MAX_LOCAL_EXPERTS}"):
            if low_latency:
                buf.low_latency_dispatch(x, topk_idx, 8, num_experts)
            else:
                buf.get_dispatch_layout(topk_idx, num_experts)
    finally:
        buf.destroy()


def test_every_shape_is_within_every_modes_limits():
    """The limits the host backend shares with the CUDA one (validate.py, config.py) admit every model shape: top-k
    within both modes' (low-latency up to 32), experts per rank within MAX_LOCAL_EXPERTS at one rank and more."""
    for shape in models.MODELS.values():
        assert shape.topk <= min(config.MAX_TOPK, reference.LOW_LATENCY_MAX_TOPK)
        assert shape.experts <= config.LL_MAX_EXPERTS and shape.experts <= config.MAX_LOCAL_EXPERTS
        assert config.low_latency_topk_bound(shape.topk) >= shape.topk


def test_edge_shapes_sit_at_the_limits():
    """The edge shapes are the largest top-k of low-latency mode and the most experts per rank, so that they test
    the documented limits (top-k 32, 1024 local experts) and follow them if those move."""
    assert EDGE_SHAPES["top32"][1] == reference.LOW_LATENCY_MAX_TOPK == config.MAX_TOPK == 32
    assert EDGE_SHAPES["local-experts-1024"][0] == config.MAX_LOCAL_EXPERTS == 1024
    assert config.low_latency_topk_bound(EDGE_SHAPES["top32"][1]) == 32
