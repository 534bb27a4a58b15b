"""GPU-less checks of the zero-copy dispatch (intranode.cu dispatch_direct): a numpy model of where each block
puts each token's row (block shares of whole windows of 32 tokens, the count before a share from
channel_prefix_matrix plus a scan of the share's first channel, warps taking tokens j % warps), checked against
the reference's send_head and rank_prefix_matrix: every row of every receiver written exactly once, at the
reference's position; the completion count the receivers wait for; the carve's Python mirror; combine_direct's
chunk dealing; and a step model of the zero-copy kernels' entry handshake.
The model is written from the kernel's description, not run from it: it checks the scheme, not the CUDA code."""
import numpy as np
import pytest

from cupy_ep import config, reference

WARPS = 24  # Groups<R>::kWarps at R = 2, 3, 4, 6, 8


def model_rows(in_rank: np.ndarray, num_channels: int, num_blocks: int, rank_offsets: np.ndarray):
    """``(rows [T, R] (-1: not sent), send_head [T, R], releases [R])`` as dispatch_direct computes them on one
    source rank; ``rank_offsets[d]``: the first row of this source's block in rank d's output."""
    T, R = in_rank.shape
    cpm = np.cumsum(reference.local_channel_counts(in_rank, num_channels), axis=1)  # inclusive, [R, C]
    rows = np.full((T, R), -1, dtype=np.int64)
    send_head = np.full((T, R), -1, dtype=np.int64)
    releases = np.zeros(R, dtype=np.int64)
    num_windows = -(-T // 32)
    per_block = -(-num_windows // num_blocks) * 32
    for b in range(num_blocks):
        begin, end = min(b * per_block, T), min(b * per_block + per_block, T)
        base = np.zeros(R, dtype=np.int64)
        if begin < end:
            per_channel = -(-T // num_channels)
            first = begin // per_channel
            for d in range(R):
                base[d] = (cpm[d, first - 1] if first > 0 else 0) + in_rank[first * per_channel:begin, d].sum()
        counts = np.zeros(R, dtype=np.int64)
        for w0 in range(begin, end, 32):
            masks = in_rank[w0:min(w0 + 32, end)]
            j0 = w0 - begin
            for warp in range(WARPS):
                for lane in range((warp - j0 % WARPS) % WARPS, min(32, end - w0), WARPS):
                    t = w0 + lane
                    for d in range(R):
                        pos = counts[d] + masks[:lane, d].sum()
                        if masks[lane, d]:
                            assert send_head[t, d] == -1, "a token handled twice"
                            send_head[t, d] = base[d] + pos
                            rows[t, d] = rank_offsets[d] + base[d] + pos
            counts += masks.sum(axis=0)
        releases += counts + (b == 0)
    return rows, send_head, releases


@pytest.mark.parametrize("num_ranks", [2, 3, 8])
@pytest.mark.parametrize("tokens,channels,blocks", [(4096, 9, 24), (4096, 9, 8), (777, 4, 32), (5, 9, 24),
                                                    (0, 9, 24), (300, 1, 1), (1000, 12, 7)])
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_every_row_written_once_at_the_reference_position(num_ranks, tokens, channels, blocks, density):
    rng = np.random.default_rng(tokens * 31 + num_ranks * 7 + blocks)
    in_rank = [rng.random((0 if (s == 1 and tokens == 777) else tokens, num_ranks)) < density
               for s in range(num_ranks)]
    sent = [m.sum(axis=0) for m in in_rank]
    rpm = reference.rank_prefix_matrix(sent)
    written = [np.zeros(int(rpm[-1, d]), dtype=np.int64) for d in range(num_ranks)]
    waited = np.zeros(num_ranks, dtype=np.int64)
    for s in range(num_ranks):
        offsets = rpm[s - 1] if s > 0 else np.zeros(num_ranks, dtype=np.int64)
        rows, send_head, releases = model_rows(in_rank[s], channels, blocks, offsets)
        # send_head: the row inside d's block of rows from s = the count of s's earlier tokens sent to d
        want = np.where(in_rank[s], np.cumsum(in_rank[s], axis=0) - 1, -1)
        np.testing.assert_array_equal(send_head, want)
        for d in range(num_ranks):
            got = rows[:, d][rows[:, d] >= 0]
            np.add.at(written[d], got, 1)
        waited += releases
    for d in range(num_ranks):
        assert (written[d] == 1).all(), f"rank {d}: rows written {np.unique(written[d])} times"
        # what rank d's blocks wait for: every row, plus one per source (its block 0's channel starts)
        assert waited[d] == rpm[-1, d] + num_ranks


@pytest.mark.parametrize("channels,capacity,hidden_bytes,topk,scales", [(9, 8192, 14336, 8, 0), (1, 1, 16, 1, 0),
                                                                        (33, 1000, 7168, 32, 56)])
def test_direct_carve_and_capacity(channels, capacity, hidden_bytes, topk, scales):
    got = config.direct_dispatch_bytes(channels, capacity, hidden_bytes, topk, scales)
    a = config.align_up
    assert got == (a(4) + a(4 * config.MAX_NVL_RANKS * channels) + a(capacity * hidden_bytes) + a(4 * capacity)
                   + 2 * a(4 * capacity * topk) + a(4 * capacity * scales))
    assert config.direct_dispatch_x_offset(channels) == config.NOTIFY_BYTES + a(4) + a(32 * channels)
    nvl = config.NOTIFY_BYTES + got
    cap = config.direct_dispatch_capacity(nvl, channels, hidden_bytes, topk, scales)
    assert cap >= capacity  # exactly the largest that fits
    assert config.NOTIFY_BYTES + config.direct_dispatch_bytes(channels, cap, hidden_bytes, topk, scales) <= nvl
    assert config.NOTIFY_BYTES + config.direct_dispatch_bytes(channels, cap + 1, hidden_bytes, topk, scales) > nvl
    assert config.direct_dispatch_capacity(config.NOTIFY_BYTES + 100, channels, hidden_bytes, topk, scales) == 0


@pytest.mark.parametrize("ranks,capacity,hidden_bytes,topk", [(2, 4096, 14336, 8), (8, 1, 16, 1), (3, 1000, 7168, 32)])
def test_direct_combine_carve_and_capacity(ranks, capacity, hidden_bytes, topk):
    got = config.direct_combine_bytes(ranks, capacity, hidden_bytes, topk)
    a = config.align_up
    assert got == a(4 * ranks * capacity) + a(ranks * capacity * hidden_bytes) + a(4 * ranks * capacity * topk)
    nvl = config.NOTIFY_BYTES + got
    cap = config.direct_combine_capacity(nvl, ranks, hidden_bytes, topk)
    assert (cap >= capacity
            and config.NOTIFY_BYTES + config.direct_combine_bytes(ranks, cap + 1, hidden_bytes, topk) > nvl)
    assert config.direct_combine_capacity(config.NOTIFY_BYTES, ranks, hidden_bytes, topk) == 0


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_zero_copy_size_hint_fits_the_largest_calls(ranks):
    from cupy_ep import Buffer, Config
    T, hb, K = 4096, 14336, 8
    nvl = Buffer.get_zero_copy_nvl_size_hint(T, hb, ranks, K)
    for sms in (8, 24, 64, 132):
        C = Config(num_sms=sms).intranode_dispatch_channels(ranks)
        assert config.direct_dispatch_capacity(nvl, C, hb, K, 0) >= ranks * T
        assert config.direct_dispatch_capacity(nvl, C, hb // 2, K, hb // 2 // 128) >= ranks * T
    assert config.direct_combine_capacity(nvl, ranks, hb, K) >= T


@pytest.mark.parametrize("num_ranks", [2, 3, 8])
@pytest.mark.parametrize("tokens,senders,rows_per_flag", [(4096, 9, 2), (777, 3, 8), (5, 1, 2), (0, 2, 1),
                                                          (300, 8, 3)])
def test_combine_direct_flags_cover_every_row_once(num_ranks, tokens, senders, rows_per_flag):
    """combine_direct's scheme: the sender warps deal every owner's chunks of rows_per_flag rows exactly once; the
    flag a reducer waits for (row // rows_per_flag at [chunk][rank]) is the one the chunk holding that row
    released, and lies in the prefix combine_direct's block 0 zeroed (the owner's token count x R flags)."""
    rng = np.random.default_rng(tokens + 13 * num_ranks + senders)
    in_rank = [rng.random((tokens, num_ranks)) < 0.7 for _ in range(num_ranks)]  # owner s's routing
    rpm = reference.rank_prefix_matrix([m.sum(axis=0) for m in in_rank])
    num_warps = senders * WARPS
    for expert_rank in range(num_ranks):
        released = {}  # (owner, flag index) -> rows it covers
        chunk_base = 0
        for step in range(1, num_ranks):
            owner = (expert_rank + step) % num_ranks
            first = rpm[owner - 1, expert_rank] if owner > 0 else 0
            num_rows = int(rpm[owner, expert_rank] - first)
            num_chunks = -(-num_rows // rows_per_flag)
            taken = []
            for warp in range(num_warps):
                taken += range((warp - chunk_base) % num_warps, num_chunks, num_warps)
            assert sorted(taken) == list(range(num_chunks)), "every chunk dealt exactly once"
            for k in taken:
                flag = k * num_ranks + expert_rank
                assert flag < tokens * num_ranks, "a flag outside the zeroed prefix"
                released[(owner, flag)] = set(range(k * rows_per_flag, min((k + 1) * rows_per_flag, num_rows)))
            chunk_base += num_chunks
        for owner in range(num_ranks):
            if owner == expert_rank:
                continue
            send_head = np.where(in_rank[owner], np.cumsum(in_rank[owner], axis=0) - 1, -1)[:, expert_rank]
            for j in send_head[send_head >= 0]:
                assert j in released[(owner, (j // rows_per_flag) * num_ranks + expert_rank)]


# ---- the zero-copy kernels' entry handshake (intranode.cu open_direct_call / wait_direct_call) -----------------
def simulate_entry_handshake(num_ranks: int, num_calls: int, seed: int, words_by_parity: bool = True):
    """A random interleaving of num_ranks ranks making the same num_calls zero-copy calls (each call its own op
    word), modelled step by step: a rank opens call c (its words into every rank's entry_words[c & 1][me], then
    entry[me] = c everywhere); each of its blocks passes its wait once every rank's entry has reached c, and then
    compares every rank's words with its own; the rank finishes the call when all its blocks passed and, for every
    peer, the peer's *needed* blocks passed (a dispatch's blocks all store rows its peers wait for; a combine's
    reducers store nothing a peer waits for: those are the *free* blocks, which may lag). Returns the comparisons
    that saw another call's words (none means the handshake never reports a false mismatch)."""
    rng = np.random.default_rng(seed)
    ops = rng.integers(1, 7, size=num_calls + 1)  # the collective sequence: every rank makes the same calls
    R, blocks = num_ranks, 4
    needed = [True, True, False, False]  # blocks 0, 1 store what peers wait for; 2, 3 may lag behind
    entry = np.zeros((R, R), dtype=np.int64)            # entry[on rank][from rank]
    words = np.zeros((R, 2 if words_by_parity else 1, R), dtype=np.int64)
    call = np.zeros(R, dtype=np.int64)                  # the call each rank is in (0: none yet)
    opened = np.zeros(R, dtype=bool)
    passed = np.zeros((R, blocks), dtype=bool)
    passed_call = np.zeros((R, num_calls + 2, blocks), dtype=bool)  # [rank][call][block] passed its wait
    wrong = []
    while True:
        moves = []
        for r in range(R):
            if not opened[r] and call[r] < num_calls:
                moves.append(("open", r, -1))
            elif opened[r]:
                c = call[r]
                for b in range(blocks):
                    if not passed[r, b] and all(entry[r, s] >= c for s in range(R)):
                        moves.append(("pass", r, b))
                if passed[r].all() and all(passed_call[s, c, b] for s in range(R) for b in range(blocks) if needed[b]):
                    moves.append(("finish", r, -1))
        if not moves:
            break
        kind, r, b = moves[rng.integers(len(moves))]
        if kind == "open":
            call[r] += 1
            c = call[r]
            slot = c & 1 if words_by_parity else 0
            words[:, slot, r] = ops[c]   # the words land before the entry (block 0 fences in between)
            entry[:, r] = c
            opened[r], passed[r] = True, False
        elif kind == "pass":
            c = call[r]
            slot = c & 1 if words_by_parity else 0
            wrong += [(r, b, s, int(c)) for s in range(R) if words[r, slot, s] != ops[c]]
            passed[r, b] = passed_call[r, c, b] = True
        else:
            opened[r] = False
    assert (call == num_calls).all() and not opened.any(), "the model deadlocked"
    return wrong


@pytest.mark.parametrize("num_ranks", [2, 3, 8])
def test_entry_handshake_compares_the_same_calls_words(num_ranks):
    """A peer can be one call ahead (its next call opens while a lagging block here still checks this one), never
    two; with the words kept by the epoch's parity no comparison ever sees another call's words."""
    for seed in range(200):
        assert simulate_entry_handshake(num_ranks, 12, seed) == [], f"seed {seed}"


def test_entry_handshake_needs_the_parity():
    """The same model with one set of words per rank: some interleaving makes a lagging block read the next
    call's words, which would stop the buffer with a false CallMismatchError (why entry_words has two rows)."""
    assert any(simulate_entry_handshake(2, 12, seed, words_by_parity=False) for seed in range(200))
