"""Low-latency shrink mode (``Buffer(enable_shrink=True)``, DeepEP's fault tolerance) on the GPU, bit for bit against
cupy_ep.reference run on the masked inputs: every top-k entry whose expert lives on a masked rank is -1, and a
masked rank contributes no tokens.

Written for 4 ranks on one GPU (CUPY_EP_LL_TRANSPORT=ipc, or NVSHMEM with the ranks as CUDA MPS clients); the
tests that split the ranks into groups need 4, the others run from 2 ranks on. Each test makes its own Buffer
(short timeout) and destroys it on every rank, also on a rank that stopped calling.

Nothing hangs: the kernels are compiled and the buffer's shape cleaned on every rank before the first timed call;
inputs are gathered and the references computed before the calls; a round's dispatch and combine run back to back
and are compared afterwards (a rank comparing slowly must not look dead to the others). Steps agree over the ranks
that still call (``_step`` of test_low_latency.py on a communicator of those ranks: a failure ends the live part on
all of them together); every rank, the one that stopped included, then meets the others in one last agreement and
in ``destroy``.
"""
from __future__ import annotations

import time
import traceback

import numpy as np
import pytest

import cupy_ep
from cupy_ep import config as cfgmod, reference
from tests.helpers import all_ok, gather_all, make_inputs, random_bf16, same_bytes

pytestmark = pytest.mark.mpi(min_size=2)

M, H, K, LOCAL = 64, 1024, 4, 4   # max tokens, hidden (FP8 needs H % 512 == 0), top-k, experts per rank
TIMEOUT_S = 2.5                   # a device wait for a rank that stopped ends after this
QUICK_S = TIMEOUT_S / 2           # a call that waited for no timeout takes far less (ranks sharing one GPU)
_KERNELS = ("ep::dispatch<false, long long>", "ep::dispatch<true, long long>", "ep::combine<long long>")


def _mask_ranks(topk_idx, masked, num_experts: int, num_ranks: int) -> np.ndarray:
    """``topk_idx`` with every entry whose expert lives on a rank in ``masked`` set to -1 (a copy)."""
    idx = np.array(topk_idx, dtype=np.int64, copy=True)
    owner = np.where(idx >= 0, idx // (num_experts // num_ranks), -1)
    idx[np.isin(owner, sorted(masked))] = -1
    return idx


def _make_buffer(comm, enable_shrink: bool = True):
    """A small low-latency Buffer (short timeout), its kernels compiled and its shape cleaned on every rank."""
    import cupy
    from tests.gpu.low_latency.test_low_latency import skip_unless_usable
    skip_unless_usable(comm)
    R = comm.Get_size()
    buf = cupy_ep.Buffer(comm, num_rdma_bytes=cfgmod.low_latency_rdma_size_hint(M, H, R, LOCAL * R),
                         low_latency_mode=True, backend="cuda", timeout_s=TIMEOUT_S, enable_shrink=enable_shrink)
    with cupy.cuda.Device(buf.device_id):
        for name in _KERNELS:  # compiled (and NVSHMEM-initialised) before any rank waits for another
            buf.impl._ll.kernel(name)
        comm.Barrier()
        buf.clean_low_latency_buffer(M, H, LOCAL * R)
    return buf


def _prepare(comm, seed: int):
    """This rank's ``(x, topk_idx, topk_weights, y)`` of a round (numpy): x [T, H] bf16, topk_idx [T, K] int64
    (distinct experts per row, some -1), weights powers of two and expert outputs small integers (exact fp32 sums)."""
    rank, R = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng([seed, rank, 7])
    T, E = 48 - 3 * rank, LOCAL * R
    inp = make_inputs(rng, T, 16, K, E, R, mask_prob=0.1)
    x = random_bf16(rng, (T, H))
    w = (np.float32(2.0) ** rng.integers(-2, 3, size=inp.topk_idx.shape)).astype(np.float32)
    y = rng.integers(-8, 9, size=(LOCAL, R * M, H)).astype(np.float32).astype(reference.bfloat16)
    return x, inp.topk_idx, w, y


def _references(gathered, rank: int, use_fp8: bool, dispatch_masked=(), combine_masked=()):
    """The reference's dispatch and combine for ``rank`` (``gathered``: every rank's ``_prepare``, in rank order),
    the dispatch with the ranks of ``dispatch_masked`` masked, the combine with those of ``combine_masked``."""
    R = len(gathered)
    E = LOCAL * R

    def inputs(masked):
        xs, idxs, ws, ys = [], [], [], []
        for r, (x, idx, w, y) in enumerate(gathered):
            gone = r in masked
            xs.append(x[:0] if gone else x)
            idxs.append(idx[:0] if gone else _mask_ranks(idx, masked, E, R))
            ws.append(w[:0] if gone else w)
            ys.append(y)
        return xs, idxs, ws, ys

    xs, idxs, _, _ = inputs(set(dispatch_masked))
    want = reference.low_latency_dispatch(xs, idxs, M, E, rank, use_fp8=use_fp8)
    _, idxs, ws, ys = inputs(set(combine_masked))
    want_c = reference.low_latency_combine(ys, idxs, ws, M, E, rank)
    return want, want_c


def _call(buf, inputs, use_fp8: bool, hook: bool, stop_after_dispatch: bool = False):
    """One dispatch + combine of this rank's ``inputs`` (numpy, made device arrays first), back to back, then a
    device sync: ``(recv_x, recv_count, handle, combined_x or None, seconds of the calls)``."""
    import cupy
    from tests.gpu.low_latency.test_low_latency import _dev
    x, idx, w, y = (_dev(a) for a in inputs)
    cupy.cuda.runtime.deviceSynchronize()
    start = time.monotonic()
    recv_x, count, handle, _, h = buf.low_latency_dispatch(x, idx, M, LOCAL * buf.num_ranks, use_fp8=use_fp8,
                                                           return_recv_hook=hook)
    if hook:
        h()
    combined = None
    if not stop_after_dispatch:
        combined, _, h = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook)
        if hook:
            h()
    cupy.cuda.runtime.deviceSynchronize()
    elapsed = time.monotonic() - start
    buf.check_health()
    return recv_x, count, handle, combined, elapsed


