"""The host backend (numpy + MPI) against the reference, bit for bit, under mpiexec -n 2 / -n 4.

Every rank builds its own random inputs (same seed everywhere, rank-dependent stream), runs the
collective calls, and compares with the reference computed from all ranks' inputs (all-gathered). Every
rank reaches the same verdict through ``all_ok`` so no rank is left waiting in a collective.
"""
from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

from cupy_ep import Buffer, Config, gpu_available, reference
from tests.helpers import (HOST_NVL_BYTES, all_ok, make_inputs, random_bf16, reference_combine, reference_dispatch,
                           same_bytes, to_numpy)

pytestmark = pytest.mark.mpi(min_size=2)

# name: tokens, hidden, topk, experts (total, rounded to a multiple of R), and options
CASES = {
    "basic": dict(tokens=64, hidden=256, topk=4, experts=16),
    "int32-align128": dict(tokens=128, hidden=128, topk=8, experts=64, idx_dtype=np.int32, alignment=128),
    "fp8": dict(tokens=100, hidden=512, topk=6, experts=32, dtype="fp8"),
    "fp8-colmajor-scales-h7168": dict(tokens=24, hidden=7168, topk=8, experts=256, dtype="fp8",
                                      colmajor_scales=True),
    "zero-tokens-on-rank1": dict(tokens=37, hidden=64, topk=2, experts=8, zero_tokens_rank=1),
    "zero-tokens-everywhere": dict(tokens=0, hidden=64, topk=3, experts=8),
    "skew-to-rank0-k8": dict(tokens=200, hidden=128, topk=8, experts=16, skew=0),
    "skew-to-last-rank": dict(tokens=90, hidden=32, topk=2, experts=8, skew=-1, bias=2),
    "masked-duplicates": dict(tokens=150, hidden=96, topk=5, experts=12, mask_prob=0.3, duplicates=True),
    "all-masked": dict(tokens=20, hidden=64, topk=4, experts=8, mask_prob=1.0),
    "hidden16-top1-2experts": dict(tokens=300, hidden=16, topk=1, experts=2),
    "hidden7168": dict(tokens=256, hidden=7168, topk=8, experts=256, bias=2),
    "tokens2048": dict(tokens=2048, hidden=128, topk=8, experts=128, alignment=32, bias=1),
    "uneven-tokens-align7": dict(tokens=50, hidden=48, topk=3, experts=24, per_rank_extra=29, alignment=7),
    "no-topk": dict(tokens=80, hidden=64, topk=3, experts=8, with_topk=False, bias=1),
    "num-worst-tokens": dict(tokens=70, hidden=64, topk=4, experts=16, worst=True, bias=2),
    "num-worst-fp8-int32": dict(tokens=40, hidden=256, topk=2, experts=8, worst=True, dtype="fp8",
                                idx_dtype=np.int32),
    "one-channel": dict(tokens=33, hidden=64, topk=3, experts=8, num_sms=4),
    "three-channels": dict(tokens=31, hidden=64, topk=3, experts=8, num_sms=6, bias=1),
}


