"""Low-latency dispatch / combine on the GPU, bit for bit against cupy_ep.reference.

Transport: env ``CUPY_EP_LL_TRANSPORT`` (default NVSHMEM, one rank per GPU); with ``ipc`` the same tests run over
a CUDA-IPC buffer, also with ranks sharing a GPU (2 or 4 ranks on one GPU: every peer path is exercised on a
one-GPU machine), and the forced-put cases skip (IPC has no puts).

The kernels order rows deterministically (source rank, token, k) and mirror the reference's arithmetic (FP8
cast: the same fp32 operations and an RNE satfinite e4m3 conversion; combine: per expert rank an fp32
partial sum over its k ascending (fp32 products, no FMA), the partials summed over ranks ascending, one bf16
rounding), so every valid row, scale, count, src_info, layout_range and the
combined output are compared exactly. One Buffer per module (one NVSHMEM init per process); the forced-put
path is switched on the same buffer (``buf.impl._ll.force_put``).

Failing loudly, never hanging: every test runs with the buffer's GPU current (rank r uses GPU r; arrays made
on another GPU are refused with a ValueError). Inputs are gathered and the reference computed before any
collective call; each rank's calls run in ``_step``, which prints a rank-prefixed traceback and then agrees
with the other ranks (one allreduce), so when any rank raised, all ranks stop the test together; a rank whose
kernel was already launched drains it first (its device wait ends after the Buffer's short timeout as a
recorded CommTimeoutError).
"""
from __future__ import annotations

import dataclasses
import traceback
import zlib

import numpy as np
import pytest

import cupy_ep
from cupy_ep import config as cfgmod, reference
from tests.helpers import all_ok, bad_input_problem, gather_all, make_inputs, random_bf16, same_bytes, to_numpy

# One rank works too (every expert is local; the low-latency path at EP1, run on one-GPU machines); the
# tests that need a peer skip there.
pytestmark = pytest.mark.mpi(min_size=1)

MAX_TOKENS = 128
MAX_HIDDEN = 7168
MAX_EXPERTS = 256
TIMEOUT_S = 15          # a device wait for a peer that failed costs seconds, not minutes


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    hidden: int
    topk: int
    local_experts: int
    use_fp8: bool = False
    round_scale: bool = False
    use_ue8m0: bool = False
    mask_prob: float = 0.0
    duplicates: bool = False
    zero_rank: int | None = None
    idx: str = "int64"
    lib: str = "cupy"


CASES = [
    Case("bf16", 100, 2048, 8, 16),
    Case("fp8", 100, 2048, 8, 16, use_fp8=True),
    Case("fp8_round_scale", 90, 2048, 8, 16, use_fp8=True, round_scale=True),
    Case("fp8_ue8m0", 90, 4096, 8, 16, use_fp8=True, round_scale=True, use_ue8m0=True),
    Case("decode_shape", 128, 7168, 8, 0, use_fp8=True),               # local_experts 0: 256 experts in all
    Case("masks_int32", 77, 1024, 6, 8, mask_prob=0.3, idx="int32"),
    Case("zero_tokens_rank1", 64, 2048, 4, 8, use_fp8=True, zero_rank=1),
    Case("duplicates", 40, 512, 8, 4, duplicates=True),
    Case("torch_fp8", 50, 2048, 8, 16, use_fp8=True, lib="torch"),
    Case("topk11", 33, 512, 11, 16),
    # the larger top-k bounds' kernels (config.LL_TOPK_BOUNDS): 16 with FP8, 32 with repeated experts
    Case("topk16_fp8", 40, 2048, 16, 16, use_fp8=True),
    Case("topk32_duplicates", 40, 1024, 32, 16, duplicates=True),
]


def _experts(case: Case, num_ranks: int) -> int:
    return MAX_EXPERTS if case.local_experts == 0 else case.local_experts * num_ranks


def _buffer_bytes(num_ranks: int) -> int:
    return cfgmod.low_latency_rdma_size_hint(MAX_TOKENS, MAX_HIDDEN, num_ranks, MAX_EXPERTS)


def ranks_share_a_gpu(comm) -> bool:
    """True when this node runs more ranks than it has GPUs (the NVSHMEM transport refuses that)."""
    import cupy

    from cupy_ep import bootstrap
    local = bootstrap.split_shared(comm)
    try:
        return local.Get_size() > cupy.cuda.runtime.getDeviceCount()
    finally:
        local.Free()


def sm_share(comm):
    """This job's bootstrap.SmShare, as Buffer computes it (collective)."""
    import cupy
    from cupy_ep import bootstrap
    local = bootstrap.split_shared(comm)
    try:
        return bootstrap.gpu_sm_share(comm, cupy.cuda.runtime.getDevice(), local.Get_size())
    finally:
        local.Free()


def mps_clients(comm) -> bool:
    """True when every rank is a CUDA MPS client (then NVSHMEM allows ranks sharing a GPU, and their kernels run at
    the same time instead of in time slices)."""
    return sm_share(comm).mps


def ll_transport() -> str:
    """The low-latency transport these tests run on (env CUPY_EP_LL_TRANSPORT, default nvshmem)."""
    from cupy_ep.cuda.low_latency import resolve_transport
    return resolve_transport(None)


def skip_unless_usable(comm) -> None:
    """Skip (on every rank alike) where this transport cannot run: NVSHMEM with ranks sharing a GPU outside MPS."""
    if ll_transport() == "nvshmem" and ranks_share_a_gpu(comm) and not mps_clients(comm):
        pytest.skip("the NVSHMEM transport needs one GPU per rank or CUDA MPS (see test_low_latency_timeout.py::"
                    "test_ranks_sharing_a_gpu_are_refused; CUPY_EP_LL_TRANSPORT=ipc runs these tests there)")


def use_put_path(ll_buf, force_put: bool) -> None:
    """Switch the buffer to the forced-put path (or back); skips the put case on a transport without puts."""
    if force_put and ll_buf.impl._ll.transport != "nvshmem":
        pytest.skip(f"the {ll_buf.impl._ll.transport!r} transport has no put path")
    ll_buf.impl._ll.force_put = force_put


