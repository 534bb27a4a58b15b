"""CPU tests of the internode path's Python logic: the size model, argument / handle / topology checks, and the
internode handle and combine oracles (cupy_ep/internode_reference.py), including a model of the kernels' index
arithmetic built only from handle fields (what internode.cu reads), compared with the oracles."""
from __future__ import annotations

import numpy as np
import pytest

from cupy_ep import config as cfg
from cupy_ep.cuda import internode as ci
from cupy_ep import internode_reference as iref
from cupy_ep import jit, reference
from cupy_ep.config import Config


# ---- size model --------------------------------------------------------------------------------------
def test_token_bytes_by_hand():
    # dispatch bf16 H=7168, 56 scales, top-8: 14336 + 224 + 8 + 32 + 32 = 14632 -> 14640
    assert cfg.internode_token_bytes(14336, 56, 8, True) == 14640
    assert cfg.internode_token_bytes(14336, 0, 8, False) == 14336 + 32
    assert cfg.internode_token_bytes(32, 0, 0, False) == 32
    assert cfg.internode_token_bytes(32, 1, 1, True) == 64   # 32 + 4 + pad 4 + 8 + 4 + 4 = 56 -> 64
    assert cfg.internode_token_bytes(32, 1, 0, True) == 48   # 32 + 8 + 8 = 48


def test_layout_by_hand_two_nodes_one_gpu():
    # N=2, G=1, C=1, Qr=4, Qn=4, hidden 32 B, no scales, K=1
    lay = cfg.internode_layout(2, 1, 1, 4, 4, 32, 0, 1)
    d_tok, c_tok = 48, 48          # 32 + 0 + 8 + 4 + 4 = 48; 32 + 4 = 36 -> 48
    assert (lay["dispatch_token_bytes"], lay["combine_token_bytes"]) == (d_tok, c_tok)
    notify_ints = cfg.align_up(8 + 1 + 1 + 1024, 4)                # 1036
    rdma_begin = 256 + cfg.align_up(2 * 2 * notify_ints * 4)
    assert lay["rdma_channel_begin"] == rdma_begin
    meta = cfg.align_up(2 * 1 * 2 * 4 * 4)                          # meta ints align4(2G+2) = 4
    assert lay["rdma_dispatch_end"] == rdma_begin + meta + 2 * 128 + cfg.align_up(2 * 2 * 4 * d_tok)
    assert lay["rdma_combine_end"] == rdma_begin + 2 * 128 + cfg.align_up(2 * 2 * 4 * c_tok)
    nvl_begin = 128 + cfg.align_up(1 * (8 + 32 + 1024) * 4)
    assert lay["nvl_channel_begin"] == nvl_begin
    assert lay["nvl_dispatch_end"] == nvl_begin + 4 * 128 + cfg.align_up(4 * d_tok)
    assert lay["nvl_combine_end"] == nvl_begin + 2 * 128 + cfg.align_up(4 * c_tok)


def test_buffer_bytes_grow_with_nodes_and_hidden():
    c = Config(24, 8, 512, 16, 128)
    rdma = [cfg.internode_buffer_bytes(n, 8, 14336, c)[1] for n in (2, 4, 8, 16, 32)]
    assert all(a < b for a, b in zip(rdma, rdma[1:]))
    assert cfg.internode_buffer_bytes(2, 8, 8192, c)[0] < cfg.internode_buffer_bytes(2, 8, 14336, c)[0]
    nvl, rdma2 = cfg.internode_buffer_bytes(2, 8, 14336, c)
    assert nvl % 128 == 0 and rdma2 % 128 == 0
    lay = cfg.internode_layout(2, 8, 12, 128, 512, 14336, 56, 32)
    assert rdma2 == max(lay["rdma_dispatch_end"], lay["rdma_combine_end"])
    assert nvl == max(lay["nvl_dispatch_end"], lay["nvl_combine_end"]) - 128


@pytest.mark.parametrize("bad", [dict(num_nodes=1), dict(num_nodes=33), dict(gpus_per_node=9), dict(hidden_bytes=0),
                                 dict(num_nodes=2.0)])
def test_buffer_bytes_rejects(bad):
    args = dict(num_nodes=2, gpus_per_node=8, hidden_bytes=14336)
    args.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        cfg.internode_buffer_bytes(**args)