def _compare(got, want, want_c, idx_for_slots) -> list:
    """What differs from the reference: the dispatch (rows, scales, src_info, counts, layout_range, and the handle's
    topk_slots, those of ``idx_for_slots``: the routing as the send phase saw it) and the combined output."""
    from tests.gpu.low_latency.test_low_latency import _compare_dispatch
    errors: list = []
    recv_x, count, handle, combined, _ = got
    _compare_dispatch(errors, (recv_x, count, handle), want, None, idx_for_slots)
    if want_c is not None and not same_bytes(combined, want_c):
        errors.append("combined_x differs")
    return errors


def _mask_status(buf):
    import cupy
    status = cupy.full(buf.num_ranks, -7, dtype=cupy.int32)
    buf.low_latency_query_mask_buffer(status)
    return status.get().tolist()


class _Run:
    """One rank's part of a test: ``live`` is the communicator of the ranks that still call (``_step`` agrees over
    it); errors are collected, and :meth:`finish` meets every rank and destroys the Buffer."""

    def __init__(self, comm, buf):
        self.comm, self.buf, self.errors = comm, buf, []
        self.rank = comm.Get_rank()
        self.live = comm.Dup()

    def stop(self, rank: int) -> bool:
        """Collective (every rank): ``rank`` makes no call from here on; ``live`` becomes the others'. True on
        ``rank`` itself."""
        self.live.Free()
        self.live = self.comm.Split(int(self.rank == rank), self.rank)
        return self.rank == rank

    def step(self, what, fn, *args):
        from tests.gpu.low_latency.test_low_latency import _step
        return _step(self.buf, self.live, what, fn, *args)

    def round(self, seed: int, use_fp8: bool, hook: bool, masked=(), combine_masked=None, slots_masked=None,
              stop_after_dispatch=False):
        """A round of the ranks of ``live`` (global ranks 0..n-1: the ranks past them made no call and contribute
        nothing); returns its seconds. The reference masks ``masked`` in this rank's view (the dispatch and the
        combine; ``combine_masked``: the combine's, if other); ``slots_masked``: the ranks masked when the send
        phase ran (default ``masked``), which decide the handle's topk_slots."""
        R = self.comm.Get_size()
        inputs = self.step(f"round {seed}: inputs", _prepare, self.comm, seed)
        gathered = gather_all(self.live, inputs)
        gone = set(range(len(gathered), R))
        gathered += [(x[:0], i[:0], w[:0], y) for x, i, w, y in [inputs] * len(gone)]
        combine_masked = masked if combine_masked is None else combine_masked
        want, want_c = self.step(f"round {seed}: the reference", _references, gathered, self.rank, use_fp8,
                                 gone | set(masked), gone | set(combine_masked))
        del gathered
        got = self.step(f"round {seed}: the calls", _call, self.buf, inputs, use_fp8, hook, stop_after_dispatch)
        slots = _mask_ranks(inputs[1], set(masked if slots_masked is None else slots_masked), LOCAL * R, R)
        errors = self.step(f"round {seed}: comparing", _compare, got, want,
                           None if stop_after_dispatch else want_c, slots)
        self.errors += [f"round {seed}: {e}" for e in errors]
        return got[-1]

    def finish(self, *checks):
        """Every rank: agree on the errors (and ``checks``), then destroy the Buffer (collective)."""
        try:
            ok = all_ok(self.comm, not self.errors and all(checks))
        finally:
            self.live.Free()
            self.buf.destroy()
        assert ok, f"rank {self.rank}: {self.errors}"