def _make_ll_buf(comm):
    from tests.gpu.conftest import nvl_bytes_for
    buf = cupy_ep.Buffer(comm, num_nvl_bytes=nvl_bytes_for(comm.Get_size(), 8192, 24),
                         num_rdma_bytes=_buffer_bytes(comm.Get_size()), low_latency_mode=True, backend="cuda",
                         timeout_s=TIMEOUT_S)
    assert buf.impl._ll.transport == ll_transport()
    return buf


@pytest.fixture(scope="module")
def _ll_slot(comm):
    from tests.gpu.conftest import BufferSlot
    skip_unless_usable(comm)
    slot = BufferSlot(comm, lambda: _make_ll_buf(comm))
    yield slot
    slot.close()


@pytest.fixture
def ll_buf(_ll_slot):
    """The module's low-latency Buffer (made anew for a test when an earlier test left it unusable)."""
    return _ll_slot.get()


@pytest.fixture(autouse=True)
def _on_buffer_device(ll_buf):
    """Arrays, streams and syncs of every test on the buffer's GPU (without it, rank 1 makes its arrays on
    GPU 0 and every call raises "x: is on GPU 0, but this buffer uses GPU 1")."""
    import cupy
    with cupy.cuda.Device(ll_buf.device_id):
        yield


def _guarded(comm, errors: list, what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; an exception is printed (rank-prefixed traceback) and appended to ``errors``."""
    try:
        return fn(*args, **kwargs)
    except (Exception, pytest.fail.Exception) as e:   # a failed pytest.raises too: every rank must go on
        rank = comm.Get_rank()
        lines = traceback.format_exc().rstrip().splitlines()
        print("\n".join(f"[rank {rank}] {line}" for line in [f"{what} raised:"] + lines), flush=True)
        errors.append(f"{what} raised {type(e).__name__}: {e}")
        return None


def _step(buf, comm, what: str, fn, *args, **kwargs):
    """Collective: run ``fn`` guarded on every rank, then agree; if any rank raised, every rank drains its
    device (a launched kernel whose peer never launched ends by the Buffer timeout) and fails the test."""
    import cupy
    raised: list = []
    result = _guarded(comm, raised, what, fn, *args, **kwargs)
    if all_ok(comm, not raised):
        return result
    try:
        cupy.cuda.runtime.deviceSynchronize()
        buf.check_health()
    except Exception as e:
        raised.append(f"then draining the device: {type(e).__name__}: {e}")
    pytest.fail(f"rank {comm.Get_rank()}: {what} failed on some rank; here: {raised or 'no error'}", pytrace=False)


def _dev(a, lib="cupy"):
    import cupy
    if a is None:
        return None
    if a.dtype == reference.bfloat16:
        out = cupy.asarray(a.view(np.uint16)).view(cupy_ep.interop.BF16)
    else:
        out = cupy.asarray(a)
    if lib == "torch":
        import torch
        t = torch.from_dlpack(out.view(cupy.int16) if a.dtype == reference.bfloat16 else out)
        return t.view(torch.bfloat16) if a.dtype == reference.bfloat16 else t
    return out


def _inputs(case: Case, comm, seed: int):
    rank, R = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng([seed, rank, zlib.crc32(case.name.encode())])
    E = _experts(case, R)
    T = 0 if case.zero_rank == rank else case.tokens - 3 * rank
    inp = make_inputs(rng, T, 16, case.topk, E, R, mask_prob=case.mask_prob, duplicates=case.duplicates)
    x = random_bf16(rng, (T, case.hidden))
    idx = inp.topk_idx.astype(np.int32 if case.idx == "int32" else np.int64)
    return x, idx, inp.topk_weights, E


def _small_int_rows(rng, shape):
    """bf16 expert outputs that sum exactly in fp32 (small integers)."""
    return rng.integers(-8, 9, size=shape).astype(np.float32).astype(reference.bfloat16)


def _compare_dispatch(errors, got, want, case: Case, idx):
    """Append to ``errors`` what differs from the reference: the valid rows, their scales and src_info, the counts,
    layout_range, and the handle's topk_slots (reference.low_latency_slots of this rank's ``idx``, numpy)."""
    recv_x, count, handle = got
    slots = to_numpy(handle.topk_slots)
    max_tokens, num_experts = handle[2], handle[4]
    if not np.array_equal(slots, reference.low_latency_slots(idx, max_tokens, num_experts)) or slots.dtype != np.int32:
        errors.append("handle.topk_slots differ from reference.low_latency_slots")
    data, scales = (recv_x if isinstance(recv_x, tuple) else (recv_x, None))
    data, count = to_numpy(data), to_numpy(count)
    src_info, layout_range = to_numpy(handle[0]), to_numpy(handle[1])
    if not np.array_equal(count, want.recv_count):
        errors.append(f"recv_count {count} != {want.recv_count}")
        return
    if not np.array_equal(layout_range, want.layout_range):
        errors.append("layout_range differs")
    scales = to_numpy(scales)
    for e, n in enumerate(want.recv_count):
        if not same_bytes(np.ascontiguousarray(data[e, :n]).view(np.uint8),
                          np.ascontiguousarray(want.recv_x[e, :n]).view(np.uint8)):
            errors.append(f"recv_x rows of expert {e} differ")
        if not np.array_equal(src_info[e, :n], want.src_info[e, :n]):
            errors.append(f"src_info of expert {e} differs")
        if scales is not None and not same_bytes(np.ascontiguousarray(scales[e, :n]),
                                                 np.ascontiguousarray(want.recv_x_scales[e, :n])):
            errors.append(f"scales of expert {e} differ")


def _order_sensitive_rows(rng, shape):
    """bf16 expert outputs whose fp32 sums depend on their order: +-2^24, +-1, +-3 ((2^24 + 3) - 2^24 = 4, but
    (-2^24 + 3) + 2^24 = 3), so only the reference's summation order gives the reference's bytes."""
    values = rng.choice(np.array([2.0 ** 24, 1.0, 3.0], np.float32), shape)
    return (values * rng.choice(np.array([-1.0, 1.0], np.float32), shape)).astype(reference.bfloat16)


def _round(buf, comm, case: Case, seed: int, hook=False, zero_copy=False, use_out=False, order_sensitive=False,
           bf16_partials=False, wait_stats=(None, None), delay_ns: int = 0, use_logfmt=False, plain_tuple=False):
    """One dispatch + combine of ``case``; returns this rank's list of mismatches. The expert outputs sum
    exactly in fp32 (small integers, power-of-two weights), or with ``order_sensitive`` do not. ``bf16_partials``:
    this rank's choice (the combine's argument); then the inputs must also tell the two wire formats apart.
    ``wait_stats``: the dispatch's and the combine's ``*_wait_recv_cost_stats`` arrays (or None); ``delay_ns``:
    this rank's dispatch is queued behind a kernel spinning that long (a late rank); ``use_logfmt``: this rank's
    choice of LogFMT-10 partials (cupy_ep/logfmt.py; the kernel reproduces its decoded values bit for bit);
    ``plain_tuple``: the combine gets the handle as a plain tuple of its items (DeepEP's callers may rebuild it),
    whose slots the combine computes again from ``topk_idx``."""
    import cupy
    rank, R = comm.Get_rank(), comm.Get_size()

    def prepare():  # this rank's inputs; every rank's, and the reference's answers, before any collective call
        x, idx, w, E = _inputs(case, comm, seed)
        rng = np.random.default_rng([seed, rank, 99])
        shape = (E // R, R * MAX_TOKENS, case.hidden)
        y = _order_sensitive_rows(rng, shape) if order_sensitive else _small_int_rows(rng, shape)
        weights = (np.float32(2.0) ** rng.integers(-2, 3, size=w.shape)).astype(np.float32)
        if bf16_partials or use_logfmt:
            # weights of 11 significant bits (x (1 + 2^-10)): a partial of even one expert row is then no bf16
            # value, so the formats differ also where each rank holds one expert of a token (8 ranks); the sums
            # stay exact in fp32 (at most 21 significant bits)
            weights = (weights * np.float32(1 + 2 ** -10)).astype(np.float32)
        return x, idx, E, y, weights

    x, idx, E, y, weights = _step(buf, comm, "preparing the inputs", prepare)
    gathered = gather_all(comm, (x, idx, y, weights))

    def references(gathered):
        want = reference.low_latency_dispatch([g[0] for g in gathered], [g[1] for g in gathered], MAX_TOKENS, E,
                                              rank, use_fp8=case.use_fp8, round_scale=case.round_scale,
                                              use_ue8m0=case.use_ue8m0)
        want_c = reference.low_latency_combine([g[2] for g in gathered], [g[1] for g in gathered],
                                               [g[3] for g in gathered], MAX_TOKENS, E, rank,
                                               bf16_partials=bf16_partials, use_logfmt=use_logfmt)
        # (not for order-sensitive rows: dominated by +-2^24, they cross every format alike once each rank holds few
        # experts of a token, as at 4 ranks; the small-integer rounds of the same tests tell the formats apart)
        if (bf16_partials or use_logfmt) and x.shape[0] > 0 and not order_sensitive:
            other = reference.low_latency_combine([g[2] for g in gathered], [g[1] for g in gathered],
                                                  [g[3] for g in gathered], MAX_TOKENS, E, rank)
            assert not same_bytes(want_c, other), "the inputs give the same bytes with 24-bit and other partials"
        return want, want_c

    want, want_c = _step(buf, comm, "the reference", references, gathered)
    del gathered
    L = E // R

    def dispatch():
        stats = _dev(np.zeros(L, dtype=np.int32), case.lib)
        if delay_ns:
            from cupy_ep import jit
            jit.get_kernel("probes/timing.cu", "ep::spin_ns")((1,), (1,), (np.int64(delay_ns),))  # the current stream
        out_x, count, handle, _, h = buf.low_latency_dispatch(
            _dev(x, case.lib), _dev(idx, case.lib), MAX_TOKENS, E, cumulative_local_expert_recv_stats=stats,
            dispatch_wait_recv_cost_stats=wait_stats[0], use_fp8=case.use_fp8, round_scale=case.round_scale,
            use_ue8m0=case.use_ue8m0, return_recv_hook=hook)
        if hook:
            h()
        return out_x, count, handle, stats

    out_x, count, handle, stats = _step(buf, comm, "low_latency_dispatch", dispatch)
    errors: list = []

    def check_dispatch():
        _compare_dispatch(errors, (out_x, count, handle), want, case, idx)
        if not np.array_equal(to_numpy(stats), want.recv_count):
            errors.append("cumulative_local_expert_recv_stats != recv_count")

    _guarded(comm, errors, "comparing the dispatch", check_dispatch)

    def combine():
        out = _dev(np.zeros((idx.shape[0], case.hidden), dtype=reference.bfloat16), case.lib) if use_out else None
        y_arg = _dev(y, case.lib)
        if zero_copy:
            target = buf.get_next_low_latency_combine_buffer(handle)
            target[...] = y_arg
            y_arg = None
        combined, _, h = buf.low_latency_combine(y_arg, _dev(idx, case.lib), _dev(weights, case.lib),
                                                 tuple(handle) if plain_tuple else handle,
                                                 zero_copy=zero_copy, return_recv_hook=hook, out=out,
                                                 bf16_partials=bf16_partials, use_logfmt=use_logfmt,
                                                 combine_wait_recv_cost_stats=wait_stats[1])
        if hook:
            h()
        return combined, out

    combined, out = _step(buf, comm, "low_latency_combine", combine)

    def check_combine():
        if use_out and combined is not out:
            errors.append("combine(out=...) did not return out")
        cupy.cuda.runtime.deviceSynchronize()
        if not same_bytes(combined, want_c):
            errors.append("combined_x differs")
        buf.check_health()

    _guarded(comm, errors, "comparing the combine", check_combine)
    return errors


@pytest.mark.parametrize("force_put", [False, True], ids=["store", "put"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_low_latency_matches_reference(comm, ll_buf, case, force_put):
    if case.lib == "torch":
        pytest.importorskip("torch")
    use_put_path(ll_buf, force_put)
    try:
        errors = _round(ll_buf, comm, case, seed=1)
    finally:
        ll_buf.impl._ll.force_put = False
    assert all_ok(comm, not errors), f"rank {comm.Get_rank()}: {errors}"


@pytest.mark.parametrize("hook", [False, True], ids=["one-launch", "hook"])
def test_wait_cost_stats_grow_by_each_source_ranks_wait(comm, ll_buf, hook):
    """dispatch_/combine_wait_recv_cost_stats ([R] int64) gain, per source rank, the SM clock cycles the receive
    phase waited for it: the dispatch waits for a count from every (local expert, source), so every entry grows;
    the combine waits for the partials of each rank that holds a kept entry of this rank's tokens (not for its own
    in one launch: those it computes itself). Nothing else changes; the growth stays below what the call's wall
    time allows; the data still match the reference."""
    import time

    import cupy
    rank, R = comm.Get_rank(), comm.Get_size()
    case = CASES[1]  # fp8
    start = np.arange(1, R + 1, dtype=np.int64) * 1000
    stats = (cupy.asarray(start), cupy.asarray(start))
    cupy.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    errors = _round(ll_buf, comm, case, seed=5, hook=hook, wait_stats=stats)
    cupy.cuda.runtime.deviceSynchronize()
    elapsed_s = time.perf_counter() - t0
    grew_d, grew_c = (to_numpy(a) - start for a in stats)
    _, idx, _, E = _inputs(case, comm, 5)
    L = E // R
    # the cycles any one wait can take, with margin: the call's whole wall time at 1.5 x the maximum clock
    cycles_cap = elapsed_s * cupy.cuda.Device().attributes["ClockRate"] * 1e3 * 1.5
    holders = np.zeros(R, dtype=bool)  # the ranks holding a kept entry of this rank's tokens
    holders[np.unique(idx[idx >= 0] // L)] = True
    if not hook:
        holders[rank] = False
    if stats[0].dtype != np.int64 or stats[0].shape != (R,):
        errors.append(f"dispatch_wait_recv_cost_stats became {stats[0].dtype} {stats[0].shape}")
    if not (grew_d > 0).all() or (grew_d > L * cycles_cap).any():
        errors.append(f"dispatch wait cycles grew by {grew_d}: want each in (0, {L * cycles_cap:.3g}]")
    want_grow = grew_c[holders] > 0
    if not want_grow.all() or (grew_c[~holders] != 0).any() or (grew_c > idx.shape[0] * cycles_cap).any():
        errors.append(f"combine wait cycles grew by {grew_c}: want > 0 exactly at {np.flatnonzero(holders)}")
    assert all_ok(comm, not errors), f"rank {rank}: {errors}"


def test_rdma_buffer_view_is_the_low_latency_buffer(comm, ll_buf):
    """get_local_buffer_tensor(use_rdma_buffer=True) views the low-latency buffer itself (either transport): its
    whole num_rdma_bytes, starting at the address the kernels get as their base."""
    view = ll_buf.get_local_buffer_tensor(np.uint8, use_rdma_buffer=True)
    words = ll_buf.get_local_buffer_tensor(np.int64, 4, offset=64, use_rdma_buffer=True)
    ok = (view.shape == (ll_buf.num_rdma_bytes,) and view.data.ptr == ll_buf.impl._ll.base
          and words.data.ptr == ll_buf.impl._ll.base + 64)
    assert all_ok(comm, ok), f"rank {comm.Get_rank()}: view {view.shape} at {view.data.ptr:#x}"


def test_wait_cost_stats_point_at_a_late_rank(comm, ll_buf):
    """Rank 1 starts its dispatch 5 ms late (a spin kernel ahead of it on its stream): every other rank's
    dispatch_wait_recv_cost_stats[1] grows by at least its L counts' worth of milliseconds and by more than ten
    times any other entry. Needs two ranks. Where ranks share a GPU (IPC transport) every peer is also late by the
    time slices of the shared GPU (4 ranks on one GPU: ~0.15 s of waiting for a punctual rank, 0.33 s for
    the 5 ms late one), so there the late rank is 0.5 s late."""
    import cupy
    rank, R = comm.Get_rank(), comm.Get_size()
    if R < 2:
        pytest.skip("needs a second rank to be late")
    case, late, delay_s = CASES[1], 1, (0.5 if ranks_share_a_gpu(comm) else 5e-3)
    stats = (cupy.zeros(R, dtype=cupy.int64), None)
    errors = _round(ll_buf, comm, case, seed=6, wait_stats=stats, delay_ns=int(delay_s * 1e9) if rank == late else 0)
    grew = to_numpy(stats[0])
    L = _experts(case, R) // R
    # at least half the delay per count, at a clock of at least 0.5 GHz (H200: up to 1.98 GHz)
    if rank != late and (grew[late] < L * delay_s / 2 * 0.5e9 or grew[late] <= 10 * np.delete(grew, late).max()):
        errors.append(f"wait cycles per source rank {grew}: rank {late} was {delay_s * 1e3:.0f} ms late")
    assert all_ok(comm, not errors), f"rank {rank}: {errors}"


@pytest.mark.parametrize("hook", [False, True], ids=["one-launch", "hook"])
def test_combine_sums_in_the_reference_order(comm, ll_buf, hook):
    """Expert outputs whose fp32 sums depend on the order: the combine's bytes match the reference's only if the
    kernels add per expert rank k ascending, then the ranks ascending (the own rank's partial in the receive
    phase in one launch, through the buffer with a hook), as reference.low_latency_combine defines."""
    errors = _round(ll_buf, comm, CASES[0], seed=21, hook=hook, order_sensitive=True)
    assert all_ok(comm, not errors), f"rank {comm.Get_rank()}: {errors}"


@pytest.mark.parametrize("force_put", [False, True], ids=["store", "put"])
@pytest.mark.parametrize("hook", [False, True], ids=["one-launch", "hook"])
def test_bf16_partials_are_each_ranks_own_choice(comm, ll_buf, hook, force_put):
    """bf16_partials: the owner asks for bf16 partials in its meta flag, the expert ranks round to bf16 for it.
    Rounds with rank 0 only, then every rank, choosing it, against the reference with each rank's own choice
    (inputs whose sums differ between the formats; order-sensitive ones in the last round)."""
    rank = comm.Get_rank()
    if comm.Get_size() == 1:
        pytest.skip("one rank: every partial is the owner's own, which is never rounded (no choice to test)")
    use_put_path(ll_buf, force_put)
    errors = []
    try:
        for i, (choice, order_sensitive) in enumerate(((rank == 0, False), (True, False), (rank != 0, True))):
            errors += [f"round {i}: {e}" for e in _round(ll_buf, comm, CASES[0], seed=31 + i, hook=hook,
                                                          order_sensitive=order_sensitive, bf16_partials=choice)]
    finally:
        ll_buf.impl._ll.force_put = False
    assert all_ok(comm, not errors), f"rank {rank}: {errors}"


@pytest.mark.parametrize("force_put", [False, True], ids=["store", "put"])
@pytest.mark.parametrize("hook", [False, True], ids=["one-launch", "hook"])
def test_use_logfmt_is_each_ranks_own_choice_and_exact(comm, ll_buf, hook, force_put):
    """use_logfmt: the owner asks for LogFMT-10 partials in its meta flag, the expert ranks encode them so (its own
    partials too), the owner decodes; the result equals the reference's bit for bit (cupy_ep/logfmt.py fixes every
    operation). Rounds with rank 0 only, every rank, and the others, the last two at the decode shape (FP8, hidden
    7168, 256 experts) and with order-sensitive sums."""
    rank = comm.Get_rank()
    use_put_path(ll_buf, force_put)
    errors = []
    rounds = ((CASES[0], rank == 0, False), (CASES[4], True, False), (CASES[0], rank != 0, True))
    try:
        for i, (case, choice, order_sensitive) in enumerate(rounds):
            errors += [f"round {i}: {e}" for e in _round(ll_buf, comm, case, seed=41 + i, hook=hook,
                                                          order_sensitive=order_sensitive, use_logfmt=choice)]
    finally:
        ll_buf.impl._ll.force_put = False
    assert all_ok(comm, not errors), f"rank {rank}: {errors}"


@pytest.mark.parametrize("force_put", [False, True], ids=["store", "put"])
def test_hook_zero_copy_out_and_alternating_buffers(comm, ll_buf, force_put):
    """Five consecutive rounds (both buffers used twice) mixing hook mode, zero_copy and out=."""
    use_put_path(ll_buf, force_put)
    errors = []
    try:
        for i, (hook, zero_copy, use_out) in enumerate([(True, False, False), (False, True, False),
                                                        (True, True, True), (False, False, True),
                                                        (True, False, False)]):
            errors += [f"round {i}: {e}" for e in _round(ll_buf, comm, CASES[1], seed=10 + i, hook=hook,
                                                         zero_copy=zero_copy, use_out=use_out)]
    finally:
        ll_buf.impl._ll.force_put = False
    assert all_ok(comm, not errors), f"rank {comm.Get_rank()}: {errors}"


_SLOW_FILL = r"""
extern "C" __global__ void slow_fill(unsigned short* x, long long n, unsigned short value, long long spin_ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)spin_ns);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = value;
}
"""


def _bf16_bits(v: float) -> int:
    return int(np.array(v, np.float32).view(np.uint32)) >> 16  # exact for the small integers used here


@pytest.mark.parametrize("hook,two_streams", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["one-launch", "hook", "one-launch-two-streams", "hook-two-streams"])
def test_calls_are_ordered_after_the_kernels_before_them(comm, ll_buf, hook, two_streams):
    """Each round a slow kernel on 8 blocks (it spins 50 us first, leaving most SMs free) fills x, then the
    expert outputs, right before the dispatch and the combine on the caller's stream, with no sync between:
    every received row must hold this round's value and every combined row the round's sum. Calls without a
    hook launch on the caller's stream itself, hooks' phases on the comm stream behind it (with
    CUPY_EP_LL_COMM_STREAM=1 every call runs on the comm stream, which waits for the caller's stream). With two
    streams the dispatch runs under one non-blocking stream and the combine under another, and the host waits for the
    combine's stream only: the combine must still follow the dispatch (it reads the dispatch's handle, and two
    low-latency kernels must never run at once), and the next round's dispatch the combine."""
    import cupy
    rank, R = comm.Get_rank(), comm.Get_size()
    T, H, K, L = 64, 2048, 8, 8
    E = L * R
    fill = cupy.RawKernel(_SLOW_FILL, "slow_fill")
    rng = np.random.default_rng([5, rank])
    idx = cupy.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64))
    w = cupy.full((T, K), 1.0 / K, dtype=cupy.float32)  # the combine's sum is the rows' value, exactly
    x = cupy.zeros((T, H), dtype=cupy.uint16).view(cupy_ep.interop.BF16)
    y = cupy.zeros((L, R * MAX_TOKENS, H), dtype=cupy.uint16).view(cupy_ep.interop.BF16)
    cupy.cuda.runtime.deviceSynchronize()
    streams = ((cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)) if two_streams
               else (cupy.cuda.get_current_stream(),) * 2)
    errors: list = []
    for i in range(6):
        value = 4 * i + rank + 1          # this round's rows from this rank
        expected = {_bf16_bits(4 * i + r + 1) for r in range(R)}

        def dispatch():
            with streams[0]:
                fill((8,), (256,), (x.view(cupy.uint16), np.int64(x.size), np.uint16(_bf16_bits(value)),
                                    np.int64(50_000)))
                recv_x, count, handle, _, h = ll_buf.low_latency_dispatch(x, idx, MAX_TOKENS, E, use_fp8=False,
                                                                          return_recv_hook=hook)
                if hook:
                    h()
                return recv_x, count, handle

        def combine():
            with streams[1]:
                fill((8,), (256,), (y.view(cupy.uint16), np.int64(y.size), np.uint16(_bf16_bits(value + 64)),
                                    np.int64(50_000)))
                out, _, h = ll_buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook)
                if hook:
                    h()
                streams[1].synchronize()  # only the combine's stream: the dispatch's must be done too
                return out

        recv_x, count, handle = _step(ll_buf, comm, f"round {i}: dispatch", dispatch)
        out = _step(ll_buf, comm, f"round {i}: combine", combine)
        with streams[1]:
            got, n, got_c = to_numpy(recv_x).view(np.uint16), to_numpy(count), to_numpy(out).view(np.uint16)
        for e in range(L):
            seen = set(np.unique(got[e, :n[e]]).tolist())
            if not seen <= expected:
                errors.append(f"round {i}: expert {e} received values {sorted(seen - expected)[:4]} (bf16 bits), "
                              f"expected only this round's {sorted(expected)}")
        # each token's 8 entries: its experts' ranks send value(r) + 64 rows weighted 1/8 each
        owners = to_numpy(idx) // L
        # (multiples of 1/8 below 128: exact in fp32 and in the 24-bit partials, whatever the order; one rounding
        # to bf16, to nearest even, as the kernel's)
        want = np.array([sum(4 * i + r + 1 + 64 for r in row) / K for row in owners], np.float32)
        want_bits = want.astype(reference.bfloat16).view(np.uint16)
        if not np.array_equal(got_c, np.repeat(want_bits[:, None], H, axis=1)):
            errors.append(f"round {i}: combined rows differ from this round's weighted sums")
    cupy.cuda.runtime.deviceSynchronize()
    assert all_ok(comm, not errors), f"rank {comm.Get_rank()}: {errors[:4]}"