def _run_case(comm, buf, seed, tokens, hidden, topk, experts, dtype="bf16", idx_dtype=np.int64, skew=None,
              mask_prob=0.0, duplicates=False, zero_tokens_rank=None, per_rank_extra=0, alignment=1,
              with_topk=True, worst=False, bias=0, num_sms=None, colmajor_scales=False, zero_copy=False):
    """Layout, dispatch, cached dispatch and combine (``zero_copy``: the dispatch's and the combine's flag); returns a
    list of what differed on this rank."""
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    num_experts = max(1, experts // num_ranks) * num_ranks
    num_tokens = 0 if rank == zero_tokens_rank else tokens + per_rank_extra * rank
    rng = np.random.default_rng([seed, rank])
    skew_rank = None if skew is None else skew % num_ranks
    inp = make_inputs(rng, num_tokens, hidden, topk, num_experts, num_ranks, skew_to_rank=skew_rank,
                      dtype=dtype, mask_prob=mask_prob, duplicates=duplicates)
    x = inp.x
    if colmajor_scales:
        x = (x[0], np.asfortranarray(x[1]))
    topk_idx = inp.topk_idx.astype(idx_dtype)
    config = Config(num_sms=num_sms) if num_sms else None
    num_channels = (config or buf.get_dispatch_config(num_ranks)).intranode_dispatch_channels(num_ranks)
    bad = []

    def check(name, got, want):
        if not (same_bytes(got, want) if isinstance(want, np.ndarray) else got == want):
            bad.append(name)

    # layout
    layout = buf.get_dispatch_layout(topk_idx, num_experts)
    want_layout = reference.get_dispatch_layout(topk_idx, num_experts, num_ranks, buf.num_ranks_per_node)
    for name, got, want in zip(("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
                                "is_token_in_rank"), layout[:4], want_layout):
        check(f"layout.{name}", got, want)
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = layout

    # dispatch
    kwargs = dict(topk_idx=topk_idx, topk_weights=inp.topk_weights) if with_topk else {}
    worst = sum(comm.allgather(num_tokens)) if worst else 0
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, expert_alignment=alignment, num_worst_tokens=worst,
        config=config, zero_copy=zero_copy, **kwargs)
    want = reference_dispatch(comm, x, topk_idx, inp.topk_weights if with_topk else None, num_experts,
                              alignment, num_channels)
    num_real = want.recv_src_idx.shape[0]
    rows = worst or num_real
    data = recv_x[0] if dtype == "fp8" else recv_x
    check("recv_x.shape", data.shape[0], rows)
    check("recv_x", data[:num_real], want.recv_x)
    if dtype == "fp8":
        check("recv_x_scales", recv_x[1][:num_real], want.recv_x_scales)
        check("recv_x.dtype", str(data.dtype), "uint8")
    else:
        check("recv_x.dtype", str(data.dtype), "bfloat16")
    if with_topk:
        check("recv_topk_idx", recv_idx[:num_real], want.recv_topk_idx)
        check("recv_topk_idx.dtype", str(recv_idx.dtype), np.dtype(idx_dtype).name)
        check("recv_topk_weights", recv_w[:num_real], want.recv_topk_weights)
        check("recv_topk_idx.tail", bool(np.all(recv_idx[num_real:] == -1)), True)
        check("recv_rows", (recv_idx.shape[0], recv_w.shape[0]), (rows, rows))
    else:
        check("recv_topk", (recv_idx, recv_w), (None, None))
    check("num_recv_tokens_per_expert_list", counts, [] if worst else want.num_recv_tokens_per_expert_list)
    check("event", event.event, None)
    rpm, cpm, rcpm, src_idx, itr, send_head = handle
    check("handle.rank_prefix_matrix", rpm, want.rank_prefix_matrix)
    check("handle.channel_prefix_matrix", cpm, want.channel_prefix_matrix)
    check("handle.recv_channel_prefix_matrix", rcpm, want.recv_channel_prefix_matrix)
    check("handle.recv_src_idx", src_idx[:num_real], want.recv_src_idx)
    check("handle.recv_src_idx.shape", src_idx.shape, (rows,))
    check("handle.is_token_in_rank", itr, want.is_token_in_rank)
    check("handle.send_head", send_head, want.send_head)

    # cached dispatch through the handle (same x) gives the same rows
    cached = buf.dispatch(x, handle=handle, config=config)
    check("cached.rest", cached[1:5], (None, None, None, None))
    if dtype == "fp8":
        check("cached.recv_x", cached[0][0], recv_x[0])
        check("cached.recv_x_scales", cached[0][1], recv_x[1])
    else:
        check("cached.recv_x", cached[0], recv_x)

    # combine: random expert outputs (and biases), unweighted fp32 sum rounded once
    y = random_bf16(rng, (rows, hidden))
    biases = tuple(random_bf16(rng, (num_tokens, hidden)) for _ in range(bias))
    bias_arg = None if bias == 0 else biases[0] if bias == 1 else biases
    handle_copy = [np.copy(a) for a in handle]
    combined_x, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w, bias=bias_arg, config=config,
                                            zero_copy=zero_copy)
    want_x, want_w = reference_combine(comm, y[:num_real], want.is_token_in_rank,
                                       None if recv_w is None else recv_w[:num_real], bias_arg)
    check("combined_x", combined_x, want_x)
    check("combined_x.dtype", str(combined_x.dtype), "bfloat16")
    check("combined_topk_weights", combined_w, want_w)
    check("handle.unchanged", all(same_bytes(a, b) for a, b in zip(handle, handle_copy)), True)
    if with_topk:
        # dispatch zeroes the non-local weights, so the sum rebuilds the original (each slot's weight
        # arrives from exactly one rank; -1 slots from none)
        check("combined_topk_weights==topk_weights", combined_w,
              np.where(inp.topk_idx >= 0, inp.topk_weights, np.float32(0)))
    return bad