def _run_test(comm, body, enable_shrink: bool = True) -> None:
    """Make the Buffer (``_make_buffer``), run ``body(run)`` on every rank with the buffer's GPU current, then
    :meth:`_Run.finish`. A failure in ``body`` (the ranks that still call fail together, by ``_step``) is recorded,
    so that every rank still reaches the last agreement and ``destroy`` with the others."""
    import cupy
    run = _Run(comm, _make_buffer(comm, enable_shrink))
    with cupy.cuda.Device(run.buf.device_id):
        try:
            body(run)
        except (Exception, pytest.fail.Exception) as e:
            lines = traceback.format_exc().rstrip().splitlines()
            print("\n".join(f"[rank {run.rank}] {line}" for line in lines), flush=True)
            run.errors.append(f"{type(e).__name__}: {e}")
    run.finish()


@pytest.mark.parametrize("use_fp8, hook", [(False, False), (True, True)], ids=["bf16", "fp8-hook"])
def test_a_rank_that_stops_calling_is_masked_and_the_others_go_on(comm, use_fp8, hook):
    """The last rank makes one round with the others and then no call (it still destroys the Buffer with them).
    The others' next dispatch waits for it until the timeout, masks it and finishes within about the timeout, with
    no error; their later rounds (BF16, FP8, hook and one launch) and a clean_low_latency_buffer among them take
    no timeout. Every round is the reference's
    with the rank masked (the first one's topk_slots: as the send phase saw it, before the mask); the mask reads
    [0, .., 0, 1] on the others and the buffer stays usable."""
    dead = comm.Get_size() - 1

    def body(run):
        buf = run.buf
        run.round(0, use_fp8, hook)
        if run.stop(dead):
            return
        timings = [run.round(1, use_fp8, hook, masked={dead}, slots_masked=())]
        for i, (fp8, h) in enumerate([(True, False), (False, True), (use_fp8, hook)]):
            timings.append(run.round(2 + i, fp8, h, masked={dead}))
            if i == 0:  # a clean meets the ranks that call only
                start = time.monotonic()
                run.step("clean_low_latency_buffer", buf.clean_low_latency_buffer, M, H, LOCAL * (dead + 1))
                timings.append(time.monotonic() - start)
        status = run.step("query", _mask_status, buf)
        if status != [0] * dead + [1]:
            run.errors.append(f"mask status {status}")
        if not timings[0] < 2 * TIMEOUT_S or not all(t < QUICK_S for t in timings[1:]):
            run.errors.append(f"round times {timings}: want the first below {2 * TIMEOUT_S} s, the others "
                              f"below {QUICK_S} s")
        print(f"rank {run.rank}: round times {[round(t, 3) for t in timings]} s", flush=True)

    _run_test(comm, body)