def test_dispatch_epoch_wraps_past_zero(comm, ll_buf):
    """The dispatch tells this call's counts, index entries and flags from older ones by the buffer's epoch, counted
    on the device. Started 3 dispatches before its int32 count wraps to -1 (epoch 0, the value of zeroed memory),
    rounds on both sides of the wrap match the reference and the count skips -1."""
    import cupy
    from cupy_ep.cuda.low_latency import WS_EPOCH
    ws = ll_buf.impl._ll.workspace
    cupy.cuda.runtime.deviceSynchronize()
    comm.Barrier()
    ws[WS_EPOCH:WS_EPOCH + 2] = -3
    cupy.cuda.runtime.deviceSynchronize()
    comm.Barrier()
    errors = []
    for i in range(4):  # each round: a dispatch on one buffer, a combine on the other (the dispatch's stays fixed)
        errors += [f"round {i}: {e}" for e in _round(ll_buf, comm, CASES[1], seed=70 + i)]
    epochs = sorted(ws[WS_EPOCH:WS_EPOCH + 2].get().tolist())
    if epochs != [-3, 2]:  # -3 -> -2 -> 0 (skipping -1) -> 1 -> 2 on the dispatches' buffer (epochs -2, -1, 1, 2)
        errors.append(f"epoch counts after 4 dispatches from -3: {epochs}, expected [-3, 2]")
    assert all_ok(comm, not errors), f"rank {comm.Get_rank()}: {errors}"


