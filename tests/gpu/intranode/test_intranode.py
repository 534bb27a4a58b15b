"""Intranode layout / dispatch / cached dispatch / combine on the GPU, bit for bit against the reference."""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

import cupy_ep
from cupy_ep import Buffer, Config, config as cfgmod, reference
from tests.helpers import all_ok, make_inputs, random_bf16, reference_combine, reference_dispatch, same_bytes, to_numpy


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    hidden: int
    topk: int
    experts_per_rank: int
    num_sms: int
    dtype: str = "bf16"
    idx: str = "int64"
    skew: bool = False
    mask_prob: float = 0.0
    duplicates: bool = False
    zero_rank: int | None = None     # this rank gets 0 tokens
    expert_alignment: int = 1
    max_ranks: int = 8               # skip when more ranks (several ranks per GPU are slow)


CASES = [
    Case("base", 1024, 7168, 8, 32, 24),
    Case("fp8", 1024, 7168, 8, 32, 24, dtype="fp8"),
    Case("int32_idx", 777, 4096, 8, 32, 12, idx="int32"),
    Case("zero_tokens_rank1", 300, 4096, 8, 16, 12, zero_rank=1),
    Case("skew_to_rank0", 600, 4096, 8, 16, 24, skew=True),
    Case("masks_and_duplicates", 500, 4096, 8, 16, 12, mask_prob=0.3, duplicates=True),
    Case("fewer_tokens_than_channels", 5, 7168, 8, 32, 24),
    Case("hidden8192", 256, 8192, 8, 32, 12),
    Case("hidden16384", 256, 16384, 8, 32, 24, max_ranks=4),
    Case("topk1_4sms", 512, 7168, 1, 32, 4),
    Case("topk32", 384, 4096, 32, 64, 12),
    Case("4sms_large", 2048, 7168, 8, 32, 4, max_ranks=2),
    Case("alignment128", 1024, 4096, 8, 32, 24, expert_alignment=128),
    Case("fp8_hidden4096_int32", 700, 4096, 8, 16, 12, dtype="fp8", idx="int32", mask_prob=0.1),
    # rows that are not a multiple of a warp's 128 x 16 bytes (hidden 128: 16 int4, fewer than the lanes)
    Case("hidden128", 183, 128, 6, 32, 12),
    Case("hidden320_fp8_24sms", 300, 320, 4, 8, 24, dtype="fp8"),
    Case("hidden2112", 257, 2112, 8, 16, 24),
]


def _inputs(case: Case, rank: int, num_ranks: int, seed: int = 0):
    rng = np.random.default_rng(1000 * seed + 17 * rank + zlib.crc32(case.name.encode()) % 1000)
    tokens = 0 if case.zero_rank == rank else case.tokens
    num_experts = case.experts_per_rank * num_ranks
    inp = make_inputs(rng, tokens, case.hidden, case.topk, num_experts, num_ranks,
                      skew_to_rank=0 if case.skew else None, dtype=case.dtype, mask_prob=case.mask_prob,
                      duplicates=case.duplicates)
    x = inp.x
    if case.dtype == "bf16":
        x = random_bf16(rng, (tokens, case.hidden))
    else:  # FP8 scales column-major (any strides must work)
        data, scales = x
        x = (data, np.asfortranarray(scales))
    idx = inp.topk_idx.astype(np.int32 if case.idx == "int32" else np.int64)
    return x, idx, inp.topk_weights, num_experts


def _to_gpu(a):
    import cupy
    if isinstance(a, tuple):
        return tuple(_to_gpu(v) for v in a)
    if a.dtype == np.uint8 or a.dtype.itemsize != 2:
        return cupy.asarray(a) if a.flags.c_contiguous else cupy.asarray(a, order="F")
    return cupy.asarray(a.view(np.uint16)).view(cupy_ep.interop.BF16)


def _check(errors: list, name: str, got, want):
    if not same_bytes(got, want):
        g, w = to_numpy(got), to_numpy(want)
        detail = f"shape {getattr(g, 'shape', None)} vs {getattr(w, 'shape', None)}"
        if g is not None and w is not None and g.shape == w.shape and g.size:
            diff = np.nonzero(np.ascontiguousarray(g).view(np.uint8) != np.ascontiguousarray(w).view(np.uint8))[0]
            detail += f", {diff.size} differing bytes, first at byte {diff[:3]}"
        errors.append(f"{name}: {detail}")