@pytest.mark.parametrize("name", list(CASES))
def test_dispatch_combine_matches_reference(comm, host_buffer, name):
    seed = sum(map(ord, name))
    bad = _run_case(comm, host_buffer, seed, **CASES[name])
    assert all_ok(comm, not bad), f"rank {comm.Get_rank()}: {bad}"


@pytest.mark.parametrize("seed", range(12))
def test_random_shapes_and_options(comm, host_buffer, seed):
    """Shapes and options drawn from the seed (the same on every rank; the data differ per rank)."""
    rng = np.random.default_rng(1000 + seed)
    dtype = str(rng.choice(["bf16", "fp8"]))
    options = dict(
        tokens=int(rng.integers(0, 300)), hidden=int(rng.integers(1, 64)) * 16, topk=int(rng.integers(1, 9)),
        experts=int(rng.choice([2, 4, 8, 12, 32, 64, 256])), dtype=dtype,
        idx_dtype=np.int32 if rng.random() < 0.5 else np.int64,
        skew=None if rng.random() < 0.7 else int(rng.integers(0, 8)), mask_prob=float(rng.choice([0, 0.1, 0.5])),
        duplicates=bool(rng.random() < 0.3), zero_tokens_rank=None if rng.random() < 0.7 else 0,
        per_rank_extra=int(rng.integers(0, 20)), alignment=int(rng.choice([1, 2, 16, 128])),
        worst=bool(rng.random() < 0.3), bias=int(rng.integers(0, 3)), num_sms=int(rng.choice([4, 6, 12, 20, 24])),
        colmajor_scales=dtype == "fp8" and rng.random() < 0.5)
    bad = _run_case(comm, host_buffer, seed, **options)
    assert all_ok(comm, not bad), f"rank {comm.Get_rank()}: {bad} with {options}"


def test_tuned_config_sets_the_channel_count(comm, host_buffer, monkeypatch):
    """Without ``config=``, dispatch and combine use the tuned configs for their hidden size."""
    num_ranks, hidden = comm.Get_size(), 64
    path = Path(tempfile.mkdtemp()) / "tuned.json"   # one file per rank
    tuned = {f"{kind}/{num_ranks}/{hidden * 2}": {"num_sms": 6} for kind in ("dispatch", "combine")}
    path.write_text(json.dumps(tuned))
    monkeypatch.setenv("CUPY_EP_TUNED_CONFIG", str(path))
    rng = np.random.default_rng([21, comm.Get_rank()])
    inp = make_inputs(rng, 40, hidden, 2, 2 * num_ranks, num_ranks)
    layout = host_buffer.get_dispatch_layout(inp.topk_idx, 2 * num_ranks)
    recv_x, _, _, _, handle, _ = host_buffer.dispatch(
        inp.x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])
    channels = Config(num_sms=6).intranode_dispatch_channels(num_ranks)   # 2 at every rank count
    want = reference_dispatch(comm, inp.x, inp.topk_idx, None, 2 * num_ranks, num_channels=channels)
    combined_x, _, _ = host_buffer.combine(recv_x, handle)
    want_x, _ = reference_combine(comm, recv_x, want.is_token_in_rank)
    ok = (channels == 2 and handle[1].shape == (num_ranks, 2) and same_bytes(handle[1], want.channel_prefix_matrix)
          and same_bytes(handle[5], want.send_head) and same_bytes(combined_x, want_x))
    assert all_ok(comm, ok)


def test_check_values_off_gives_the_same_answers(comm):
    buf = Buffer(comm, HOST_NVL_BYTES, backend="host", check_values=False)
    try:
        bad = _run_case(comm, buf, 31, tokens=90, hidden=64, topk=4, experts=16, mask_prob=0.2, bias=2, worst=True)
    finally:
        buf.destroy()
    assert all_ok(comm, not bad), bad


def test_repeated_calls_on_one_buffer(comm, host_buffer):
    """Several dispatch/combine rounds with changing shapes on the same buffer."""
    bad = []
    for seed, (tokens, hidden, topk) in enumerate([(10, 64, 2), (0, 128, 3), (77, 32, 8), (5, 64, 1)]):
        bad += _run_case(comm, host_buffer, seed, tokens, hidden, topk, experts=16)
    assert all_ok(comm, not bad), bad