def test_internode_table_rows():
    table = cfg.internode_table(nodes=(2, 4, 32))
    lines = table.splitlines()
    assert len(lines) == 5 and lines[2].startswith("| 2 x 8 | 16 |") and lines[4].startswith("| 32 x 8 | 256 |")
    assert cfg.main(["--internode-table"]) == 0


# ---- argument checks ----------------------------------------------------------------------------------
def test_resolve_transport(monkeypatch):
    monkeypatch.delenv("CUPY_EP_INTERNODE_TRANSPORT", raising=False)
    assert ci.resolve_transport(None) == "nvshmem"
    assert ci.resolve_transport("ipc") == "ipc"
    monkeypatch.setenv("CUPY_EP_INTERNODE_TRANSPORT", "ipc")
    assert ci.resolve_transport(None) == "ipc"
    assert ci.resolve_transport("nvshmem") == "nvshmem"   # the argument wins
    with pytest.raises(ValueError, match="internode_transport"):
        ci.resolve_transport("rdma")
    monkeypatch.setenv("CUPY_EP_INTERNODE_TRANSPORT", "bogus")
    with pytest.raises(ValueError, match="internode_transport"):
        ci.resolve_transport(None)


def test_resolve_force_put(monkeypatch):
    monkeypatch.delenv("CUPY_EP_INTERNODE_FORCE_PUT", raising=False)
    assert ci.resolve_force_put() is False
    for value, expected in (("0", False), ("", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("CUPY_EP_INTERNODE_FORCE_PUT", value)
        assert ci.resolve_force_put() is expected


def test_rdma_peer_table_mirrors_the_transport():
    # RdmaArgs::peer_bases: [2][kMaxRdmaRanks]; row 0 puts/adds (IpcRdma::remote), row 1 loads/stores (rdma_direct)
    src = (jit.source_dir() / "transport" / "rdma.cuh").read_text()
    assert "a.peer_bases + kMaxRdmaRanks + pe" in src and "a.peer_bases[pe]" in src
    M = cfg.MAX_RDMA_RANKS
    table = ci.rdma_peer_table([10, 20], [30, 0])
    assert table.dtype == np.uint64 and table.shape == (2 * M,)
    assert list(table[:2]) == [10, 20] and not table[2:M].any()
    assert list(table[M:M + 2]) == [30, 0] and not table[M + 2:].any()
    puts_only = ci.rdma_peer_table([10, 20], None)            # force_put: no load/store address at all
    assert list(puts_only[:2]) == [10, 20] and not puts_only[M:].any()
    nvshmem = ci.rdma_peer_table(None, [0, 40])               # NVSHMEM puts by PE index: row 0 unused
    assert not nvshmem[:M].any() and list(nvshmem[M:M + 2]) == [0, 40]
    with pytest.raises(ValueError, match="rdma_peer_table"):
        ci.rdma_peer_table(np.ones(M + 1), None)


def test_check_topology():
    assert ci.check_topology(2, 1) == (2, 1)
    assert ci.check_topology(4, 2) == (2, 2)
    assert ci.check_topology(256, 8) == (32, 8)
    with pytest.raises(ValueError, match="comm"):
        ci.check_topology(2, 2)          # one node: not internode
    with pytest.raises(ValueError, match="comm"):
        ci.check_topology(33, 1)
    with pytest.raises(ValueError, match="num_ranks_per_node"):
        ci.check_topology(32, 16)
    with pytest.raises(ValueError, match="num_ranks_per_node"):
        ci.check_topology(6, 4)


def test_check_config_combine_sub_rings():
    ci.check_config(Config(20, 8, 256, 6, 128), 32, "dispatch")
    ci.check_config(Config(20, 8, 256, 6, 128), 32, "combine")     # 256 // 32 = 8 >= 8
    with pytest.raises(ValueError, match="sub-rings"):
        ci.check_config(Config(20, 9, 256, 6, 128), 32, "combine")


def test_threads_mirror_the_kernel_shapes():
    assert ci.threads("dispatch", 2, 1) == (6 + 1 + 1) * 32
    assert ci.threads("dispatch", 4, 8) == 15 * 32
    assert ci.threads("combine", 2, 8) == (8 + 6 + 1) * 32
    assert ci.threads("combine", 32, 1) == 16 * 32
    assert max(ci.threads(k, n, g) for k in ("dispatch", "combine") for n in range(2, 33) for g in range(1, 9)) <= 512


def test_kernel_names():
    assert (ci.kernel_name("dispatch", 2, 1, "ipc", "long long")
            == "ep::internode_dispatch<2, 1, ep::IpcRdma, long long>")
    assert ci.kernel_name("combine", 4, 8, "nvshmem") == "ep::internode_combine<4, 8, ep::NvshmemRdma>"


def test_check_buffer_sizes_names_the_buffer():
    lay = cfg.internode_layout(2, 2, 4, 16, 32, 256, 0, 2)
    nvl, rdma = lay["nvl_dispatch_end"] - 128, lay["rdma_dispatch_end"]
    ci.check_buffer_sizes(lay, "dispatch", nvl, rdma)
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        ci.check_buffer_sizes(lay, "dispatch", nvl - 1, rdma)
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        ci.check_buffer_sizes(lay, "dispatch", nvl, rdma - 1)


# ---- oracles ------------------------------------------------------------------------------------------
def _routing(seed, num_ranks, num_tokens, num_experts, num_topk, masks=True):
    rng = np.random.default_rng(seed)
    topk = [np.stack([rng.choice(num_experts, num_topk, replace=False) for _ in range(t)]).astype(np.int64)
            if t else np.zeros((0, num_topk), np.int64) for t in num_tokens]
    if masks:
        for t in topk:
            if t.size:
                t[rng.random(t.shape) < 0.2] = -1
    return topk, [reference.token_rank_matrix(t, num_experts, num_ranks) for t in topk]


def _handle_for_test(itr, rank, G, C):
    h = iref.handle(itr, rank, G, C)
    return (h.is_token_in_rank, h.rdma_channel_prefix_matrix, h.gbl_channel_prefix_matrix,
            h.recv_rdma_channel_prefix_matrix, h.recv_rdma_rank_prefix_sum, h.recv_gbl_channel_prefix_matrix,
            h.recv_gbl_rank_prefix_sum, iref.src_meta_bytes(h.recv_src_meta), h.send_rdma_head, h.send_nvl_head)


def test_check_handle_accepts_and_names_fields():
    _, itr = _routing(0, 4, [10, 0, 7, 12], 8, 2)
    handle = _handle_for_test(itr, 1, 2, 3)
    fields = ci.check_handle(handle, 4, 2, 2, 3)
    assert set(fields) == set(ci.HANDLE_FIELDS)
    ci.check_handle(handle, 4, 2, 2, None)
    with pytest.raises(ValueError, match="rdma_channel_prefix_matrix"):
        ci.check_handle(handle, 4, 2, 2, 4)             # another num_sms
    with pytest.raises(ValueError, match="10-tuple"):
        ci.check_handle(handle[:6], 4, 2, 2, 3)
    bad = list(handle)
    bad[8] = bad[8].astype(np.int64)
    with pytest.raises(TypeError, match="send_rdma_head"):
        ci.check_handle(tuple(bad), 4, 2, 2, 3)
    bad = list(handle)
    bad[9] = np.zeros((3, 3), np.int32)
    with pytest.raises(ValueError, match="send_nvl_head"):
        ci.check_handle(tuple(bad), 4, 2, 2, 3)


@pytest.mark.parametrize("seed, N, G, C, tokens", [(1, 2, 1, 2, [9, 5]), (2, 2, 2, 3, [10, 0, 7, 12]),
                                                   (3, 3, 2, 2, [4, 8, 1, 6, 9, 3]), (4, 2, 2, 5, [1, 2, 3, 0])])
def test_handle_is_consistent_with_the_reference(seed, N, G, C, tokens):
    R, E = N * G, 4 * N * G
    topk, itr = _routing(seed, R, tokens, E, 3)
    for rank in range(R):
        h = iref.handle(itr, rank, G, C)
        res = reference.dispatch([np.zeros((t, 1)) for t in tokens], topk, None, E, rank, num_channels=C)
        assert np.array_equal(h.recv_gbl_rank_prefix_sum, res.rank_prefix_matrix[:, rank])
        assert h.recv_src_meta.shape[0] == res.recv_src_idx.shape[0]
        assert h.send_nvl_head.shape[0] == h.recv_rdma_rank_prefix_sum[-1]
        assert np.array_equal(h.gbl_channel_prefix_matrix, res.channel_prefix_matrix)
        per_rdma = reference.get_dispatch_layout(topk[rank], E, R, G)[1]
        assert np.array_equal(h.rdma_channel_prefix_matrix[:, -1], per_rdma)
        # the node bits of every received row include my GPU
        assert np.all((h.recv_src_meta[:, 1] >> (rank % G)) & 1)
        # what the dispatch kernel derives from the *sender's* matrices (RDMA meta) equals the receiver's fields
        node, g = divmod(rank, G)
        for src in range(R):
            hs = iref.handle(itr, src, G, C)
            start = np.concatenate([[0], hs.gbl_channel_prefix_matrix[rank, :-1]])
            block = h.recv_gbl_rank_prefix_sum[src - 1] if src else 0
            assert np.array_equal(h.recv_gbl_channel_prefix_matrix[src], block + start)   # kNVLReceivers
            if src % G == g:
                assert np.array_equal(h.recv_rdma_channel_prefix_matrix[src // G],
                                      hs.rdma_channel_prefix_matrix[node])                 # kRDMAAndNVLForwarder


def test_handle_by_hand():
    # 2 nodes x 1 GPU, 1 channel: rank 0 tokens -> ranks {0}, {1}, {0,1}; rank 1 tokens -> {1}, {0}
    itr = [np.array([[1, 0], [0, 1], [1, 1]], bool), np.array([[0, 1], [1, 0]], bool)]
    h = iref.handle(itr, 0, 1, 1)
    assert h.send_rdma_head.tolist() == [[0, -1], [-1, 0], [1, 1]]
    assert h.recv_rdma_rank_prefix_sum.tolist() == [2, 3]
    assert h.recv_gbl_rank_prefix_sum.tolist() == [2, 3]
    assert h.recv_gbl_channel_prefix_matrix.tolist() == [[0], [2]]
    assert h.send_nvl_head.tolist() == [[0], [1], [0]]   # counters restart per source node
    assert h.recv_src_meta.tolist() == [[0, 1], [0, 1], [1, 1]]
    assert iref.src_meta_bytes(h.recv_src_meta).shape == (3, 8)


def _recv_rows(x_list, itr, rank):
    return np.concatenate([np.asarray(x)[np.nonzero(a[:, rank])[0]] for x, a in zip(x_list, itr)])


@pytest.mark.parametrize("N, G", [(2, 1), (2, 2), (3, 2)])
def test_two_level_combine_is_exact_on_small_integers(N, G):
    R, H = N * G, 16
    tokens = [7, 0, 5, 9, 3, 6][:R]
    _, itr = _routing(5, R, tokens, 4 * R, 3)
    rng = np.random.default_rng(9)
    y = [rng.integers(-8, 8, size=(int(sum(a[:, r].sum() for a in itr)), H)).astype(reference.bfloat16)
         for r in range(R)]
    for rank in range(R):
        bias = rng.integers(-4, 4, size=(tokens[rank], H)).astype(reference.bfloat16)
        two, _ = iref.combine(y, itr, rank, G, bias=bias)
        one, _ = reference.combine(y, itr, rank, bias=bias)
        assert np.array_equal(two.astype(np.float32), one.astype(np.float32))


def test_two_level_combine_rounds_per_node():
    # 2 nodes x 2 GPUs; token 0 of rank 0 held by all 4 ranks; values chosen so the per-node rounding shows
    itr = [np.array([[1, 1, 1, 1]], bool)] + [np.zeros((0, 4), bool)] * 3
    v = [1.0, 2.0 ** -9, 1.0, 2.0 ** -9]   # 1 + 2^-9 rounds to 1 in bf16 (8 bits of mantissa)
    y = [np.array([[val]], dtype=np.float32).astype(reference.bfloat16) for val in v]
    two, _ = iref.combine(y, itr, 0, 2)
    one, _ = reference.combine(y, itr, 0)
    assert float(two[0, 0]) == 2.0 and float(one[0, 0]) == float(np.float32(2 + 2 ** -8).astype(reference.bfloat16))


# ---- the kernels' index arithmetic, modelled from handle fields only -----------------------------------
def _model_combine(y, handles, rank, N, G, C):
    """Combine for rank `rank` computed the way internode.cu does, reading only handle fields:
    NVL senders fill sub-rings, forwarders reduce via send_nvl_head into RDMA rings, receivers read send_rdma_head."""
    H = y[0].shape[1]
    nvl = {}    # (forwarder rank, channel, sender GPU, origin node) -> list of rows in sub-ring order
    for s in range(N * G):
        hs = handles[s]
        m = s // G
        for k in range(G):
            for n in range(N):
                src = n * G + k
                for c in range(C):
                    begin = int(hs.recv_gbl_channel_prefix_matrix[src, c])
                    end = (int(hs.recv_gbl_channel_prefix_matrix[src, c + 1]) if c + 1 < C
                           else int(hs.recv_gbl_rank_prefix_sum[src]))
                    nvl[(m * G + k, c, s % G, n)] = [y[s][r].astype(np.float32) for r in range(begin, end)]
    rdma = {}   # (origin rank, channel, forwarder node) -> partials in ring order
    for f in range(N * G):
        hf = handles[f]
        m, k = divmod(f, G)
        for n in range(N):
            row = hf.recv_rdma_channel_prefix_matrix[n]
            for c in range(C):
                total = int(row[c]) - (int(row[c - 1]) if c else 0)
                base = (int(hf.recv_rdma_rank_prefix_sum[n - 1]) if n else 0) + (int(row[c - 1]) if c else 0)
                partials = []
                for i in range(total):
                    acc = np.zeros(H, np.float32)
                    for j in range(G):
                        h = int(hf.send_nvl_head[base + i, j])
                        if h >= 0:
                            acc += nvl[(f, c, j, n)][h]
                    partials.append(acc.astype(reference.bfloat16).astype(np.float32))
                rdma[(n * G + k, c, m)] = partials
    ho = handles[rank]
    T = ho.is_token_in_rank.shape[0]
    out = np.zeros((T, H), np.float32)
    for c, (b, e) in enumerate(reference.channel_ranges(T, C)):
        for t in range(b, e):
            for m in range(N):
                h = int(ho.send_rdma_head[t, m])
                if h >= 0:
                    out[t] += rdma[(rank, c, m)][h]
    return out.astype(reference.bfloat16)


@pytest.mark.parametrize("seed, N, G, C, tokens", [(11, 2, 1, 2, [9, 5]), (12, 2, 2, 3, [10, 0, 7, 12]),
                                                   (13, 3, 2, 2, [4, 8, 1, 6, 9, 3]), (14, 2, 2, 4, [13, 3, 0, 8])])
def test_kernel_index_model_matches_the_oracle(seed, N, G, C, tokens):
    R, H = N * G, 8
    _, itr = _routing(seed, R, tokens, 2 * R, 2)
    handles = [iref.handle(itr, r, G, C) for r in range(R)]
    rng = np.random.default_rng(seed)
    y = [rng.standard_normal((int(handles[r].recv_gbl_rank_prefix_sum[-1]), H)).astype(reference.bfloat16)
         for r in range(R)]
    for rank in range(R):
        expected, _ = iref.combine(y, itr, rank, G)
        assert np.array_equal(_model_combine(y, handles, rank, N, G, C).astype(np.float32),
                              expected.astype(np.float32))


def test_docs_table_is_current(monkeypatch, tmp_path):
    """docs/internode_buffers.md holds the table the size model prints (regenerate it when the model changes)."""
    from pathlib import Path
    from cupy_ep import Buffer
    monkeypatch.setenv("CUPY_EP_TUNED_CONFIG", str(tmp_path / "none.json"))
    monkeypatch.setattr(Buffer, "num_sms", 20)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "internode_buffers.md").read_text()
    assert cfg.internode_table() in doc


def test_host_backend_accepts_the_transport_argument(comm):
    from cupy_ep import Buffer
    buf = Buffer(comm, backend="host", internode_transport="ipc")
    buf.destroy()
    with pytest.raises(ValueError, match="internode_transport"):
        Buffer(comm, backend="host", internode_transport="tcp")