def test_a_hook_runs_once_and_before_the_next_call(comm, ll_buf):
    """The kernels consume each signal as they read it: with a dispatch hook pending, the next low-latency call
    raises (RuntimeError naming return_recv_hook) before launching anything; a hook's second run raises instead
    of waiting for consumed signals; afterwards a full round still matches the reference."""
    case = CASES[1]
    x, idx, _, E = _inputs(case, comm, 60)
    x_d, idx_d = _dev(x), _dev(idx)
    _, _, handle, _, hook = ll_buf.low_latency_dispatch(x_d, idx_d, MAX_TOKENS, E, return_recv_hook=True)
    problems = [bad_input_problem(lambda: ll_buf.low_latency_dispatch(x_d, idx_d, MAX_TOKENS, E),
                                  "return_recv_hook:", (RuntimeError,))]
    hook()
    problems.append(bad_input_problem(hook, "return_recv_hook:", (RuntimeError,)))
    problems = [p for p in problems if p is not None]
    errors = _round(ll_buf, comm, case, seed=61, hook=True)
    assert all_ok(comm, not problems and not errors), f"rank {comm.Get_rank()}: {problems} {errors}"


def test_combine_checks_the_handles_topk_slots(comm, ll_buf):
    """A combine whose topk_idx has another shape than the dispatch's or (check_values) other values raises
    ValueError before launching anything; a valid round still matches the reference, and so does a round whose
    combine gets the handle as a plain tuple (the slots computed again from topk_idx)."""
    case = CASES[1]
    x, idx, w, E = _inputs(case, comm, 80)
    R = comm.Get_size()
    y = _dev(np.zeros((E // R, R * MAX_TOKENS, case.hidden), dtype=np.uint16)).view(cupy_ep.interop.BF16)
    _, _, handle, _, _ = ll_buf.low_latency_dispatch(_dev(x), _dev(idx), MAX_TOKENS, E)
    idx_d, w_d = _dev(idx), _dev(np.asarray(w, np.float32))
    problems = [bad_input_problem(lambda: ll_buf.low_latency_combine(y, idx_d[1:], w_d[1:], handle), "topk_idx:",
                                  (ValueError,))]
    if ll_buf.check_values and len(idx) > 1 and not (idx == idx[0]).all():  # another routing of the same shape
        problems.append(bad_input_problem(lambda: ll_buf.low_latency_combine(y, idx_d[::-1].copy(), w_d, handle),
                                          "topk_idx: differs from the topk_idx of the dispatch", (ValueError,)))
    problems = [p for p in problems if p is not None]
    ll_buf.low_latency_combine(y, idx_d, w_d, handle)  # the dispatch's combine, so the buffers keep alternating
    errors = _round(ll_buf, comm, case, seed=81) + _round(ll_buf, comm, case, seed=82, plain_tuple=True)
    assert all_ok(comm, not problems and not errors), f"rank {comm.Get_rank()}: {problems} {errors}"


def test_cuda_graph_capture_and_replay_with_new_data(comm, ll_buf):
    """Dispatch + combine captured once; replays after new inputs are copied in give the reference's answers."""
    import cupy
    rank, R = comm.Get_rank(), comm.Get_size()
    case = CASES[1]
    x0, idx0, _, E = _inputs(case, comm, 50)
    L = E // R
    x_d, idx_d = _dev(x0), _dev(idx0)
    w_d = cupy.ones(idx0.shape, dtype=cupy.float32)
    y_d = cupy.zeros((L, R * MAX_TOKENS, case.hidden), dtype=cupy.uint16).view(cupy_ep.interop.BF16)
    cupy.cuda.runtime.deviceSynchronize()  # the inputs were made on the default stream; `stream` does not wait for it
    stream = cupy.cuda.Stream(non_blocking=True)
    errors = []

    def warm_up():  # compiles outside the capture
        with stream:
            ll_buf.low_latency_dispatch(x_d, idx_d, MAX_TOKENS, E)
            ll_buf.low_latency_combine(y_d, idx_d, w_d, ll_buf.low_latency_dispatch(x_d, idx_d, MAX_TOKENS, E)[2])
            stream.synchronize()

    def capture():  # nothing runs while capturing: no peer is waited for
        with stream:
            stream.begin_capture()
            try:
                (data, scales), count, handle, _, _ = ll_buf.low_latency_dispatch(x_d, idx_d, MAX_TOKENS, E)
                combined, _, _ = ll_buf.low_latency_combine(y_d, idx_d, w_d, handle)
            finally:
                graph = stream.end_capture()
        return data, scales, count, handle, combined, graph

    _step(ll_buf, comm, "warm-up dispatch + combine", warm_up)   # its agreement is the barrier before capture
    data, scales, count, handle, combined, graph = _step(ll_buf, comm, "graph capture", capture)
    for it in range(3):
        def prepare():
            # idx must stay (T, K): new values, same shape, from this rank's generator
            x, idx, _, _ = _inputs(case, comm, 60 + it)
            rng = np.random.default_rng([it, rank])
            return x, idx, _small_int_rows(rng, (L, R * MAX_TOKENS, case.hidden))

        x, idx, y = _step(ll_buf, comm, f"replay {it}: preparing the inputs", prepare)
        gathered = gather_all(comm, (x, idx, y))

        def references(gathered):
            want = reference.low_latency_dispatch([g[0] for g in gathered], [g[1] for g in gathered], MAX_TOKENS,
                                                  E, rank, use_fp8=True)
            ones = [np.ones(g[1].shape, dtype=np.float32) for g in gathered]
            want_c = reference.low_latency_combine([g[2] for g in gathered], [g[1] for g in gathered], ones,
                                                   MAX_TOKENS, E, rank)
            return want, want_c

        want, want_c = _step(ll_buf, comm, f"replay {it}: the reference", references, gathered)
        del gathered

        def copy_in():
            # on the graph's stream: copies on the default stream would not be ordered before the replay on this
            # non-blocking stream (stream.synchronize() waits for this stream only)
            with stream:
                x_d[...] = _dev(x)
                idx_d[...] = _dev(idx)
                y_d[...] = _dev(y)
            stream.synchronize()

        _step(ll_buf, comm, f"replay {it}: copying the inputs", copy_in)   # agreement = barrier before replay

        def replay():
            graph.launch(stream)
            stream.synchronize()

        _step(ll_buf, comm, f"replay {it}", replay)

        def compare():
            _compare_dispatch(errors, ((data, scales), count, handle), want, case, idx)
            if not same_bytes(combined, want_c):
                errors.append(f"replay {it}: combined_x differs")

        _guarded(comm, errors, f"replay {it}: comparing", compare)
    _guarded(comm, errors, "check_health", ll_buf.check_health)
    assert all_ok(comm, not errors), f"rank {rank}: {errors}"


def test_layout_matches_config(comm, ll_buf):
    """ll_carve_probe (the device's LowLatencyLayout) == config.low_latency_layout, and <= the size hint."""
    import cupy
    from cupy_ep import jit
    errors = []

    def probe():
        k = jit.get_kernel("low_latency.cu", "ep::ll_carve_probe")
        for M, H, E in ((128, 7168, 256), (16, 512, 8 * comm.Get_size()), (256, 4096, 64)):
            out = cupy.zeros(11, dtype=cupy.int64)
            k((1,), (1,), (np.int32(M), np.int32(H), np.int32(comm.Get_size()), np.int32(E), out))
            lay = cfgmod.low_latency_layout(M, H, comm.Get_size(), E)
            want = [lay[n] for n in ("signal_bytes", "send_bytes", "recv_bytes", "total_bytes", "signal_offset_1",
                                     "send_offset_0", "recv_offset_0", "dispatch_index_offset",
                                     "combine_meta_offset", "signal_ints", "combine_offset")]
            if out.get().tolist() != want:
                errors.append(f"(M, H, E) = {(M, H, E)}: device {out.get().tolist()} != config {want}")

    _guarded(comm, errors, "ll_carve_probe", probe)
    assert all_ok(comm, not errors), f"rank {comm.Get_rank()}: {errors}"


def test_bad_arguments_raise_and_buffer_stays_usable(comm, ll_buf):
    import cupy
    case = CASES[0]

    def bad_calls():  # refused on the host before any launch: nothing collective happens
        x, idx, w, E = _inputs(case, comm, 3)
        x_d, idx_d = _dev(x), _dev(idx)
        with pytest.raises(ValueError, match="^use_ue8m0"):
            ll_buf.low_latency_dispatch(x_d, idx_d, MAX_TOKENS, E, use_fp8=True, round_scale=False, use_ue8m0=True)
        with pytest.raises(ValueError, match="^x: has"):
            ll_buf.low_latency_dispatch(x_d, idx_d, 8, E)
        with pytest.raises(TypeError, match="^x"):
            ll_buf.low_latency_dispatch(x_d.view(cupy.uint16), idx_d, MAX_TOKENS, E)
        with pytest.raises(ValueError, match="^num_rdma_bytes"):
            ll_buf.low_latency_dispatch(_dev(np.zeros((4, 8192), dtype=reference.bfloat16)),
                                        _dev(np.zeros((4, 8), dtype=np.int64)), 4096, 1024)

    _step(ll_buf, comm, "the bad calls", bad_calls)
    errors = _round(ll_buf, comm, case, seed=4)
    assert all_ok(comm, not errors), f"rank {comm.Get_rank()}: {errors}"


@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_repeated_calls_without_value_checks(comm, ll_buf, lib):
    """With check_values=False (as the benchmarks run) a call whose arguments look like the last valid call's skips
    the host checks (LowLatencyState.check_dispatch / check_combine). Rounds of the same shapes still match the
    reference, and arguments that differ from the valid ones in one respect only are still refused before anything
    is launched, with the checks' errors."""
    if lib == "torch":
        pytest.importorskip("torch")
    case = dataclasses.replace(CASES[1], lib=lib)    # fp8, the same shapes in every call below
    R = comm.Get_size()
    ll_buf.check_values = False
    try:
        errors = _round(ll_buf, comm, case, seed=90) + _round(ll_buf, comm, case, seed=91)
        x, idx, w, E = _inputs(case, comm, 92)
        x_d, idx_d, w_d = _dev(x, lib), _dev(idx, lib), _dev(np.asarray(w, np.float32), lib)
        y_d = _dev(np.zeros((E // R, R * MAX_TOKENS, case.hidden), dtype=reference.bfloat16), lib)
        kw = dict(cumulative_local_expert_recv_stats=_dev(np.zeros(E // R, dtype=np.int32), lib), use_fp8=True)

        def bad_dispatches():  # the rounds' dispatch arguments, one thing changed
            wide = _dev(np.zeros((x.shape[0], 2 * case.hidden), dtype=reference.bfloat16), lib)[:, :case.hidden]
            with pytest.raises(ValueError, match="^x: must be contiguous"):
                ll_buf.low_latency_dispatch(wide, idx_d, MAX_TOKENS, E, **kw)
            with pytest.raises(ValueError, match="^use_ue8m0"):
                ll_buf.low_latency_dispatch(x_d, idx_d, MAX_TOKENS, E, use_ue8m0=True, **kw)
            with pytest.raises(TypeError, match="^num_experts: must be an int"):
                ll_buf.low_latency_dispatch(x_d, idx_d, MAX_TOKENS, np.int64(E), **kw)
            flat = _dev(np.zeros(x.size + 8, dtype=reference.bfloat16), lib)
            misaligned = flat[1:1 + x.size].reshape(x.shape)  # contiguous, 2 bytes past a 16-byte boundary
            with pytest.raises(ValueError, match="^x: must start at a multiple of 16 bytes"):
                ll_buf.low_latency_dispatch(misaligned, idx_d, MAX_TOKENS, E, **kw)

        _step(ll_buf, comm, "the bad dispatches", bad_dispatches)
        handle = _step(ll_buf, comm, "a dispatch", lambda: ll_buf.low_latency_dispatch(x_d, idx_d, MAX_TOKENS, E,
                                                                                       **kw)[2])

        def bad_combines():  # the rounds' combine arguments, one thing changed
            # a plain 5-tuple is a valid handle (its slots are computed again from topk_idx); one item short is not
            with pytest.raises(ValueError, match="^handle: must be the 5-tuple"):
                ll_buf.low_latency_combine(y_d, idx_d, w_d, tuple(handle)[:4])
            with pytest.raises(TypeError, match="^topk_weights: dtype"):
                ll_buf.low_latency_combine(y_d, idx_d, _dev(np.asarray(w, np.float64), lib), handle)
            with pytest.raises(TypeError, match="^bf16_partials: must be a bool"):
                ll_buf.low_latency_combine(y_d, idx_d, w_d, handle, bf16_partials=1)

        _step(ll_buf, comm, "the bad combines", bad_combines)
        _step(ll_buf, comm, "the dispatch's combine", lambda: ll_buf.low_latency_combine(y_d, idx_d, w_d, handle))
        errors += _round(ll_buf, comm, case, seed=93)
    finally:
        ll_buf.check_values = True
    assert all_ok(comm, not errors), f"rank {comm.Get_rank()}: {errors}"


def test_normal_mode_still_works_on_a_low_latency_buffer(comm, ll_buf):
    """The intranode dispatch runs on the same Buffer (num_nvl_bytes and num_rdma_bytes together)."""
    R = comm.Get_size()
    if R == 1:
        pytest.skip("one rank: normal mode needs 2..8 ranks")

    # SMs that fit with every rank sharing the GPU resident at once (8 ranks on one GPU: 20 each would need 160)
    config = cupy_ep.Config(num_sms=min(cupy_ep.Buffer.num_sms, ll_buf.sm_share.normal_mode_sms // 2 * 2))

    def prepare():
        rng = np.random.default_rng(comm.Get_rank())
        inp = make_inputs(rng, 64, 2048, 4, 8 * R, R)
        x = _dev(random_bf16(rng, (64, 2048)))
        idx, w = _dev(inp.topk_idx), _dev(inp.topk_weights)
        return x, idx, w, ll_buf.get_dispatch_layout(idx, 8 * R)

    x, idx, w, layout = _step(ll_buf, comm, "inputs and get_dispatch_layout", prepare)
    recv_x, _, _, _, handle, _ = _step(ll_buf, comm, "dispatch", lambda: ll_buf.dispatch(
        x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2], topk_idx=idx,
        topk_weights=w, config=config))
    combined, _, _ = _step(ll_buf, comm, "combine", lambda: ll_buf.combine(recv_x, handle, config=config))
    assert all_ok(comm, combined.shape == (64, 2048))
