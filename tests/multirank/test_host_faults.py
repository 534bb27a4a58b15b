"""The host backend's promises when ranks misbehave, under mpiexec -n 2 / -n 4: a rank that never enters a call
(``barrier`` too) or never constructs its Buffer makes the others raise CommTimeoutError within the timeout
(``timeout_s`` or ``CUPY_EP_TIMEOUT_S``); handles carry
the Buffer's id (agreed across ranks) and their dispatch's epoch; in shrink mode a rank that stops calling is
masked and the others finish every later low-latency call within the timeout, bit-exact against the reference with
that rank's experts masked (:func:`cupy_ep.reference.mask_ranks`)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from cupy_ep import CallMismatchError, CommError, CommTimeoutError, reference
from cupy_ep.handles import DispatchHandle, LowLatencyHandle
from cupy_ep import Buffer
from tests.helpers import (BF16, HOST_NVL_BYTES, HOST_RDMA_BYTES, all_ok, make_inputs, random_bf16,
                           refused_after_failure, same_bytes)

pytestmark = pytest.mark.mpi(min_size=2)

TIMEOUT_S = 1.5
SLACK_S = 2.0  # scheduling on a loaded 2-core machine
# shrink mode masks a rank that is late by more than the timeout: long enough that a live but slow rank (a loaded
# machine, the reference computed between calls) is never taken for a stopped one
SHRINK_TIMEOUT_S = 4.0


def _layout_and_topk(buf, rank, num_ranks, seed=1):
    num_experts = 4 * num_ranks
    inp = make_inputs(np.random.default_rng([seed, rank]), 20 + rank, 64, 3, num_experts, num_ranks)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(inp.topk_idx, num_experts)
    return inp, dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                     topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)


@pytest.mark.parametrize("how", ["timeout_s", "env"])
def test_a_rank_that_never_dispatches_makes_rank0_time_out(comm, monkeypatch, how):
    rank = comm.Get_rank()
    if how == "env":
        monkeypatch.setenv("CUPY_EP_TIMEOUT_S", str(TIMEOUT_S))
        buf = Buffer(comm, HOST_NVL_BYTES, backend="host")
    else:
        buf = Buffer(comm, HOST_NVL_BYTES, backend="host", timeout_s=TIMEOUT_S)
    ok = buf.timeout_s == TIMEOUT_S
    inp, kwargs = _layout_and_topk(buf, rank, comm.Get_size())
    if rank == 0:
        start = time.monotonic()
        try:
            buf.dispatch(inp.x, **kwargs)
            ok = False
        except CommTimeoutError as e:
            elapsed = time.monotonic() - start
            ok = ok and TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S and "did not enter dispatch" in str(e)
            ok = ok and e.record["peer"] == 1 and e.record["kernel"] == "dispatch"
        ok = ok and refused_after_failure(rank, lambda: buf.dispatch(inp.x, **kwargs))
    comm.Barrier()
    buf.destroy()  # every rank: the header rank 0 sent is dropped
    assert all_ok(comm, ok)


def test_a_rank_that_never_calls_low_latency_makes_the_others_time_out(comm):
    """Without shrink mode a missing rank fails the low-latency call (the buffer is then unusable)."""
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    buf = Buffer(comm, 0, HOST_RDMA_BYTES, low_latency_mode=True, backend="host", timeout_s=TIMEOUT_S)
    x = random_bf16(np.random.default_rng([2, rank]), (4, 128))
    idx = np.zeros((4, 1), np.int64)
    ok = True
    if rank != num_ranks - 1:
        start = time.monotonic()
        try:
            buf.low_latency_dispatch(x, idx, 8, 2 * num_ranks, use_fp8=False)
            ok = False
        except CommTimeoutError as e:
            ok = time.monotonic() - start < TIMEOUT_S + SLACK_S and e.record["peer"] == num_ranks - 1
    comm.Barrier()
    buf.destroy()
    assert all_ok(comm, ok)


def test_a_rank_that_calls_barrier_late_makes_the_others_time_out(comm):
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    late = num_ranks - 1
    buf = Buffer(comm, HOST_NVL_BYTES, backend="host", timeout_s=TIMEOUT_S)
    problems = []
    if rank != late:
        start = time.monotonic()
        try:
            buf.barrier()
            problems.append("barrier returned")
        except CommTimeoutError as e:
            elapsed = time.monotonic() - start
            if not TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S:
                problems.append(f"raised after {elapsed:.2f} s")
            if "did not enter barrier" not in str(e) or e.record["peer"] != late or e.record["kernel"] != "barrier":
                problems.append(f"error: {e}")
        if not refused_after_failure(rank, buf.barrier):
            problems.append("usable after the timeout")
        comm.Barrier()  # the late rank comes after this
    else:
        comm.Barrier()  # (a collective of comm only: the Buffer's barrier runs on its private duplicate)
        start = time.monotonic()
        buf.barrier()  # the others' headers are here: it passes at once, and leaves none of its own unmatched
        if time.monotonic() - start > SLACK_S:
            problems.append(f"the late barrier took {time.monotonic() - start:.2f} s")
    buf.destroy()  # every rank, within the timeout: the headers nobody took are dropped
    assert all_ok(comm, not problems), f"rank {rank}: {problems}"


def test_a_rank_that_constructs_its_buffer_late_makes_the_others_constructors_time_out(comm):
    """The constructor's exchanges are timed: the ranks present raise CommTimeoutError within the timeout, and the
    late rank, which then finds nobody, raises too (within the timeout) instead of waiting alone."""
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    late, tag = num_ranks - 1, 71
    problems = []
    if rank == late:
        for r in range(num_ranks - 1):  # point-to-point: the others' constructors gave up (no collective of comm
            comm.recv(source=r, tag=tag)  # may come between theirs and this rank's)
    start = time.monotonic()
    try:
        Buffer(comm, HOST_NVL_BYTES, backend="host", timeout_s=TIMEOUT_S)
        problems.append("the constructor returned")
    except CommTimeoutError as e:
        elapsed = time.monotonic() - start
        if rank != late and not TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S:
            problems.append(f"raised after {elapsed:.2f} s")
        if rank == late and not elapsed < TIMEOUT_S + SLACK_S:
            problems.append(f"the late rank raised after {elapsed:.2f} s")
        if "did not construct the Buffer" not in str(e) or e.record["kernel"] != "construct":
            problems.append(f"error: {e}")
        if rank == late and e.record.get("peer") != 0:  # the late rank knows who did not answer it
            problems.append(f"record: {e.record}")
    if rank != late:
        comm.send(None, dest=late, tag=tag)
    assert all_ok(comm, not problems), f"rank {rank}: {problems}"
    # the communicator is still fine for Buffers every rank constructs
    with Buffer(comm, HOST_NVL_BYTES, backend="host", timeout_s=30) as buf:
        buf.barrier()


def test_a_rank_a_call_ahead_raises_call_mismatch_and_the_buffer_stays_usable(comm, host_buffer):
    rank = comm.Get_rank()
    inp, kwargs = _layout_and_topk(host_buffer, rank, comm.Get_size())
    recv_x, _, _, _, handle, _ = host_buffer.dispatch(inp.x, **kwargs)
    ok = True
    try:
        if rank == 1:
            host_buffer.combine(recv_x, handle)
        else:
            host_buffer.dispatch(inp.x, **kwargs)
        ok = False
    except CallMismatchError as e:
        want = "combine" if rank != 1 else "dispatch"
        ok = isinstance(e, CommError) and f"is in {want}" in str(e) and e.record["in_step"]
    # the ranks consumed each other's headers: the next calls pair as usual
    again = host_buffer.dispatch(inp.x, **kwargs)
    ok = ok and same_bytes(again[0], recv_x)
    assert all_ok(comm, ok)


def test_handles_are_tuples_with_buffer_id_and_epoch(comm, host_buffer):
    rank = comm.Get_rank()
    inp, kwargs = _layout_and_topk(host_buffer, rank, comm.Get_size())
    _, _, _, _, first, _ = host_buffer.dispatch(inp.x, **kwargs)
    _, _, _, _, second, _ = host_buffer.dispatch(inp.x, **kwargs)
    rank_prefix_matrix, _, _, recv_src_idx, is_token_in_rank, send_head = first  # DeepEP's unpacking
    ok = isinstance(first, DispatchHandle) and isinstance(first, tuple) and len(first) == 6
    ok = ok and second.epoch > first.epoch and first.buffer_id == host_buffer.buffer_id
    ok = ok and is_token_in_rank is kwargs["is_token_in_rank"]
    ids = comm.allgather((host_buffer.buffer_id, first.epoch))
    ok = ok and len(set(ids)) == 1  # the same id and epoch on every rank
    with Buffer(comm, HOST_NVL_BYTES, backend="host") as other:
        ok = ok and other.buffer_id != host_buffer.buffer_id
    # a plain tuple of the items still works (its origin is not known)
    got, _, _ = host_buffer.combine(np.zeros((recv_src_idx.shape[0], 64), BF16), tuple(first))
    ok = ok and not np.asarray(got, dtype=np.float32).any()
    assert all_ok(comm, ok)


# ---- shrink mode -------------------------------------------------------------------------------------------
M, H, TOPK = 16, 128, 3


def _ll_inputs(step, r, num_ranks):
    """Rank r's low-latency inputs at ``step`` (every rank can make every rank's: the reference needs them)."""
    num_experts = 2 * num_ranks
    rng = np.random.default_rng([40 + step, r])
    inp = make_inputs(rng, 10 + r, 16, TOPK, num_experts, num_ranks, mask_prob=0.1)
    x = random_bf16(rng, (10 + r, H))
    y = random_bf16(rng, (num_experts // num_ranks, num_ranks * M, H))
    return x, inp.topk_idx, inp.topk_weights, y


def test_shrink_a_rank_that_stops_calling_is_masked_and_the_others_go_on(comm):
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    num_experts, stopped = 2 * num_ranks, num_ranks - 1
    buf = Buffer(comm, 0, HOST_RDMA_BYTES, low_latency_mode=True, enable_shrink=True,
                     timeout_s=SHRINK_TIMEOUT_S, backend="host")
    bad = []
    for step in range(4):
        if rank == stopped and step >= 1:
            break  # this rank stops calling (it is alive: it waits for the others below)
        masked = [stopped] if step >= 1 else []
        inputs = [_ll_inputs(step, r, num_ranks) for r in range(num_ranks)]
        x, idx, w, y = inputs[rank]
        start = time.monotonic()
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, num_experts, use_fp8=False)
        combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
        elapsed = time.monotonic() - start
        # the reference: the masked rank sends no tokens, and no top-k entry selects its experts
        idx_list = [reference.mask_ranks(i, masked, num_experts, num_ranks) if r not in masked
                    else np.zeros((0, TOPK), np.int64) for r, (_, i, _, _) in enumerate(inputs)]
        x_list = [xx if r not in masked else np.zeros((0, H), BF16) for r, (xx, _, _, _) in enumerate(inputs)]
        w_list = [ww if r not in masked else np.zeros((0, TOPK), np.float32) for r, (_, _, ww, _) in enumerate(inputs)]
        y_list = [yy for (_, _, _, yy) in inputs]
        want = reference.low_latency_dispatch(x_list, idx_list, M, num_experts, rank, use_fp8=False)
        want_combined = reference.low_latency_combine(y_list, idx_list, w_list, M, num_experts, rank)
        for name, got, expected in (("recv_x", recv_x, want.recv_x), ("recv_count", count, want.recv_count),
                                    ("src_info", handle[0], want.src_info),
                                    ("layout_range", handle[1], want.layout_range),
                                    ("combined", combined, want_combined)):
            if not same_bytes(got, expected):
                bad.append(f"step {step}: {name}")
        # the first call after the stop waits out the timeout once (the masking); later ones do not wait
        limit = SHRINK_TIMEOUT_S + SLACK_S if step == 1 else SHRINK_TIMEOUT_S
        if elapsed >= limit:
            bad.append(f"step {step}: took {elapsed:.2f} s")
        status = np.full(num_ranks, -1, np.int32)
        buf.low_latency_query_mask_buffer(status)
        if status.tolist() != [int(r in masked) for r in range(num_ranks)]:
            bad.append(f"step {step}: mask {status.tolist()}")
    comm.Barrier()  # the stopped rank waits here while the others finish
    buf.destroy()
    assert all_ok(comm, not bad), f"rank {rank}: {bad}"


def test_shrink_a_rank_masked_by_hand_is_left_out(comm):
    """low_latency_update_mask_buffer on every rank leaves that rank out (it takes part in nothing); unmasking it
    everywhere brings it back, as the calls stay in step."""
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    num_experts, out = 2 * num_ranks, 0
    buf = Buffer(comm, 0, HOST_RDMA_BYTES, low_latency_mode=True, enable_shrink=True, timeout_s=30,
                     backend="host")
    inputs = [_ll_inputs(9, r, num_ranks) for r in range(num_ranks)]
    x, idx, w, y = inputs[rank]
    ok = True
    for r in range(num_ranks):
        if r != rank:
            buf.low_latency_update_mask_buffer(r if rank == out else out, True)
    if rank != out:
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, num_experts, use_fp8=False)
        idx_list = [reference.mask_ranks(i, [out], num_experts, num_ranks) if r != out
                    else np.zeros((0, TOPK), np.int64) for r, (_, i, _, _) in enumerate(inputs)]
        x_list = [xx if r != out else np.zeros((0, H), BF16) for r, (xx, _, _, _) in enumerate(inputs)]
        want = reference.low_latency_dispatch(x_list, idx_list, M, num_experts, rank, use_fp8=False)
        ok = same_bytes(recv_x, want.recv_x) and same_bytes(count, want.recv_count)
    else:  # alone: its own tokens to its own experts only
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, num_experts, use_fp8=False)
        alone = [reference.mask_ranks(idx, [r for r in range(num_ranks) if r != out], num_experts, num_ranks)
                 if r == out else np.zeros((0, TOPK), np.int64) for r in range(num_ranks)]
        xs = [x if r == out else np.zeros((0, H), BF16) for r in range(num_ranks)]
        want = reference.low_latency_dispatch(xs, alone, M, num_experts, rank, use_fp8=False)
        ok = same_bytes(count, want.recv_count)
    buf.low_latency_combine(y, idx, w, handle)
    buf.low_latency_clean_mask_buffer()
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, num_experts, use_fp8=False)
    want = reference.low_latency_dispatch([i[0] for i in inputs], [i[1] for i in inputs], M, num_experts, rank,
                                          use_fp8=False)
    ok = ok and same_bytes(recv_x, want.recv_x) and isinstance(handle, LowLatencyHandle)
    # a plain tuple's slots would be computed without the dispatch's mask: refused in shrink mode, before any data
    # moves, and the handle itself still combines
    try:
        buf.low_latency_combine(y, idx, w, tuple(handle))
        ok = False
    except ValueError as e:
        ok = ok and str(e).startswith("handle: a plain tuple") and "enable_shrink" in str(e)
    buf.low_latency_combine(y, idx, w, handle)
    buf.destroy()
    assert all_ok(comm, ok)
