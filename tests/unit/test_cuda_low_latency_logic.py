"""GPU-less checks of the low-latency GPU path's pure-Python logic: layout sizes vs the DeepEP size hint,
NVSHMEM environment defaults, the teardown decision of LowLatencyState.destroy; and a numpy model of the
dispatch's wire scheme in low_latency.cu (messages once per destination rank at [src][token], then the index
table [L][R][M] of epoch << 32 | token entries, the row's only signal, the per-expert counts tagged with the
epoch, the receive's even split of all rows over the blocks) on the layout's byte offsets, over stale bytes of
older epochs, checked against the reference.
The model is written from the kernel's description, not run from it: it checks the scheme, not the CUDA code."""
import os

import numpy as np
import pytest

from cupy_ep import config, ids, reference
from cupy_ep.cuda.low_latency import set_nvshmem_env


@pytest.mark.parametrize("hidden", [512, 1024, 2048, 4096, 5120, 7168, 8192])
@pytest.mark.parametrize("max_tokens", [2, 64, 128, 256])
@pytest.mark.parametrize("ranks,experts", [(2, 2), (2, 256), (4, 288), (8, 64), (16, 256)])
def test_layout_fits_in_the_size_hint(hidden, max_tokens, ranks, experts):
    lay = config.low_latency_layout(max_tokens, hidden, ranks, experts)
    assert lay["total_bytes"] <= config.low_latency_rdma_size_hint(max_tokens, hidden, ranks, experts)
    for key in ("signal_bytes", "send_bytes", "recv_bytes", "send_offset_0", "recv_offset_0"):
        assert lay[key] % config.ALIGN == 0, key
    assert lay["msg_bytes"] % 16 == 0 and lay["msg_bytes"] >= 16 + hidden + hidden // 32  # holds an FP8 message
    assert lay["send_offset_0"] == 2 * lay["signal_bytes"]
    assert lay["recv_offset_0"] == 2 * (lay["signal_bytes"] + lay["send_bytes"])
    assert lay["total_bytes"] == 2 * (lay["signal_bytes"] + lay["send_bytes"] + lay["recv_bytes"])


def test_signal_region_holds_dispatch_counts_and_combine_flags():
    # dispatch: counts int64 [L][R] = 2E ints, then the combine's token flags [R][M] + meta flags [R] (they never
    # overlap: the counts are not consumed, the flags are); not dependent on hidden
    a = config.low_latency_layout(128, 7168, 2, 256)
    b = config.low_latency_layout(128, 512, 2, 256)
    c = config.low_latency_layout(16, 512, 2, 256)
    assert a["signal_ints"] == b["signal_ints"] == 2 * 256 + 2 * 128 + 2
    assert a["signal_offset_1"] == b["signal_offset_1"] == config.align_up(4 * 770) == 3200
    assert c["signal_ints"] == 2 * 256 + 2 * 16 + 2 and c["signal_offset_1"] == config.align_up(4 * 546)