def test_a_rank_that_stops_after_a_dispatch_is_masked_by_the_combine(comm):
    """The last rank makes a full round and a dispatch, then no call. The others' combine waits for its meta and
    partials until the timeout and masks it: their combined_x is the reference's without that rank's experts,
    bit for bit. The expert side serves the owners whose meta is in first: were a rank to wait for the missing
    owner first, its partials would reach the other owners only after their own timeout, and they would mask it
    too (a wrong sum). The next round takes no timeout."""
    dead = comm.Get_size() - 1

    def body(run):
        buf = run.buf
        run.round(0, True, False)
        if run.rank == dead:  # the dispatch with the others (its own outputs checked too), then nothing
            run.round(1, True, False, stop_after_dispatch=True)
        else:
            run.round(1, True, False, combine_masked={dead})  # (its dispatch: every rank took part)
        if run.stop(dead):
            return
        quick = run.round(2, False, True, masked={dead})
        status = run.step("query", _mask_status, buf)
        if status != [0] * dead + [1] or not quick < QUICK_S:
            run.errors.append(f"mask status {status}, the round after took {quick:.3f} s")

    _run_test(comm, body)


def _groups_mask(buf, groups, rank):
    """Mask, on this rank, every rank outside its group of ``groups``."""
    mine = next(g for g in groups if rank in g)
    for r in range(buf.num_ranks):
        if r not in mine:
            buf.low_latency_update_mask_buffer(r, True)
    return mine


@pytest.mark.mpi(min_size=4)
def test_masking_by_hand_splits_the_ranks_and_cleaning_joins_them(comm):
    """Every rank alive: ranks {0, 1} mask {2, 3} by hand and {2, 3} mask {0, 1}; both pairs then run as EP2 of their
    own, each round bit for bit the reference's with the other pair masked, and without a timeout. Then
    low_latency_clean_mask_buffer and clean_low_latency_buffer on every rank: all of them take part again. Then
    rank 3 alone is masked on the others (and masks them); low_latency_update_mask_buffer(r, False) and a clean join
    it again. Bad arguments of the mask methods raise, naming the argument, and the buffer stays usable."""
    R = comm.Get_size()

    def body(run):
        buf, rank = run.buf, run.rank
        run.round(0, False, False)
        mine = run.step("masking by hand", _groups_mask, buf, ({0, 1}, set(range(2, R))), rank)
        others = set(range(R)) - mine
        status = run.step("query", _mask_status, buf)
        if status != [int(r in others) for r in range(R)]:
            run.errors.append(f"mask status after masking by hand: {status}")
        for seed, (fp8, hook) in enumerate([(False, False), (True, True)], start=1):  # each pair on its own
            if not run.round(seed, fp8, hook, masked=others) < QUICK_S:
                run.errors.append(f"split round {seed} took a timeout")
        run.step("cleaning the mask", buf.low_latency_clean_mask_buffer)
        run.step("clean_low_latency_buffer", buf.clean_low_latency_buffer, M, H, LOCAL * R)
        if run.step("query", _mask_status, buf) != [0] * R:
            run.errors.append("mask not clean after low_latency_clean_mask_buffer")
        if not run.round(3, True, False) < QUICK_S:
            run.errors.append("the joined round took a timeout")
        # rank 3 apart, then back by unmasking
        alone = {3} if rank != 3 else set(range(R)) - {3}
        # one collective step per rank however many ranks it masks (rank 3 masks three, the others one)
        run.step("masking rank 3 apart", _set_mask, buf, alone, True)
        run.round(4, False, True, masked=alone)
        run.step("unmasking", _set_mask, buf, alone, False)
        run.step("clean_low_latency_buffer", buf.clean_low_latency_buffer, M, H, LOCAL * R)
        run.round(5, True, True)
        run.step("bad arguments", _bad_mask_arguments, buf)
        run.round(6, False, False)

    _run_test(comm, body)


def _set_mask(buf, ranks, masked: bool) -> None:
    for r in sorted(ranks):
        buf.low_latency_update_mask_buffer(r, masked)