def _config_for(kind: str, num_ranks: int, num_sms: int) -> Config:
    base = Buffer.get_dispatch_config(num_ranks) if kind == "dispatch" else Buffer.get_combine_config(num_ranks)
    return dataclasses.replace(base, num_sms=num_sms)


def check_dispatch_outputs(errors: list, case: Case, recv_x, recv_idx, recv_w, counts, ref) -> None:
    """recv_x (and FP8 scales), top-k and per-expert counts of a dispatch against the reference (shared with
    tests/gpu/internode/test_internode.py)."""
    if case.dtype == "fp8":
        _check(errors, "recv_x", recv_x[0], ref.recv_x)
        _check(errors, "recv_x_scales", recv_x[1], ref.recv_x_scales)
    else:
        _check(errors, "recv_x", recv_x, ref.recv_x)
    _check(errors, "recv_topk_idx", recv_idx, ref.recv_topk_idx)
    _check(errors, "recv_topk_weights", recv_w, ref.recv_topk_weights)
    if counts != ref.num_recv_tokens_per_expert_list:
        errors.append(f"num_recv_tokens_per_expert_list: {counts[:8]} vs {ref.num_recv_tokens_per_expert_list[:8]}")


def check_cached_dispatch(errors: list, case: Case, cached, ref) -> None:
    """A cached dispatch's return tuple against the reference."""
    if cached[1:5] != (None, None, None, None):
        errors.append("cached dispatch must return None for topk/weights/list/handle")
    cx = cached[0]
    if case.dtype == "fp8":
        _check(errors, "cached recv_x", cx[0], ref.recv_x)
        _check(errors, "cached recv_x_scales", cx[1], ref.recv_x_scales)
    else:
        _check(errors, "cached recv_x", cx, ref.recv_x)


def combine_inputs(case: Case, rank: int, seed: int, num_recv: int, num_tokens: int):
    """``(y [num_recv, H] bf16, (bias0, bias1) [T, H] bf16)``: the expert outputs and biases of a combine test."""
    rng = np.random.default_rng(seed + 7 * rank)
    y_np = random_bf16(rng, (num_recv, case.hidden))
    return y_np, (random_bf16(rng, (num_tokens, case.hidden)), random_bf16(rng, (num_tokens, case.hidden)))


WORST_CASE = Case("worst", 300, 4096, 8, 16, 12, mask_prob=0.1)


def check_worst_outputs(errors: list, recv_x, recv_idx, recv_w, counts, ref, worst: int) -> int:
    """A num_worst_tokens dispatch: ``worst`` rows, the first n (returned) as the reference's, top-k -1 after."""
    n = ref.recv_x.shape[0]
    if counts != []:
        errors.append(f"list must be empty with num_worst_tokens, got {counts[:4]}")
    if recv_x.shape[0] != worst or recv_idx.shape[0] != worst:
        errors.append(f"outputs must have {worst} rows, got {recv_x.shape[0]}")
    _check(errors, "recv_x[:n]", recv_x[:n], ref.recv_x)
    _check(errors, "recv_topk_idx[:n]", recv_idx[:n], ref.recv_topk_idx)
    _check(errors, "recv_topk_weights[:n]", recv_w[:n], ref.recv_topk_weights)
    if not bool((recv_idx[n:] == -1).all()):
        errors.append("recv_topk_idx rows past the real count must be -1")
    return n


def random_case(seed: int, rng_seed: int) -> Case:
    """A random case (tokens, hidden, top-k, experts, SMs, dtype, masks) named ``seed<seed>``."""
    rng = np.random.default_rng(rng_seed)
    return Case(f"seed{seed}", int(rng.integers(1, 1500)), int(rng.choice([2048, 4096, 7168])),
                int(rng.choice([1, 4, 8])), int(rng.choice([8, 32])), int(rng.choice([4, 12, 24])),
                dtype=str(rng.choice(["bf16", "fp8"])), mask_prob=float(rng.choice([0.0, 0.2])))


def report(comm, label: str, errors: list) -> None:
    """Print this rank's errors and fail on every rank if any rank has one."""
    rank = comm.Get_rank()
    for e in errors:
        print(f"[rank {rank}] {label}: {e}")
    assert all_ok(comm, not errors), f"rank {rank}: {errors}"