def test_nvshmem_env_defaults(monkeypatch):
    for k in ("NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "NVSHMEM_DISABLE_NCCL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "0")
    set_nvshmem_env(single_node=False)
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"            # multicast is never used
    assert "NVSHMEM_REMOTE_TRANSPORT" not in os.environ          # several nodes: the NIC transport stays
    set_nvshmem_env(single_node=True)
    assert os.environ["NVSHMEM_REMOTE_TRANSPORT"] == "none"
    monkeypatch.setenv("NVSHMEM_REMOTE_TRANSPORT", "ibrc")
    set_nvshmem_env(single_node=True)
    assert os.environ["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc"     # a user setting wins


class _FakeComm:
    def __init__(self, rank, reasons_of_others):
        self.rank, self.others = rank, reasons_of_others

    def allgather(self, mine):
        return self.others[:self.rank] + [mine] + self.others[self.rank:]


class _FakeNvshmem:
    def __init__(self):
        self.calls = []

    def barrier_all(self):
        self.calls.append("barrier_all")

    def free(self, ptr):
        self.calls.append(("free", ptr))

    def finalize(self):
        self.calls.append("finalize")


def _fake_state(comm, rank=0):
    from types import SimpleNamespace

    from cupy_ep.cuda.low_latency import LowLatencyState
    state = LowLatencyState.__new__(LowLatencyState)
    state.buf = SimpleNamespace(comm=comm, rank=rank)
    state.nv, state.base, state.leaked = _FakeNvshmem(), 0x1000, None
    state.memory = state.nvlink_peers = state.no_peers = state.workspace = object()
    return state


def test_destroy_tears_nvshmem_down_when_every_device_is_healthy(monkeypatch):
    import cupy
    monkeypatch.setattr(cupy.cuda.runtime, "deviceSynchronize", lambda: None)
    state = _fake_state(_FakeComm(0, [None]))
    nv = state.nv
    state.destroy()
    assert nv.calls == ["barrier_all", ("free", 0x1000), "finalize"]
    assert state.nv is None and state.leaked is None
    state.destroy()                                            # idempotent
    assert len(nv.calls) == 3


@pytest.mark.parametrize("broken", ["here", "peer"])
def test_destroy_skips_every_nvshmem_collective_when_a_device_failed(monkeypatch, broken):
    """No rank may enter NVSHMEM's (timeout-less) barrier when a peer cannot: every rank skips it alike."""
    import cupy

    def sync():
        raise cupy.cuda.runtime.CUDARuntimeError(700)         # cudaErrorIllegalAddress: sticky

    monkeypatch.setattr(cupy.cuda.runtime, "deviceSynchronize", sync if broken == "here" else (lambda: None))
    state = _fake_state(_FakeComm(1, ["CUDARuntimeError: peer" if broken == "peer" else None]), rank=1)
    nv = state.nv
    with pytest.warns(RuntimeWarning, match="NVSHMEM not finalized"):
        state.destroy()
    assert nv.calls == [] and state.nv is None
    assert ("rank(s) [0]" if broken == "peer" else "rank(s) [1]") in state.leaked


def test_resolve_transport_argument_env_default(monkeypatch):
    from cupy_ep.cuda.low_latency import resolve_transport
    monkeypatch.delenv("CUPY_EP_LL_TRANSPORT", raising=False)
    assert resolve_transport(None) == "nvshmem"
    monkeypatch.setenv("CUPY_EP_LL_TRANSPORT", "ipc")
    assert resolve_transport(None) == "ipc"
    assert resolve_transport("nvshmem") == "nvshmem"            # the argument wins
    with pytest.raises(ValueError, match="^low_latency_transport: must be one of"):
        resolve_transport("rdma")
    monkeypatch.setenv("CUPY_EP_LL_TRANSPORT", "bogus")
    with pytest.raises(ValueError, match="^CUPY_EP_LL_TRANSPORT: must be one of"):
        resolve_transport(None)


def test_force_put_is_refused_on_the_ipc_transport(monkeypatch):
    """Env CUPY_EP_LL_FORCE_PUT asks for NVSHMEM puts; with IPC (no puts) it is an error, not a no-op; so is
    setting the state's force_put."""
    from cupy_ep.cuda.low_latency import LowLatencyState, resolve_force_put
    monkeypatch.delenv("CUPY_EP_LL_FORCE_PUT", raising=False)
    assert resolve_force_put("nvshmem") is False and resolve_force_put("ipc") is False
    for value, expected in (("0", False), ("", False), ("1", True)):
        monkeypatch.setenv("CUPY_EP_LL_FORCE_PUT", value)
        assert resolve_force_put("nvshmem") is expected
    with pytest.raises(ValueError, match="^CUPY_EP_LL_FORCE_PUT: .*'ipc'"):
        resolve_force_put("ipc")
    state = LowLatencyState.__new__(LowLatencyState)
    state.force_put = True                                      # NVSHMEM (the class default): allowed
    assert state.force_put is True
    state.transport, state.force_put = "ipc", False
    with pytest.raises(ValueError, match="^force_put: the 'ipc' low-latency transport has no puts"):
        state.force_put = True
    assert state.force_put is False


def test_num_blocks_is_the_rank_s_sms_unless_the_env_asks_for_fewer(monkeypatch):
    from cupy_ep.cuda.low_latency import resolve_num_blocks
    monkeypatch.delenv("CUPY_EP_LL_NUM_BLOCKS", raising=False)
    assert resolve_num_blocks(132) == 132
    monkeypatch.setenv("CUPY_EP_LL_NUM_BLOCKS", "30")
    assert resolve_num_blocks(132) == 30
    for bad in ("0", "133", "many"):
        monkeypatch.setenv("CUPY_EP_LL_NUM_BLOCKS", bad)
        with pytest.raises(ValueError, match=r"^CUPY_EP_LL_NUM_BLOCKS: must be an integer in \[1, 132\]"):
            resolve_num_blocks(132)


def test_a_garbage_handle_from_a_timed_out_dispatch_reports_the_timeout(monkeypatch):
    """check_values reads the handle back; values that fail the checks after the dispatch's device wait timed out
    are its garbage, and the CommTimeoutError is what the caller gets (not a ValueError about layout_range)."""
    from types import SimpleNamespace

    from cupy_ep import validate
    from cupy_ep.cuda.low_latency import LowLatencyState
    from cupy_ep.errors import CommTimeoutError

    def bad_values(*args, **kwargs):
        raise ValueError("handle.layout_range: a (begin << 32) | count entry runs outside [0, 512) rows")

    def timed_out():
        raise CommTimeoutError("rank 3: device wait timed out after 10.0 s", {"kernel": "low_latency_dispatch"})

    monkeypatch.setattr(validate, "check_low_latency_handle", bad_values)
    state = LowLatencyState.__new__(LowLatencyState)
    state.buf = SimpleNamespace(num_ranks=4, device_id=0, check_health=timed_out)
    with pytest.raises(CommTimeoutError, match="device wait timed out"):
        state.check_handle(object(), check_values=True)
    with pytest.raises(ValueError, match="^handle.layout_range"):
        state.check_handle(object(), check_values=False)     # nothing was read back: nothing to blame
    state.buf.check_health = lambda: None
    with pytest.raises(ValueError, match="^handle.layout_range"):
        state.check_handle(object(), check_values=True)      # a healthy buffer: the handle itself is bad


def test_destroy_closes_the_ipc_buffer_and_touches_no_nvshmem(monkeypatch):
    """IPC transport: destroy closes the IpcBuffer (its own collective: close, MPI barrier, free) once."""
    from types import SimpleNamespace

    from cupy_ep.cuda.low_latency import LowLatencyState
    closed = []
    state = LowLatencyState.__new__(LowLatencyState)
    state.buf = SimpleNamespace(comm=_FakeComm(0, [None]), rank=0)
    state.transport, state.ipc = "ipc", SimpleNamespace(close=lambda: closed.append(1))
    state.memory = state.nvlink_peers = state.no_peers = state.workspace = object()
    state.destroy()
    state.destroy()                                            # idempotent
    assert closed == [1] and state.ipc is None and state.nv is None and state.memory is None


def test_host_backend_checks_the_low_latency_transport_argument():
    from mpi4py import MPI

    from cupy_ep import Buffer
    for value in (None, "nvshmem", "ipc"):
        Buffer(MPI.COMM_SELF, backend="host", low_latency_transport=value).destroy()
    with pytest.raises(ValueError, match="^low_latency_transport: must be"):
        Buffer(MPI.COMM_SELF, backend="host", low_latency_transport="tcp")


# ---- the dispatch's wire scheme, modelled in numpy on the layout's byte offsets ------------------------------
@pytest.mark.parametrize("ranks,experts", [(2, 4), (2, 256), (4, 16)])
def test_dispatch_index_table_lies_after_the_messages_inside_the_recv_region(ranks, experts):
    M, H = 128, 7168
    lay = config.low_latency_layout(M, H, ranks, experts)
    assert lay["dispatch_index_offset"] == ranks * M * lay["msg_bytes"]  # messages [R][M]
    assert lay["dispatch_index_offset"] % 16 == 0
    # index [L][R][M] int64, then (not overlapping it) the combine's partials [2][R][M] rows (3H bytes), its meta [2][R]
    assert lay["dispatch_index_offset"] + 8 * experts * M <= lay["combine_offset"]
    assert lay["combine_offset"] % 16 == 0
    assert lay["combine_meta_offset"] == lay["combine_offset"] + 2 * ranks * M * lay["part_bytes"]
    assert lay["combine_meta_offset"] + 2 * ranks * lay["meta_bytes"] <= lay["recv_bytes"]


def test_dispatch_recv_region_is_smaller_than_one_message_per_expert_slot():
    lay = config.low_latency_layout(128, 7168, 2, 256)
    # dispatch needs R*M messages + E*M int64 entries (3.9 MB), no longer E*M messages; the combine R*M 24-bit
    # partial rows in and out (11 MB), no longer E*M bf16 rows (470 MB)
    assert lay["dispatch_index_offset"] + 8 * 256 * 128 < 4 << 20
    assert lay["recv_bytes"] == config.align_up(lay["combine_offset"] + 2 * 2 * 128 * 3 * 7168 +
                                                2 * 2 * config.align_up(128 * config.LL_MAX_TOPK * 8, 16))


def _put64(region, at, value):
    region[at:at + 8] = np.array([value], np.int64).view(np.uint8)


def _get64(region, at):
    return int(region[at:at + 8].view(np.int64)[0])


def _send_model(rank, x_cast, scales, topk_idx, M, E, R, recv, signals, lay, log, epoch):
    """One source rank's dispatch send as low_latency.cu does it: first per expert its count (epoch << 32 |
    min(hist_all[e], M)) at the owner's [local expert][source]; then per token the row once per distinct
    destination rank (owners of its valid experts, first k first: known before the slots), then the slots of its
    kept (t, k) (histogram of the rows before it) and their index entries (epoch << 32 | t), written after the row
    (each after a release): the entry is the row's only signal."""
    L, H = E // R, x_cast.shape[1]
    hist_all = np.zeros(E, np.int64)
    for e in topk_idx.ravel():
        if 0 <= e < E:
            hist_all[e] += 1
    for e in range(E):
        _put64(signals[e // L], 8 * ((e % L) * R + rank), (epoch << 32) | int(min(hist_all[e], M)))
    hist = np.zeros(E, np.int64)
    for t, row in enumerate(topk_idx):
        kept = []
        for k, e in enumerate(row):
            if 0 <= e < E:
                slot = hist[e] + sum(1 for j in range(k) if row[j] == e)
                if slot < M:
                    kept.append((int(e), int(slot)))
        # token_targets: distinct owners of the valid experts, in order of first k (__match_any_sync)
        dests = list(dict.fromkeys(int(e) // L for e in row if 0 <= e < E))
        for r in dests:
            at = (rank * M + t) * lay["msg_bytes"]
            recv[r][at + 16:at + 16 + H] = x_cast[t]
            recv[r][at + 16 + H:at + 16 + H + 4 * (H // 128)] = scales[t].astype(np.float32).view(np.uint8)
            log.append((rank, r, t))
        for e, slot in kept:  # after the row: the entry is its signal
            _put64(recv[e // L], lay["dispatch_index_offset"] + ((e % L * R + rank) * M + slot) * 8, (epoch << 32) | t)
        for e in row:
            if 0 <= e < E:
                hist[e] += 1


_LL_THREADS = ids.LL_DISPATCH_THREADS  # kLLThreads


def _scan_counts_model(counts, threads):
    """read_counts + scan_counts as the dispatch's counters (warps 1.. of a `threads`-thread block) split them:
    counter c loads counts c, c + C, ... (C = threads - 32), then scans the contiguous chunk [c * per, c * per + per)
    (per = ceil(n / C)); an inclusive scan over each warp's chunk sums, one warp's exclusive scan over the warp
    totals, then each chunk's running sums; the last counter writes the total at a[n]. Returns a[0..n]."""
    C, n = threads - 32, len(counts)
    a = [None] * (n + 1)
    for c in range(C):                      # the loads: every count by exactly one counter
        for i in range(c, n, C):
            assert a[i] is None
            a[i] = int(counts[i])
    assert all(v is not None for v in a[:n])
    per = -(-n // C)
    chunk = [(min(n, c * per), min(n, min(n, c * per) + per)) for c in range(C)]
    sums = [sum(a[lo:hi]) for lo, hi in chunk]
    inclusive = []                           # within each warp of 32 counters (warp w = counters 32w .. 32w+31)
    for c in range(C):
        w0 = c - c % 32
        inclusive.append(sum(sums[w0:c + 1]))
    warps = C // 32
    totals = [inclusive[32 * w + 31] for w in range(warps)]
    before = [sum(totals[:w]) for w in range(warps)]  # exclusive over the warps
    for c, (lo, hi) in enumerate(chunk):
        run = before[c // 32] + inclusive[c] - sums[c]
        for i in range(lo, hi):
            v = a[i]
            a[i] = run
            run += v
        if c == C - 1:
            a[n] = run
    return a


@pytest.mark.parametrize("threads", [512, 1024])
@pytest.mark.parametrize("n", [1, 2, 31, 256, 991, 992, 993, 1984, 2048, 4097])
def test_scan_counts_model_is_the_prefix(threads, n):
    """The counters' decomposition gives the exclusive prefix and the total for every count size the kernel
    accepts (up to kLLMaxExperts + 1 pairs), including sizes where the last counters' chunks are empty."""
    counts = np.random.default_rng(n).integers(0, 300, size=n)
    got = _scan_counts_model(counts, threads)
    assert got == [0] + np.cumsum(counts).tolist()[:-1] + [int(counts.sum())]


def _recv_model(rank, M, E, R, H, recv, signals, lay, use_ue8m0, epoch, blocks):
    """The dispatch receive of `rank` as dispatch_recv splits it: every block reads all counts (checking their
    epoch) and their prefix over (local expert, source); block b takes global rows [b*N/G, (b+1)*N/G), finds each
    row's pair by binary search (pair_of_row), checks that its index entry carries the epoch, and copies the message
    it names to its expert's position in (row, part) units as copy_rows_as_ready splits them over its 32 warps."""
    import bisect
    L, S = E // R, H // 128
    n = L * R
    words = S // 4 if use_ue8m0 else S
    recv_x = np.zeros((L, R * M, H), np.uint8)
    recv_scales = np.zeros((L, words, R * M), np.int32 if use_ue8m0 else np.float32)
    src_info = np.full((L, R * M), -1, np.int32)
    counts = []
    for i in range(n):
        v = _get64(signals[rank], 8 * i)
        assert v >> 32 == epoch
        counts.append(v & 0xffffffff)
    prefix = _scan_counts_model(counts, _LL_THREADS)
    layout_range = np.array([[((prefix[e * R + s] - prefix[e * R]) << 32) | counts[e * R + s] for s in range(R)]
                             for e in range(L)], np.int64).reshape(L, R)
    count = np.array([prefix[e * R + R] - prefix[e * R] for e in range(L)], np.int32)
    total, copied = prefix[n], []
    data_int4 = H // 16  # FP8 payload of a row in 16-byte units
    for b in range(blocks):
        lo, hi = total * b // blocks, total * (b + 1) // blocks
        rows = hi - lo
        if rows <= 0:
            continue
        # copy_rows_as_ready: units (row, part), a row's payload split over `parts` warps of the block's 32
        parts = max(1, min(8, 32 // rows))
        part_int4 = -(-data_int4 // parts)
        for u in range(rows * parts):
            j, part = divmod(u, parts)
            row = lo + j
            i = bisect.bisect_right(prefix[:n], row) - 1  # pair_of_row: the largest i < n with prefix[i] <= row
            e, s = divmod(i, R)
            entry = _get64(recv[rank], lay["dispatch_index_offset"] + ((e * R + s) * M + row - prefix[i]) * 8)
            assert entry >> 32 == epoch
            t = entry & 0xffffffff
            assert 0 <= t < M
            m = (s * M + t) * lay["msg_bytes"]
            msg = recv[rank][m:m + lay["msg_bytes"]]
            pos = row - prefix[e * R]
            begin, end = part * part_int4, min(data_int4, (part + 1) * part_int4)
            recv_x[e, pos, 16 * begin:16 * end] = msg[16 + 16 * begin:16 + 16 * end]
            copied += [(row, q) for q in range(begin, end)]
            if part == 0:  # the scales and the source index
                sc = msg[16 + H:16 + H + 4 * S].view(np.float32)
                recv_scales[e, :, pos] = reference.pack_ue8m0(sc[None, :])[0] if use_ue8m0 else sc
                src_info[e, pos] = t
    # every 16 bytes of every row once, by exactly one warp of one block
    assert sorted(copied) == [(row, q) for row in range(total) for q in range(data_int4)]
    return recv_x, recv_scales, src_info, layout_range, count


@pytest.mark.parametrize("R,E,K,T,M,mask,dup", [(2, 16, 4, 12, 16, 0.0, False), (2, 8, 8, 16, 16, 0.2, False),
                                                (4, 32, 6, 9, 12, 0.3, False), (3, 6, 5, 7, 36, 0.0, True),
                                                (2, 4, 3, 0, 4, 0.0, False)])
@pytest.mark.parametrize("use_ue8m0", [False, True])
@pytest.mark.parametrize("blocks", [1, 5, 132])
def test_dispatch_scheme_model_matches_the_reference(R, E, K, T, M, mask, dup, use_ue8m0, blocks):
    """The once-per-rank messages + index table + epoch-tagged counts, written over an older dispatch's data on the
    same buffer (epoch 6, other inputs) on stale bytes, give the reference's outputs for the epoch-7 call, every row
    copied by exactly one block; and no message slot [src][token] of a rank is written twice in one call."""
    from tests.helpers import make_inputs
    rng = np.random.default_rng(R * 1000 + E * 10 + K)
    H = 512
    lay = config.low_latency_layout(M, H, R, E)
    recv = [rng.integers(0, 256, lay["recv_bytes"], dtype=np.uint8) for _ in range(R)]  # stale bytes
    signals = [np.zeros(lay["signal_bytes"], np.uint8) for _ in range(R)]
    for epoch in (6, 7):
        ins = [make_inputs(rng, T, H, K, E, R, mask_prob=mask, duplicates=dup) for _ in range(R)]
        xs, idxs = [i.x for i in ins], [i.topk_idx for i in ins]
        log = []
        for s in range(R):
            x_cast, scales = reference.per_token_cast_to_fp8(xs[s], round_scale=use_ue8m0)
            _send_model(s, x_cast, scales, idxs[s], M, E, R, recv, signals, lay, log, epoch)
        assert len(log) == len(set(log))  # each (source, destination, token) message once
    for t_rank in range(R):
        want = reference.low_latency_dispatch(xs, idxs, M, E, t_rank, use_fp8=True, round_scale=use_ue8m0,
                                              use_ue8m0=use_ue8m0)
        recv_x, recv_scales, src_info, layout_range, count = _recv_model(t_rank, M, E, R, H, recv, signals, lay,
                                                                         use_ue8m0, 7, blocks)
        assert np.array_equal(count, want.recv_count)
        assert np.array_equal(layout_range, want.layout_range)
        for e in range(E // R):
            n = count[e]
            assert np.array_equal(recv_x[e, :n], want.recv_x[e, :n])
            assert np.array_equal(src_info[e, :n], want.src_info[e, :n])
            assert np.array_equal(recv_scales[e, :, :n], np.moveaxis(want.recv_x_scales[e, :n], 0, -1))


def test_dispatch_scheme_sends_each_token_once_per_destination_rank():
    """Top-8 of 256 on 2 ranks: the messages that cross are the (token, rank) pairs, not the (token, k) ones."""
    from tests.helpers import make_inputs
    rng = np.random.default_rng(7)
    R, E, K, T, M, H = 2, 256, 8, 128, 128, 512
    ins = [make_inputs(rng, T, H, K, E, R) for _ in range(R)]
    lay = config.low_latency_layout(M, H, R, E)
    recv = [np.zeros(lay["recv_bytes"], np.uint8) for _ in range(R)]
    signals = [np.zeros(lay["signal_bytes"], np.uint8) for _ in range(R)]
    log = []
    for s in range(R):
        x_cast, scales = reference.per_token_cast_to_fp8(ins[s].x)
        _send_model(s, x_cast, scales, ins[s].topk_idx, M, E, R, recv, signals, lay, log, 1)
    pairs = sum(len({int(e) // (E // R) for e in row}) for i in ins for row in i.topk_idx)
    assert len(log) == pairs <= 2 * T * R < T * K * R  # at most R per token instead of K


# ---- the combine's scheme (expert-side fp32 partials), modelled in numpy --------------------------------------
def _wire24(p):
    """low_latency.cu's wire24, bit for bit: each fp32 pattern rounded to nearest even to its top 24 bits (uint32
    arithmetic, wrapping as the kernel's does)."""
    b = np.asarray(p, np.float32).view(np.uint32)
    return ((b + np.uint32(0x7F) + ((b >> np.uint32(8)) & np.uint32(1))) >> np.uint32(8)).astype(np.uint32)


def _store_partial(p):
    """low_latency.cu's store_partial for a whole row: the bytes a partial row takes on the wire (3H): the high
    16 bits of each value in element order (a bf16 plane), then the next 8 bits of each (a byte plane)."""
    r = _wire24(p)
    return np.concatenate([(r >> np.uint32(8)).astype('<u2').view(np.uint8), (r & np.uint32(0xFF)).astype(np.uint8)])


def _load_partial(row_bytes, H):
    """low_latency.cu's load_partial: the fp32 values of a wire row."""
    high = row_bytes[:2 * H].view('<u2').astype(np.uint32)
    low = row_bytes[2 * H:3 * H].astype(np.uint32)
    return ((high << np.uint32(16)) | (low << np.uint32(8))).view(np.float32)


def _combine_model(ys, idxs, ws, M, E, R, layout_ranges, own_in_recv):
    """low_latency.cu's combine as a numpy model: (A) every owner's top-k as meta, each entry with the slot its
    dispatch gave it (the handle's topk_slots: reference.low_latency_slots); (B) each expert rank X, per owner s and
    per token
    one fp32 partial P_X[s][t] = 0 + sum over X's kept entries (k ascending) of fp32(w * row), stored in the wire
    format (_store_partial) into s's partial_in [X][t] with a flag; (C) the owner adds the flagged partials
    (_load_partial) over X ascending, one bf16 rounding. own_in_recv: the owner's own partial is computed in (C)
    from its y instead of through partial_in, rounded as the wire would (same arithmetic)."""
    L = E // R
    H = ys[0].shape[2]
    partial_in = [np.full((R, M, 3 * H), 0xFF, np.uint8) for _ in range(R)]   # stale bytes (NaN) never read
    flags = [np.zeros((R, M), bool) for _ in range(R)]

    slots = [reference.low_latency_slots(idx, M, E) for idx in idxs]

    def entries(X, s, t):
        """X's kept entries of owner s's token t: (row in X's y[local], weight), k ascending."""
        out = []
        for k, e in enumerate(idxs[s][t]):
            slot = int(slots[s][t, k])
            if 0 <= e < E and slot >= 0 and e // L == X:
                begin = int(layout_ranges[X][e % L, s]) >> 32
                out.append((e % L, begin + slot, ws[s][t, k]))
        return out

    def partial(X, items):
        acc = np.zeros(H, np.float32)
        for local, row, w in items:
            acc = acc + (np.float32(w) * ys[X][local, row].astype(np.float32)).astype(np.float32)
        return acc

    for X in range(R):            # (B) on every expert rank
        for s in range(R):
            if own_in_recv and s == X:
                continue
            for t in range(idxs[s].shape[0]):
                items = entries(X, s, t)
                if items:
                    partial_in[s][X, t] = _store_partial(partial(X, items))
                    flags[s][X, t] = True
    outs = []
    for s in range(R):            # (C) on every owner
        T = idxs[s].shape[0]
        acc = np.zeros((T, H), np.float32)
        for t in range(T):
            for X in range(R):
                items = entries(X, s, t)
                if not items:
                    assert not flags[s][X, t]
                    continue
                if own_in_recv and X == s:
                    acc[t] = acc[t] + (_wire24(partial(X, items)) << np.uint32(8)).view(np.float32)
                else:
                    assert flags[s][X, t]
                    acc[t] = acc[t] + _load_partial(partial_in[s][X, t], H)
        outs.append(acc.astype(reference.bfloat16))
    return outs


@pytest.mark.parametrize("own_in_recv", [True, False])
@pytest.mark.parametrize("R,E,K,T,M,mask,dup", [(2, 16, 4, 24, 32, 0.0, False), (2, 8, 6, 20, 32, 0.3, True),
                                                (4, 16, 6, 24, 32, 0.2, False), (3, 6, 3, 9, 16, 0.0, False)])
def test_combine_scheme_model_matches_the_reference(R, E, K, T, M, mask, dup, own_in_recv):
    """The combine's wire scheme gives reference.low_latency_combine bit for bit (its order: partials per expert
    rank rounded to the wire's 24 bits, then ranks ascending), whether the own partial goes through the buffer
    (hook) or not."""
    from tests.helpers import make_inputs
    rng = np.random.default_rng(R * 100 + E + K + int(own_in_recv))
    H = 128
    ins = [make_inputs(rng, T - r, H, K, E, R, mask_prob=mask, duplicates=dup) for r in range(R)]
    idxs, ws = [i.topk_idx for i in ins], [i.topk_weights for i in ins]
    xs = [i.x for i in ins]
    want_dispatch = [reference.low_latency_dispatch(xs, idxs, M, E, r, use_fp8=False) for r in range(R)]
    # no (expert, source) over M rows here: the reference dispatch and the kernels agree on every row
    assert all(int(c) <= M for d in want_dispatch for c in reference.low_latency_unpack_range(d.layout_range)[1].flat)
    # elements +-2^24, +-1, +-3 and weights 0.5 / 1 / 2 (exact products): (2^24 + 3) - 2^24 = 4 but
    # (-2^24 + 3) + 2^24 = 3 in fp32, so a model that adds in another order than the reference fails (random
    # rows and weights would hide the order behind the final bf16 rounding)
    ys = [(rng.choice(np.array([2.0 ** 24, 1.0, 3.0], np.float32), (E // R, R * M, H))
           * rng.choice(np.array([-1.0, 1.0], np.float32), (E // R, R * M, H))).astype(reference.bfloat16)
          for _ in range(R)]
    ws = [rng.choice(np.array([0.5, 1.0, 2.0], np.float32), w.shape) for w in ws]
    got = _combine_model(ys, idxs, ws, M, E, R, [d.layout_range for d in want_dispatch], own_in_recv)
    for s in range(R):
        want = reference.low_latency_combine(ys, idxs, ws, M, E, s)
        assert np.array_equal(got[s].view(np.uint16), want.view(np.uint16)), f"owner {s}"


def test_combine_sends_one_partial_per_token_and_rank():
    """Top-8 of 256 on 2 ranks: the partial rows that cross are the (token, remote rank) pairs, ~1 per token,
    where one bf16 row per (token, k) would be ~4: under 40 % of the bytes at 1.5 times the row width."""
    from tests.helpers import make_inputs
    rng = np.random.default_rng(11)
    R, E, K, T = 2, 256, 8, 128
    idx = make_inputs(rng, T, 16, K, E, R).topk_idx
    remote_entries = sum(int(((row >= 0) & (row // (E // R) == 1)).sum()) for row in idx)   # owner 0 -> rank 1
    remote_partials = sum(int(((row >= 0) & (row // (E // R) == 1)).any()) for row in idx)
    assert remote_partials <= T and remote_entries > 3 * remote_partials
    assert 3 * remote_partials < 0.4 * 2 * remote_entries   # 24-bit partial bytes (3H) vs bf16 rows (2H) per entry
    assert config.low_latency_layout(128, 7168, R, E)["part_bytes"] == 3 * 7168


# ---- the combine's entries: the dispatch's slots (handle.topk_slots) and prepare_batch ----------------------
def _dispatch_slots(topk_idx, M, E):
    """The slots low_latency.cu's dispatch send writes into topk_slots (token_slots: a histogram of the rows before
    the token plus the same expert's earlier entries in its row; -1 past M or without an expert)."""
    hist = np.zeros(E, np.int64)
    out = np.full(topk_idx.shape, -1, np.int32)
    for t, row in enumerate(topk_idx):
        for k, e in enumerate(row):
            if 0 <= e < E:
                slot = hist[e] + sum(1 for j in range(k) if row[j] == e)
                out[t, k] = slot if slot < M else -1
        for e in row:
            if 0 <= e < E:
                hist[e] += 1
    return out


def _entry_code(e, slot, E):
    """low_latency.cu's entry_code: slot << 12 | expert, -1 without an expert or a slot."""
    return (int(slot) << 12) | int(e) if 0 <= e < E and slot >= 0 else -1


def _prepare_batch_model(codes, t0, stride, n, rank, M, E, R, begin):
    """low_latency.cu's prepare_batch: warp j takes token t_j = t0 + j * stride (j < n), lane k its entry code; per
    j ``(has: the ranks of its kept entries, [(row, k)] of those on `rank`, k ascending)``, the row being
    begin[local] + slot inside the local expert's R*M rows."""
    L = E // R
    out = []
    for j in range(n):
        has, rows = set(), []
        for k, code in enumerate(codes[t0 + j * stride]):
            if code < 0:
                continue
            e, slot = code & 0xFFF, code >> 12
            has.add(e // L)
            if e // L == rank:
                rows.append(((e - rank * L) * R * M + begin[e - rank * L] + slot, k))
        out.append((has, rows))
    return out


def test_low_latency_slots_are_the_dispatch_slots():
    """reference.low_latency_slots (what the host backend's handle carries) equals the slots the dispatch kernel
    writes (token_slots' histogram) and each entry's place in reference.low_latency_rows, -1 past M, with masked
    entries, ids out of range and duplicates within a token."""
    rng = np.random.default_rng(5)
    for case in range(40):
        E, K, T = int(rng.integers(1, 20)), int(rng.integers(1, 12)), int(rng.integers(0, 40))
        M = int(rng.integers(1, T + 3))
        topk = rng.integers(-1, E + 1, size=(T, K))
        got = reference.low_latency_slots(topk, M, E)
        assert got.dtype == np.int32 and got.shape == (T, K)
        assert np.array_equal(got, _dispatch_slots(topk, M, E)), case
        for t, k in zip(*np.nonzero(got >= 0)):
            assert reference.low_latency_rows([topk], int(topk[t, k])).index((0, t, k)) == got[t, k]


def test_entry_codes_hold_the_largest_expert_and_slot():
    """The meta's int32 entry code keeps the expert below kLLMaxExperts and the slot below LL_MAX_TOKENS, and a
    kept entry's code is never negative (-1 means none)."""
    code = _entry_code(config.LL_MAX_EXPERTS - 1, config.LL_MAX_TOKENS - 1, config.LL_MAX_EXPERTS)
    assert 0 < code <= np.iinfo(np.int32).max
    assert (code & 0xFFF, code >> 12) == (config.LL_MAX_EXPERTS - 1, config.LL_MAX_TOKENS - 1)
    assert _entry_code(-1, 3, 8) == _entry_code(8, 3, 8) == _entry_code(2, -1, 8) == -1


@pytest.mark.parametrize("batch", [1, 3, 15])
def test_prepare_batch_gives_every_token_the_dispatch_rows(batch):
    """Over all blocks and batches of a split (blocks stride over the tokens, kCombineBatch at a time), every
    token's kept entries and the ranks holding them, found from the entry codes (expert and dispatch slot), are
    those of reference.low_latency_rows (its slot: its place among the expert's rows from this source; kept below
    M), with masked entries, duplicates within a token and slots past M."""
    rng = np.random.default_rng(100 + batch)
    for case in range(12):
        R = int(rng.integers(1, 4))
        E = R * int(rng.integers(1, 6))
        K = int(rng.integers(1, 12))
        T = int(rng.integers(1, 40))
        M = int(rng.integers(1, T + 3))
        topk = rng.integers(-1, E + 1, size=(T, K))   # -1 and E: no expert
        slots = reference.low_latency_slots(topk, M, E)
        codes = [[_entry_code(topk[t, k], slots[t, k], E) for k in range(K)] for t in range(T)]
        rank = int(rng.integers(0, R))
        begin = rng.integers(0, 1000, size=E // R)
        count = int(rng.integers(1, 8))
        seen = []
        for index in range(count):
            mine = len(range(index, T, count))
            for j0 in range(0, mine, batch):
                n = min(batch, mine - j0)
                t0 = index + j0 * count
                got = _prepare_batch_model(codes, t0, count, n, rank, M, E, R, begin)
                for j, (has, rows) in enumerate(got):
                    t = t0 + j * count
                    seen.append(t)
                    want_has, want_rows = set(), []
                    for k in range(K):
                        e = int(topk[t, k])
                        if not 0 <= e < E:
                            continue
                        slot = reference.low_latency_rows([topk], e).index((0, t, k))
                        if slot >= M:
                            continue
                        want_has.add(e // (E // R))
                        if e // (E // R) == rank:
                            want_rows.append(((e - rank * (E // R)) * R * M + begin[e - rank * (E // R)] + slot, k))
                    assert has == want_has and rows == want_rows, (case, t)
        assert sorted(seen) == list(range(T))


def test_low_latency_handle_unpacks_as_deepeps_5_tuple_and_carries_the_slots():
    """LowLatencyHandle: indexing, len and unpacking as DeepEP's (src_info, layout_range, M, H, E); the slots ride
    along as an attribute. A plain tuple of its items has none: the combine computes them again from topk_idx
    (refused in shrink mode, where they depend on the dispatch's mask)."""
    from cupy_ep import validate
    from cupy_ep.ll_handle import LowLatencyHandle
    src_info, layout_range = np.zeros((2, 8), np.int32), np.zeros((2, 2), np.int64)
    slots = np.array([[0, -1], [1, 0]], np.int32)
    h = LowLatencyHandle((src_info, layout_range, 4, 128, 4), slots)
    a, b, m, hidden, e = h
    assert len(h) == 5 and a is src_info and b is layout_range and (m, hidden, e) == (4, 128, 4)
    assert h[1] is layout_range and h.topk_slots is slots and "topk_slots" in repr(h)
    assert validate.check_low_latency_slots(h, np.zeros((2, 2), np.int64), 4, 4, True) is slots
    idx = np.array([[2, -1], [2, 0]], np.int64)
    for plain in (tuple(h), list(h)):
        got = validate.check_low_latency_slots(plain, idx, 4, 4, True)
        assert got.dtype == np.int32 and np.array_equal(got, reference.low_latency_slots(idx, 4, 4))
    with pytest.raises(ValueError, match="^handle: a plain tuple .*enable_shrink"):
        validate.check_low_latency_slots(tuple(h), idx, 4, 4, True, shrink=True)
    with pytest.raises(ValueError, match="^topk_idx:"):
        validate.check_low_latency_slots(h, np.zeros((3, 2), np.int64), 4, 4, True)
    with pytest.raises(ValueError, match="^handle.topk_slots:"):
        validate.check_low_latency_slots(LowLatencyHandle(tuple(h), slots + 4), np.zeros((2, 2), np.int64), 4, 4,
                                         True)


@pytest.mark.parametrize("seed", range(6))
def test_slots_computed_again_from_the_routing_are_the_dispatchs(seed):
    """validate.low_latency_slots_of (the slots of a plain-tuple handle, in array operations on the routing's
    device) against reference.low_latency_slots: -1 entries, experts out of range, duplicates and more entries per
    expert than M slots, int32 and int64 routing."""
    from cupy_ep import validate
    rng = np.random.default_rng(seed)
    T, K, E, M = int(rng.integers(1, 40)), int(rng.integers(1, 9)), int(rng.integers(1, 12)), int(rng.integers(1, 6))
    idx = rng.integers(-2, E + 2, size=(T, K)).astype(np.int32 if seed % 2 else np.int64)
    got = validate.low_latency_slots_of(idx, M, E)
    assert got.shape == (T, K) and got.dtype == np.int32
    assert np.array_equal(got, reference.low_latency_slots(idx, M, E))
    empty = validate.low_latency_slots_of(np.zeros((0, K), np.int64), M, E)
    assert empty.shape == (0, K)