def _bad_mask_arguments(buf):
    import cupy
    R = buf.num_ranks
    for bad in (-1, R):
        with pytest.raises(ValueError, match="^rank_to_mask: must be in"):
            buf.low_latency_update_mask_buffer(bad, True)
    with pytest.raises(TypeError, match="^rank_to_mask: must be an int"):
        buf.low_latency_update_mask_buffer(True, True)
    with pytest.raises(TypeError, match="^mask: must be a bool"):
        buf.low_latency_update_mask_buffer(0, 1)
    with pytest.raises(TypeError, match="^mask_status: dtype"):
        buf.low_latency_query_mask_buffer(cupy.zeros(R, dtype=cupy.int64))
    with pytest.raises(ValueError, match="^mask_status: must have shape"):
        buf.low_latency_query_mask_buffer(cupy.zeros(R + 1, dtype=cupy.int32))
    with pytest.raises(TypeError, match="^mask_status: is a host array"):
        buf.low_latency_query_mask_buffer(np.zeros(R, dtype=np.int32))
    try:
        import torch
    except ImportError:
        return
    status = torch.full((R,), -7, dtype=torch.int32, device=f"cuda:{buf.device_id}")
    buf.low_latency_query_mask_buffer(status)
    torch.cuda.synchronize()
    assert status.tolist() == [0] * R


@pytest.mark.mpi(min_size=4)
def test_a_graph_replay_reads_the_mask_when_it_runs(comm):
    """A dispatch + combine captured with no rank masked: replayed after ranks {0, 1} and {2, 3} masked each other
    by hand, each pair's outputs are the reference's with the other pair masked (the kernels read the mask at every
    launch, nothing of it is captured); after the mask is cleaned (and the buffer), a replay is the full reference's."""
    import cupy
    from tests.gpu.low_latency.test_low_latency import _dev
    R = comm.Get_size()

    def body(run):
        buf, rank = run.buf, run.rank
        stream = cupy.cuda.Stream(non_blocking=True)
        inputs = run.step("inputs", _prepare, comm, 40)
        arrays = [_dev(a) for a in inputs]
        cupy.cuda.runtime.deviceSynchronize()

        def capture():
            x, idx, w, y = arrays
            with stream:
                stream.begin_capture()
                try:
                    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, LOCAL * R, use_fp8=True)
                    combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
                finally:
                    graph = stream.end_capture()
            return graph, (recv_x, count, handle, combined)

        graph, outputs = run.step("capture", capture)
        gathered = gather_all(comm, inputs)

        def replay_and_compare(masked):
            want, want_c = _references(gathered, rank, True, masked, masked)
            cupy.cuda.runtime.deviceSynchronize()
            comm.Barrier()  # (every rank alive) the replays start together
            start = time.monotonic()
            graph.launch(stream)
            stream.synchronize()
            elapsed = time.monotonic() - start
            buf.check_health()
            errors = _compare(outputs + (elapsed,), want, want_c, _mask_ranks(inputs[1], masked, LOCAL * R, R))
            return errors + ([f"a replay took {elapsed:.3f} s"] if not elapsed < QUICK_S else [])

        run.errors += [f"replay, none masked: {e}" for e in run.step("replay", replay_and_compare, set())]
        mine = run.step("masking by hand", _groups_mask, buf, ({0, 1}, set(range(2, R))), rank)
        run.errors += [f"replay, split: {e}" for e in run.step("replay", replay_and_compare,
                                                               set(range(R)) - mine)]
        run.step("cleaning the mask", buf.low_latency_clean_mask_buffer)
        run.step("clean_low_latency_buffer", buf.clean_low_latency_buffer, M, H, LOCAL * R)
        run.errors += [f"replay, joined: {e}" for e in run.step("replay", replay_and_compare, set())]

    _run_test(comm, body)


def test_shrink_methods_need_enable_shrink(comm):
    """On a low-latency Buffer without enable_shrink the mask methods raise ValueError naming enable_shrink before
    anything runs, and the buffer stays usable (a round matches the reference)."""
    import cupy
    R = comm.Get_size()

    def body(run):
        buf = run.buf

        def refused():
            for call in (lambda: buf.low_latency_update_mask_buffer(0, True),
                         lambda: buf.low_latency_query_mask_buffer(cupy.zeros(R, dtype=cupy.int32)),
                         buf.low_latency_clean_mask_buffer):
                with pytest.raises(ValueError, match="^enable_shrink:"):
                    call()
        run.step("the mask methods", refused)
        run.round(0, True, False)

    _run_test(comm, body, enable_shrink=False)