def run_case(comm, buf, case: Case, seed: int = 0):
    import cupy
    rank, R = comm.Get_rank(), comm.Get_size()
    if R > case.max_ranks:
        pytest.skip(f"{case.name} runs up to {case.max_ranks} ranks (several ranks share a GPU above 2)")
    x_np, idx_np, w_np, num_experts = _inputs(case, rank, R, seed)
    errors: list[str] = []
    dcfg, ccfg = _config_for("dispatch", R, case.num_sms), _config_for("combine", R, case.num_sms)
    with cupy.cuda.Device(buf.device_id):
        x, idx, w = _to_gpu(x_np), cupy.asarray(idx_np), cupy.asarray(w_np)

        # layout
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
        ref_layout = reference.get_dispatch_layout(idx_np, num_experts, R)
        _check(errors, "num_tokens_per_rank", per_rank, ref_layout[0])
        _check(errors, "num_tokens_per_expert", per_expert, ref_layout[2])
        _check(errors, "is_token_in_rank", in_rank, ref_layout[3])
        errors += [] if per_rdma is None else ["num_tokens_per_rdma_rank should be None intranode"]

        # dispatch
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w, expert_alignment=case.expert_alignment, config=dcfg)
        ref = reference_dispatch(comm, x_np, idx_np, w_np, num_experts, case.expert_alignment,
                                 dcfg.intranode_dispatch_channels(R))
        check_dispatch_outputs(errors, case, recv_x, recv_idx, recv_w, counts, ref)
        for i, name in enumerate(("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                                  "recv_src_idx")):
            _check(errors, f"handle.{name}", handle[i], getattr(ref, name))
        _check(errors, "handle.send_head", handle[5], ref.send_head)

        # cached dispatch through the handle
        check_cached_dispatch(errors, case, buf.dispatch(x, handle=handle, config=dcfg), ref)

        # combine (bf16 expert outputs, two biases, weights)
        y_np, bias_np = combine_inputs(case, rank, seed, int(ref.recv_src_idx.shape[0]), idx_np.shape[0])
        send_head_before = to_numpy(handle[5]).copy()
        combined, combined_w, _ = buf.combine(_to_gpu(y_np), handle, topk_weights=recv_w,
                                              bias=tuple(_to_gpu(b) for b in bias_np), config=ccfg)
        ref_c, ref_cw = reference_combine(comm, y_np, ref.is_token_in_rank, ref.recv_topk_weights, bias_np)
        _check(errors, "combined_x", combined, ref_c)
        _check(errors, "combined_topk_weights", combined_w, ref_cw)
        _check(errors, "handle.send_head after combine (must not be modified)", handle[5], send_head_before)
        # a combine cuts the tokens into its own channels, whatever the dispatch's were
        other = dataclasses.replace(ccfg, num_sms=6)
        combined, combined_w, _ = buf.combine(_to_gpu(y_np), handle, topk_weights=recv_w,
                                              bias=tuple(_to_gpu(b) for b in bias_np), config=other)
        _check(errors, "combined_x (combine on 6 SMs)", combined, ref_c)
        _check(errors, "combined_topk_weights (combine on 6 SMs)", combined_w, ref_cw)

        # zero-copy: the same outputs and handle, recv_x a view of the buffer
        zx, zidx, zw, zcounts, zhandle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w, expert_alignment=case.expert_alignment, config=dcfg, zero_copy=True)
        check_dispatch_outputs(errors, case, zx, zidx, zw, zcounts, ref)
        for i, name in enumerate(("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                                  "recv_src_idx")):
            _check(errors, f"zero-copy handle.{name}", zhandle[i], getattr(ref, name))
        _check(errors, "zero-copy handle.send_head", zhandle[5], ref.send_head)
        check_cached_dispatch(errors, case, buf.dispatch(x, handle=zhandle, config=dcfg, zero_copy=True), ref)
        combined, combined_w, _ = buf.combine(_to_gpu(y_np), zhandle, topk_weights=zw,
                                              bias=tuple(_to_gpu(b) for b in bias_np), config=ccfg)
        _check(errors, "combined_x (zero-copy handle)", combined, ref_c)
        _check(errors, "combined_topk_weights (zero-copy handle)", combined_w, ref_cw)
        # zero-copy combine: rows stored straight into the owners' buffers, the same sums bit for bit
        for sms in (case.num_sms, 6):
            combined, combined_w, _ = buf.combine(_to_gpu(y_np), handle, topk_weights=recv_w,
                                                  bias=tuple(_to_gpu(b) for b in bias_np),
                                                  config=dataclasses.replace(ccfg, num_sms=sms), zero_copy=True)
            _check(errors, f"zero-copy combined_x ({sms} SMs)", combined, ref_c)
            _check(errors, f"zero-copy combined_topk_weights ({sms} SMs)", combined_w, ref_cw)
        combined, combined_w, _ = buf.combine(_to_gpu(y_np), handle, config=ccfg, zero_copy=True)
        ref_plain, _ = reference_combine(comm, y_np, ref.is_token_in_rank)
        _check(errors, "zero-copy combined_x (no weights, no bias)", combined, ref_plain)
        if combined_w is not None:
            errors.append("zero-copy combine without topk_weights must return None weights")
        cupy.cuda.get_current_stream().synchronize()
    buf.check_health()
    report(comm, f"{case.name}", errors)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_dispatch_combine(comm, gpu_buffer, case):
    run_case(comm, gpu_buffer, case)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_seeds(comm, gpu_buffer, seed):
    run_case(comm, gpu_buffer, random_case(seed, seed), seed)


def _worst_dispatch(comm, buf, errors: list, zero_copy: bool):
    """WORST_CASE dispatched with num_worst_tokens = T * R (no CPU sync), its outputs checked into ``errors``.
    Returns ``(recv_x, handle, ref, real rows, worst)``; call inside the buffer's device."""
    import cupy
    rank, R = comm.Get_rank(), comm.Get_size()
    x_np, idx_np, w_np, num_experts = _inputs(WORST_CASE, rank, R)
    worst = WORST_CASE.tokens * R
    x, idx, w = _to_gpu(x_np), cupy.asarray(idx_np), cupy.asarray(w_np)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    cfg = _config_for("dispatch", R, 12)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w, num_worst_tokens=worst, config=cfg, zero_copy=zero_copy)
    ref = reference_dispatch(comm, x_np, idx_np, w_np, num_experts, 1, cfg.intranode_dispatch_channels(R))
    n = check_worst_outputs(errors, recv_x, recv_idx, recv_w, counts, ref, worst)
    return recv_x, handle, ref, n, worst


@pytest.mark.mpi(min_size=2)
def test_num_worst_tokens(comm, gpu_buffer):
    import cupy
    rank, R = comm.Get_rank(), comm.Get_size()
    case = WORST_CASE
    errors: list[str] = []
    with cupy.cuda.Device(gpu_buffer.device_id):
        _, handle, ref, n, worst = _worst_dispatch(comm, gpu_buffer, errors, zero_copy=False)
        # combine through the worst-sized handle gives the reference answer
        rng = np.random.default_rng(5 + rank)
        y_np = random_bf16(rng, (worst, case.hidden))
        combined, _, _ = gpu_buffer.combine(_to_gpu(y_np), handle, config=_config_for("combine", R, 12))
        ref_c, _ = reference_combine(comm, y_np[:n], ref.is_token_in_rank)
        _check(errors, "combined_x (worst handle)", combined, ref_c)
        combined, _, _ = gpu_buffer.combine(_to_gpu(y_np), handle, config=_config_for("combine", R, 12),
                                            zero_copy=True)
        _check(errors, "zero-copy combined_x (worst handle)", combined, ref_c)
        cupy.cuda.get_current_stream().synchronize()
    assert all_ok(comm, not errors), f"rank {rank}: {errors}"


@pytest.mark.mpi(min_size=2)
def test_zero_copy_num_worst_tokens_and_view_guard(comm, gpu_buffer):
    """zero_copy with num_worst_tokens (no CPU sync): worst rows, the real ones as the reference's; recv_x is a
    view of the buffer, and passing it back in (combine, dispatch) is refused before anything runs."""
    import cupy
    case = WORST_CASE
    errors: list[str] = []
    with cupy.cuda.Device(gpu_buffer.device_id):
        recv_x, handle, _, _, _ = _worst_dispatch(comm, gpu_buffer, errors, zero_copy=True)
        base = gpu_buffer.impl._nvl.ptr
        if not base <= recv_x.data.ptr < base + gpu_buffer.impl._nvl.nbytes:
            errors.append("zero-copy recv_x is not a view of the buffer")
        for label, call in (("combine", lambda: gpu_buffer.combine(recv_x, handle)),
                            ("dispatch", lambda: gpu_buffer.dispatch(recv_x[:case.tokens], handle=handle))):
            try:
                call()
                errors.append(f"{label} of the zero-copy recv_x was not refused")
            except ValueError as e:
                if "x: is a view of this buffer" not in str(e):
                    errors.append(f"{label}: unexpected message {e}")
        cupy.cuda.get_current_stream().synchronize()
    gpu_buffer.check_health()
    report(comm, "zero_copy worst", errors)


@pytest.mark.mpi(min_size=2)
def test_zero_copy_capacity_stops_every_rank(comm):
    """A zero-copy dispatch larger than a receiver's buffer stops on every rank with a CommError naming the
    capacity, and writes nothing (a buffer sized for 64 rows, 300 tokens per rank)."""
    import cupy
    from cupy_ep.errors import CommError
    rank, R = comm.Get_rank(), comm.Get_size()
    case = Case("capacity", 300, 2048, 4, 8, 12)
    x_np, idx_np, w_np, num_experts = _inputs(case, rank, R)
    cfg = _config_for("dispatch", R, 12)
    C = cfg.intranode_dispatch_channels(R)
    nbytes = cfgmod.NOTIFY_BYTES + cfgmod.direct_dispatch_bytes(C, 64, case.hidden * 2, case.topk, 0)
    errors: list[str] = []
    buf = cupy_ep.Buffer(comm, num_nvl_bytes=cfgmod.align_up(nbytes), backend="cuda", timeout_s=30)
    try:
        with cupy.cuda.Device(buf.device_id):
            x, idx, w = _to_gpu(x_np), cupy.asarray(idx_np), cupy.asarray(w_np)
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
            try:
                buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                             num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, config=cfg,
                             zero_copy=True)
                errors.append("no error")
            except CommError as e:
                if "zero-copy dispatch would put" not in str(e):
                    errors.append(f"unexpected message: {e}")
    finally:
        buf.destroy()
    report(comm, "zero_copy capacity", errors)


@pytest.mark.mpi(min_size=2)
def test_async_events_and_torch(comm, gpu_buffer):
    """async_finish + previous_event with CuPy, then the same call with torch tensors."""
    import cupy
    torch = pytest.importorskip("torch")
    rank, R = comm.Get_rank(), comm.Get_size()
    case = Case("events", 400, 4096, 8, 16, 12)
    x_np, idx_np, w_np, num_experts = _inputs(case, rank, R)
    errors: list[str] = []
    ref = reference_dispatch(comm, x_np, idx_np, w_np, num_experts, 1, None)
    with cupy.cuda.Device(gpu_buffer.device_id):
        x, idx, w = _to_gpu(x_np), cupy.asarray(idx_np), cupy.asarray(w_np)
        prev = gpu_buffer.capture()
        per_rank, _, per_expert, in_rank, ev = gpu_buffer.get_dispatch_layout(
            idx, num_experts, previous_event=prev, async_finish=True, allocate_on_comm_stream=True)
        ev.current_stream_wait()
        recv_x, recv_idx, recv_w, counts, handle, ev = gpu_buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w, async_finish=True)
        with ev:
            pass
        _check(errors, "recv_x (async)", recv_x, ref.recv_x)

        tdev = torch.device("cuda", gpu_buffer.device_id)
        torch.cuda.set_device(tdev)
        tx = torch.from_numpy(x_np.view(np.int16)).to(tdev).view(torch.bfloat16)
        tidx, tw = torch.from_numpy(idx_np).to(tdev), torch.from_numpy(w_np).to(tdev)
        t_per_rank, _, t_per_expert, t_in_rank, _ = gpu_buffer.get_dispatch_layout(tidx, num_experts)
        if not isinstance(t_in_rank, torch.Tensor) or t_in_rank.dtype != torch.bool:
            errors.append(f"torch in -> torch out expected, got {type(t_in_rank)}")
        t_recv, t_idx, t_w, t_counts, t_handle, _ = gpu_buffer.dispatch(
            tx, num_tokens_per_rank=t_per_rank, is_token_in_rank=t_in_rank, num_tokens_per_expert=t_per_expert,
            topk_idx=tidx, topk_weights=tw)
        if t_recv.dtype != torch.bfloat16 or t_idx.dtype != torch.int64:
            errors.append(f"torch dtypes: {t_recv.dtype}, {t_idx.dtype}")
        _check(errors, "torch recv_x", t_recv, ref.recv_x)
        _check(errors, "torch recv_topk_idx", t_idx, ref.recv_topk_idx)
        t_comb, _, _ = gpu_buffer.combine(t_recv, t_handle)
        ref_c, _ = reference_combine(comm, ref.recv_x, ref.is_token_in_rank)
        _check(errors, "torch combined_x", t_comb, ref_c)
        torch.cuda.synchronize(tdev)
    assert all_ok(comm, not errors), f"rank {rank}: {errors}"