def test_zero_copy_flag_same_answers_and_checked(comm, host_buffer):
    """``zero_copy=True`` (a GPU fast path) gives the same values on the host backend, and a non-bool is refused
    on every rank before anything collective."""
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng([11, rank])
    inp = make_inputs(rng, 40, 64, 3, 4 * num_ranks, num_ranks)
    layout = host_buffer.get_dispatch_layout(inp.topk_idx, 4 * num_ranks)
    kwargs = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                  topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)
    plain = host_buffer.dispatch(inp.x, **kwargs)
    zc = host_buffer.dispatch(inp.x, zero_copy=True, **kwargs)
    ok = all(same_bytes(a, b) for a, b in zip(plain[:3], zc[:3]))
    ok &= same_bytes(host_buffer.combine(plain[0], plain[4])[0], host_buffer.combine(zc[0], zc[4], zero_copy=True)[0])
    for call in (lambda: host_buffer.dispatch(inp.x, zero_copy="yes", **kwargs),
                 lambda: host_buffer.combine(plain[0], plain[4], zero_copy=1)):
        try:
            call()
            ok = False
        except TypeError as e:
            ok &= "zero_copy" in str(e)
    assert all_ok(comm, ok)


def test_bf16_round_trip_is_exact(comm, host_buffer):
    """Tokens routed to exactly one rank come back bit-identical (one contribution, exact in fp32)."""
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng([7, rank])
    inp = make_inputs(rng, 64, 128, 2, 4 * num_ranks, num_ranks, skew_to_rank=(rank + 1) % num_ranks)
    layout = host_buffer.get_dispatch_layout(inp.topk_idx, 4 * num_ranks)
    recv_x, _, recv_w, _, handle, _ = host_buffer.dispatch(
        inp.x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
        topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)
    combined_x, combined_w, _ = host_buffer.combine(recv_x, handle, topk_weights=recv_w)
    assert all_ok(comm, same_bytes(combined_x, inp.x) and same_bytes(combined_w, inp.topk_weights))


def test_rdma_rank_counts_with_num_ranks_per_node(comm):
    """``num_ranks_per_node`` < R gives per-node counts, as the reference."""
    num_ranks = comm.Get_size()
    per_node = 2 if num_ranks % 2 == 0 and num_ranks > 2 else 1
    buf = Buffer(comm, backend="host", num_ranks_per_node=per_node)
    try:
        rng = np.random.default_rng([3, comm.Get_rank()])
        inp = make_inputs(rng, 40, 64, 4, 4 * num_ranks, num_ranks, mask_prob=0.2)
        got = buf.get_dispatch_layout(inp.topk_idx, 4 * num_ranks)
        want = reference.get_dispatch_layout(inp.topk_idx, 4 * num_ranks, num_ranks, per_node)
        ok = got[1] is not None and all(same_bytes(g, w) for g, w in zip(got[:4], want))
    finally:
        buf.destroy()
    assert all_ok(comm, ok)


def test_auto_backend_is_host_and_warns_on_rank0(comm):
    """Without a GPU, ``Buffer(comm)`` runs on the host backend, and rank 0 warns once."""
    if gpu_available():
        pytest.skip("a GPU is visible here: Buffer(comm) picks the CUDA backend")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buf = Buffer(comm)
    try:
        ok = isinstance(buf, Buffer) and buf.backend == "host"
        warned = any("host" in str(w.message) for w in caught)
        ok = ok and warned == (comm.Get_rank() == 0)
        forced = Buffer(comm, backend="host")
        ok = ok and isinstance(forced, Buffer)
        forced.destroy()
    finally:
        buf.destroy()
    assert all_ok(comm, ok)


def test_destroy_is_collective_and_idempotent(comm):
    buf = Buffer(comm, backend="host")
    buf.destroy()
    buf.destroy()
    with Buffer(comm, backend="host") as other:
        assert other.backend == "host"
    assert all_ok(comm, other.impl._destroyed)


def test_fp8_e4m3_dtype_comes_back(comm, host_buffer):
    """FP8 given as ml_dtypes.float8_e4m3fn comes back with that dtype (raw bytes unchanged)."""
    num_ranks = comm.Get_size()
    rng = np.random.default_rng([11, comm.Get_rank()])
    inp = make_inputs(rng, 30, 128, 2, 2 * num_ranks, num_ranks, dtype="fp8")
    x = (inp.x[0].view(reference.float8_e4m3), inp.x[1])
    layout = host_buffer.get_dispatch_layout(inp.topk_idx, 2 * num_ranks)
    (recv_data, recv_scales), *_ = host_buffer.dispatch(
        x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])
    want = reference_dispatch(comm, inp.x, inp.topk_idx, None, 2 * num_ranks)
    ok = (recv_data.dtype == reference.float8_e4m3 and same_bytes(recv_data, want.recv_x)
          and same_bytes(to_numpy(recv_scales), want.recv_x_scales))
    assert all_ok(comm, ok)
