"""Internode layout / dispatch / cached dispatch / combine on the GPU, against the reference, with the intranode
suite's cases (tests/gpu/intranode/test_intranode.py CASES).

Topologies ("nodes" share one box;):
  * 2 ranks: 2 nodes x 1 GPU, over NVSHMEM (P2P transport) and over the IPC transport;
  * 4 ranks: 2 nodes x 2 ranks, IPC transport only (ranks of one RDMA domain share a GPU: NVSHMEM cannot).
Other rank counts skip. Run (GPU machine):
  mpirun -n 2 python -m pytest --with-mpi -q tests/gpu/internode/test_internode.py
  mpirun -n 4 python -m pytest --with-mpi -q tests/gpu/internode/test_internode.py
Checks: layout incl. num_tokens_per_rdma_rank; recv_x / scales / top-k / per-expert counts bit for bit
(cupy_ep.reference.dispatch); every handle field (cupy_ep.internode_reference.handle); cached dispatch; combine
with weights and two biases bit for bit against the two-level oracle (internode_reference.combine); the handle
unchanged by combine; num_worst_tokens; the device carve against cupy_ep.config.internode_layout.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import cupy_ep

from cupy_ep import config as cfgmod
from cupy_ep import internode_reference as iref
from cupy_ep import reference
from tests.gpu.intranode.test_intranode import (CASES, WORST_CASE, Case, _check, _config_for, _inputs, _to_gpu,
                                      check_cached_dispatch, check_dispatch_outputs, check_worst_outputs,
                                      combine_inputs, random_case, report)
from tests.helpers import all_ok, gather_all, random_bf16, reference_dispatch, to_numpy

MAX_HIDDEN_BYTES = 32768
MAX_SMS = 24


def _topology(num_ranks: int, transport: str):
    """GPUs per node for this rank count and transport, or None (skip)."""
    if num_ranks == 2:
        return 1
    if num_ranks == 4 and transport == "ipc":
        return 2
    return None


def _buffer_bytes(num_ranks: int, gpus_per_node: int) -> tuple[int, int]:
    nodes = num_ranks // gpus_per_node
    sizes = [cfgmod.internode_buffer_bytes(nodes, gpus_per_node, MAX_HIDDEN_BYTES,
                                           dataclasses.replace(_config_for(kind, num_ranks, MAX_SMS), num_sms=MAX_SMS))
             for kind in ("dispatch", "combine")]
    return max(s[0] for s in sizes), max(s[1] for s in sizes)


@pytest.fixture(scope="module", params=["nvshmem", "ipc"])
def _internode_slot(request, comm):
    from tests.gpu.conftest import BufferSlot
    transport = request.param
    R = comm.Get_size()
    G = _topology(R, transport)
    if G is None:
        pytest.skip(f"internode tests run at 2 ranks (nvshmem, ipc) or 4 ranks (ipc), not {R} ranks with {transport}")
    nvl, rdma = _buffer_bytes(R, G)

    def make():
        buf = cupy_ep.Buffer(comm, num_nvl_bytes=nvl, num_rdma_bytes=rdma, backend="cuda",
                             timeout_s=float(os.environ.get("CUPY_EP_TEST_TIMEOUT_S", "20")),
                             num_ranks_per_node=G, internode_transport=transport)
        assert buf.impl._internode is not None and buf.impl._internode.transport == transport
        return buf
    slot = BufferSlot(comm, make)
    yield slot
    slot.close()


@pytest.fixture
def internode_buffer(_internode_slot):
    """The module's internode Buffer for one transport (made anew for a test when an earlier test left it
    unusable)."""
    return _internode_slot.get()


def _gathered_itr(comm, idx_np, num_experts):
    R = comm.Get_size()
    return [reference.token_rank_matrix(t, num_experts, R) for t in gather_all(comm, idx_np)]


def _check_handle(errors, comm, handle, idx_np, num_experts, G, C):
    want = iref.handle(_gathered_itr(comm, idx_np, num_experts), comm.Get_rank(), G, C)
    for i, name in enumerate(cupy_ep.cuda.internode.HANDLE_FIELDS):
        expected = getattr(want, name)
        if name == "recv_src_meta":
            expected = iref.src_meta_bytes(expected)
        _check(errors, f"handle.{name}", handle[i], expected)


def run_internode_case(comm, buf, case: Case, seed: int = 0):
    import cupy
    rank, R = comm.Get_rank(), comm.Get_size()
    G = buf.topology.num_ranks_per_node
    if R > case.max_ranks:
        pytest.skip(f"{case.name} runs up to {case.max_ranks} ranks")
    x_np, idx_np, w_np, num_experts = _inputs(case, rank, R, seed)
    errors: list[str] = []
    dcfg, ccfg = _config_for("dispatch", R, case.num_sms), _config_for("combine", R, case.num_sms)
    with cupy.cuda.Device(buf.device_id):
        x, idx, w = _to_gpu(x_np), cupy.asarray(idx_np), cupy.asarray(w_np)

        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
        ref_layout = reference.get_dispatch_layout(idx_np, num_experts, R, G)
        for name, got, want in zip(("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
                                    "is_token_in_rank"), (per_rank, per_rdma, per_expert, in_rank), ref_layout):
            _check(errors, name, got, want)

        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, expert_alignment=case.expert_alignment,
            config=dcfg)
        ref = reference_dispatch(comm, x_np, idx_np, w_np, num_experts, case.expert_alignment)
        check_dispatch_outputs(errors, case, recv_x, recv_idx, recv_w, counts, ref)
        _check_handle(errors, comm, handle, idx_np, num_experts, G, dcfg.num_channels)

        check_cached_dispatch(errors, case, buf.dispatch(x, handle=handle, config=dcfg), ref)

        y_np, bias_np = combine_inputs(case, rank, seed, int(ref.recv_src_idx.shape[0]), idx_np.shape[0])
        before = [to_numpy(a).copy() for a in handle[1:]]
        combined, combined_w, _ = buf.combine(_to_gpu(y_np), handle, topk_weights=recv_w,
                                              bias=tuple(_to_gpu(b) for b in bias_np), config=ccfg)
        gathered = gather_all(comm, (y_np, to_numpy(ref.recv_topk_weights)))
        want_x, want_w = iref.combine([g[0] for g in gathered], _gathered_itr(comm, idx_np, num_experts), rank, G,
                                      [g[1] for g in gathered], bias_np)
        _check(errors, "combined_x", combined, want_x)
        _check(errors, "combined_topk_weights", combined_w, want_w)
        for name, a, b in zip(cupy_ep.cuda.internode.HANDLE_FIELDS[1:], handle[1:], before):
            _check(errors, f"handle.{name} after combine (must not be modified)", a, b)
        cupy.cuda.get_current_stream().synchronize()
    buf.check_health()
    report(comm, f"internode {case.name}", errors)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_internode_dispatch_combine(comm, internode_buffer, case):
    run_internode_case(comm, internode_buffer, case)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_internode_random_seeds(comm, internode_buffer, seed):
    run_internode_case(comm, internode_buffer, random_case(seed, 100 + seed), seed)


@pytest.mark.mpi(min_size=2)
def test_internode_num_worst_tokens(comm, internode_buffer):
    import cupy
    buf = internode_buffer
    rank, R = comm.Get_rank(), comm.Get_size()
    G = buf.topology.num_ranks_per_node
    case = WORST_CASE
    x_np, idx_np, w_np, num_experts = _inputs(case, rank, R)
    worst = case.tokens * R
    errors: list[str] = []
    with cupy.cuda.Device(buf.device_id):
        x, idx, w = _to_gpu(x_np), cupy.asarray(idx_np), cupy.asarray(w_np)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
        dcfg, ccfg = _config_for("dispatch", R, 12), _config_for("combine", R, 12)
        kw = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, config=dcfg)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(x, num_worst_tokens=worst, **kw)
        ref = reference_dispatch(comm, x_np, idx_np, w_np, num_experts, 1)
        n = check_worst_outputs(errors, recv_x, recv_idx, recv_w, counts, ref, worst)
        # the worst-size handle combines like the exact one (rows past the real count are never read)
        rng = np.random.default_rng(5 + rank)
        y_np = random_bf16(rng, (worst, case.hidden))
        combined, _, _ = buf.combine(_to_gpu(y_np), handle, config=ccfg)
        gathered = gather_all(comm, y_np[:n])
        want_x, _ = iref.combine(gathered, _gathered_itr(comm, idx_np, num_experts), rank, G)
        _check(errors, "combined_x (worst-size handle)", combined, want_x)
        cupy.cuda.get_current_stream().synchronize()
    buf.check_health()
    assert all_ok(comm, not errors), f"rank {rank}: {errors}"


@pytest.mark.mpi(min_size=2)
def test_internode_carve_matches_python_size_model(comm, internode_buffer):
    st = internode_buffer.impl._internode
    keys = ("rdma_channel_begin", "rdma_dispatch_end", "rdma_combine_end", "nvl_channel_begin", "nvl_dispatch_end",
            "nvl_combine_end", "dispatch_token_bytes", "combine_token_bytes")
    errors = []
    with internode_buffer.impl._device:
        for C, qr, qn, hidden_int4, scales, topk in [(12, 128, 256, 896, 56, 8), (1, 6, 7, 1, 0, 0),
                                                    (3, 10, 9, 5, 3, 3), (24, 64, 512, 2048, 128, 32)]:
            got = st.carve_probe(C, qr, qn, hidden_int4, scales, topk)
            want = cfgmod.internode_layout(st.num_nodes, st.gpus_per_node, C, qr, qn, 16 * hidden_int4, scales, topk)
            if got != [want[k] for k in keys]:
                errors.append(f"carve {C, qr, qn, hidden_int4, scales, topk}: device {got} vs python {want}")
    assert all_ok(comm, not errors), errors


@pytest.mark.mpi(min_size=2)
def test_internode_barrier_and_bad_handle(comm, internode_buffer):
    """A device barrier over both domains works; a handle of the wrong shape is refused on the host and the
    buffer stays usable."""
    import cupy
    buf = internode_buffer
    buf.barrier()
    with cupy.cuda.Device(buf.device_id):
        x = cupy.zeros((4, 256), dtype=cupy.uint16).view(cupy_ep.interop.BF16)
        with pytest.raises(ValueError, match="handle"):
            buf.combine(x, (None,) * 6)
        with pytest.raises(ValueError, match="num_tokens_per_rdma_rank"):
            idx = cupy.zeros((4, 2), dtype=cupy.int64)
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 2 * comm.Get_size())
            buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                         topk_idx=idx, topk_weights=cupy.ones((4, 2), dtype=cupy.float32))
    buf.barrier()
    buf.check_health()