@pytest.mark.mpi(min_size=2)
def test_carve_matches_python_size_arithmetic(comm, gpu_buffer):
    import cupy
    from cupy_ep import jit
    errors = []
    R = comm.Get_size()
    with cupy.cuda.Device(gpu_buffer.device_id):
        k = jit.get_kernel("intranode.cu", "ep::carve_probe")
        for (C, Q, hb, topk, scales, cap) in [(12, 256, 14336, 8, 56, 8192), (2, 64, 16, 1, 0, 3),
                                              (33, 100, 32768, 32, 128, 1000)]:
            out = cupy.zeros(5, dtype=cupy.int64)
            k((1,), (1,), (np.int32(C), np.int32(R), np.int32(Q), np.int32(hb // 16), np.int32(topk),
                           np.int32(scales), np.int32(cap), out))
            got = out.get().tolist()
            want = [cfgmod.dispatch_channel_bytes(C, R, Q, hb, topk, scales),
                    cfgmod.combine_channel_bytes(C, R, Q, hb, topk),
                    cfgmod.SIGNAL_BYTES + cfgmod.NOTIFY_BYTES,
                    cfgmod.direct_dispatch_bytes(C, cap, hb, topk, scales),
                    cfgmod.direct_combine_bytes(R, cap, hb, topk)]
            if got != want:
                errors.append(f"C={C} Q={Q} hidden_bytes={hb}: device {got} vs python {want}")
    assert all_ok(comm, not errors), errors


@pytest.mark.mpi(min_size=2)
def test_cuda_graph_capture_num_worst_tokens(comm, gpu_buffer):
    """layout + dispatch(num_worst_tokens) + combine captured once, replayed with new data in place."""
    import cupy
    rank, R = comm.Get_rank(), comm.Get_size()
    case = Case("graph", 256, 2048, 4, 8, 12)
    cfg_d, cfg_c = _config_for("dispatch", R, 12), _config_for("combine", R, 12)
    worst = case.tokens * R
    errors: list[str] = []
    with cupy.cuda.Device(gpu_buffer.device_id):
        x_np, idx_np, w_np, num_experts = _inputs(case, rank, R, seed=0)
        x, idx, w = _to_gpu(x_np), cupy.asarray(idx_np), cupy.asarray(w_np)
        # the copies above ran on the legacy default stream, which a non-blocking stream does not wait for: without
        # this sync the first call read stale pool memory as topk_idx (four ranks sharing one GPU)
        cupy.cuda.runtime.deviceSynchronize()
        stream = cupy.cuda.Stream(non_blocking=True)
        outs = {}

        def step():
            per_rank, _, per_expert, in_rank, _ = gpu_buffer.get_dispatch_layout(idx, num_experts)
            recv_x, recv_idx, recv_w, _, handle, _ = gpu_buffer.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx, topk_weights=w, num_worst_tokens=worst, config=cfg_d)
            combined, _, _ = gpu_buffer.combine(recv_x, handle, config=cfg_c)
            outs.update(recv_x=recv_x, recv_idx=recv_idx, combined=combined)

        with stream:
            step()  # warm-up outside the capture (kernels loaded, pool blocks cached)
            stream.synchronize()
            comm.Barrier()
            stream.begin_capture()
            step()
            graph = stream.end_capture()
        for seed in (1, 2):  # new data written into the captured input arrays, then replay
            x_np, idx_np, w_np, _ = _inputs(case, rank, R, seed=seed)
            x.view(cupy.uint16)[...] = cupy.asarray(x_np.view(np.uint16))
            idx[...] = cupy.asarray(idx_np)
            w[...] = cupy.asarray(w_np)
            cupy.cuda.runtime.deviceSynchronize()
            comm.Barrier()
            graph.launch(stream)
            stream.synchronize()
            ref = reference_dispatch(comm, x_np, idx_np, w_np, num_experts, 1, cfg_d.intranode_dispatch_channels(R))
            n = ref.recv_x.shape[0]
            _check(errors, f"graph replay {seed} recv_x", outs["recv_x"][:n], ref.recv_x)
            _check(errors, f"graph replay {seed} recv_topk_idx", outs["recv_idx"][:n], ref.recv_topk_idx)
            ref_c, _ = reference_combine(comm, ref.recv_x, ref.is_token_in_rank)
            _check(errors, f"graph replay {seed} combined", outs["combined"], ref_c)
    assert all_ok(comm, not errors), f"rank {rank}: {errors}"


@pytest.mark.mpi(min_size=2)
def test_cuda_graph_zero_copy_replays(comm, gpu_buffer):
    """A cached zero-copy dispatch, a copy of its recv_x view and a zero-copy combine captured once, replayed with
    new data, with a zero-copy call outside the graph in between: the kernels meet the ranks by their entry
    handshake, whose epoch is counted on the device, so every replay and every plain call meets them afresh."""
    import cupy
    rank, R = comm.Get_rank(), comm.Get_size()
    case = Case("graph_zero_copy", 256, 2048, 4, 8, 12)
    cfg_d, cfg_c = _config_for("dispatch", R, 12), _config_for("combine", R, 12)
    errors: list[str] = []
    with cupy.cuda.Device(gpu_buffer.device_id):
        x_np, idx_np, w_np, num_experts = _inputs(case, rank, R, seed=0)
        x, idx, w = _to_gpu(x_np), cupy.asarray(idx_np), cupy.asarray(w_np)
        per_rank, _, per_expert, in_rank, _ = gpu_buffer.get_dispatch_layout(idx, num_experts)
        handle = gpu_buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                     num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, config=cfg_d)[4]
        y = cupy.empty((int(handle[3].shape[0]), case.hidden), dtype=cupy.uint16)
        cupy.cuda.runtime.deviceSynchronize()  # x and the handle come from the default stream (see above)
        stream = cupy.cuda.Stream(non_blocking=True)
        outs = {}

        def step():
            recv_x = gpu_buffer.dispatch(x, handle=handle, config=cfg_d, zero_copy=True)[0]
            y[...] = recv_x.view(cupy.uint16)  # the combine takes no view of the buffer
            combined, _, _ = gpu_buffer.combine(y.view(cupy_ep.interop.BF16), handle, config=cfg_c, zero_copy=True)
            outs.update(combined=combined)

        with stream:
            step()
            stream.synchronize()
            comm.Barrier()
            stream.begin_capture()
            step()
            graph = stream.end_capture()
        for seed in (1, 2, 3):  # new x (same routing) into the captured input, then replay
            x_np = _inputs(case, rank, R, seed=seed)[0]
            x.view(cupy.uint16)[...] = cupy.asarray(x_np.view(np.uint16))
            cupy.cuda.runtime.deviceSynchronize()
            comm.Barrier()
            graph.launch(stream)
            stream.synchronize()
            ref = reference_dispatch(comm, x_np, idx_np, w_np, num_experts, 1, cfg_d.intranode_dispatch_channels(R))
            # the recv_x view itself is only valid until the next call (the combine stores into the same bytes)
            _check(errors, f"graph replay {seed} recv_x (the copy of the zero-copy view)", y, ref.recv_x)
            ref_c, _ = reference_combine(comm, ref.recv_x, ref.is_token_in_rank)
            _check(errors, f"graph replay {seed} zero-copy combined", outs["combined"], ref_c)
            if seed == 2:  # a plain zero-copy call between replays advances the epoch outside the graph
                with stream:
                    plain = gpu_buffer.dispatch(x, handle=handle, config=cfg_d, zero_copy=True)[0]
                    stream.synchronize()
                _check(errors, "plain zero-copy dispatch between replays", plain, ref.recv_x)
    gpu_buffer.check_health()
    assert all_ok(comm, not errors), f"rank {rank}: {errors}"
