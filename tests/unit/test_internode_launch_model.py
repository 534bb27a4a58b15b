"""CPU check of InternodeState's launches without a GPU: a stand-in for CuPy (numpy arrays) and a fake buffer let
dispatch / cached dispatch / combine run their host logic; every launch is recorded and its argument count,
kernel name, grid and block compared with the kernel signatures parsed from cuda_src/internode.cu."""
from __future__ import annotations

import contextlib
import re
import sys
import types

import numpy as np
import pytest

from cupy_ep import config as cfg
from cupy_ep.cuda import internode as ci
from cupy_ep import internode_reference as iref
from cupy_ep import jit, reference, validate


def kernel_signatures() -> dict:
    """``{kernel name: [kind of each parameter]}`` of the __global__ functions of internode.cu, kind one of
    ``"ptr"``, ``"int32"``, ``"int64"``."""
    src = (jit.source_dir() / "internode.cu").read_text()
    out = {}
    for m in re.finditer(r"__global__ void(?: __launch_bounds__\([^)]*\))?(?:\s*//[^\n]*)?\s+(\w+)\(", src):
        depth, i = 1, m.end()
        while depth:
            depth += (src[i] == "(") - (src[i] == ")")
            i += 1
        kinds = []
        for decl in src[m.end():i - 1].split(","):
            decl = " ".join(decl.split())
            kinds.append("ptr" if "*" in decl else "int64" if decl.startswith("long long") else "int32")
        out[m.group(1)] = kinds
    return out


def kernel_param_counts() -> dict:
    return {k: len(v) for k, v in kernel_signatures().items()}


def _arg_kind(a) -> str:
    if a is None or isinstance(a, (np.ndarray, np.uint64)):
        return "ptr"
    if isinstance(a, np.int64):
        return "int64"
    if isinstance(a, np.int32):
        return "int32"
    raise AssertionError(f"argument of type {type(a).__name__}: pass numpy scalars or arrays")


class _FakeCupy(types.ModuleType):
    int32, int64, uint8, uint16, float32, bool_ = np.int32, np.int64, np.uint8, np.uint16, np.float32, np.bool_

    def __init__(self):
        super().__init__("cupy")

    @staticmethod
    def empty(shape, dtype):
        return np.zeros(shape, dtype=dtype)


class _FakeBuf:
    """The backend and its runtime in one (the state reads both)."""

    def __init__(self, rank, num_ranks, G):
        self.rank, self.num_ranks, self.device_id, self.timeout_s = rank, num_ranks, None, 5.0
        self.comm_stream = contextlib.nullcontext()
        self.ctx = np.zeros(40, np.uint8)
        self.record = np.zeros(1, dtype=[("flag", "<i4")])
        self.unusable_reason = None
        self.topology = types.SimpleNamespace(num_ranks_per_node=G)

    def begin(self, kind, previous_event):
        return contextlib.nullcontext()

    def finish(self, compute, async_finish, keep, kind):
        return None

    def device_failed(self):
        return bool(int(self.record["flag"][0]))

    def check_health(self):
        pass

    def next_dispatch_epoch(self):
        return 1


def _state(rank, N, G, transport, counters=None):
    st = ci.InternodeState.__new__(ci.InternodeState)
    st.buf = st.rt = _FakeBuf(rank, N * G, G)
    st.num_nodes, st.gpus_per_node, st.transport = N, G, transport
    st.node, st.nvl_rank = divmod(rank, G)
    st.num_nvl_bytes = st.num_rdma_bytes = 1 << 34
    st.nvl = types.SimpleNamespace(ptr_table=np.zeros(G, np.uint64))
    st.rdma_base = 1 << 20
    bases = (1 << 40) + np.arange(N, dtype=np.uint64) * (1 << 34)
    st.rdma_peers = ci.rdma_peer_table(bases if transport == "ipc" else None, bases)
    st.rdma_put_peers = ci.rdma_peer_table(bases if transport == "ipc" else None, None)
    st.force_put = False
    st.host = types.SimpleNamespace(ptr=4096)
    st.counters = np.zeros(2 + cfg.MAX_LOCAL_EXPERTS, np.int32) if counters is None else counters
    st.launches = []

    def launch(name, grid, block, args):
        st.launches.append((name, grid, block, args))
        if "notify_dispatch" in name:   # the kernel's host-visible effect: the receive counts
            st.counters[:] = st.fake_counts
    st.launch = launch
    return st


@pytest.fixture
def fake_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy())


@pytest.mark.parametrize("N, G, transport", [(2, 1, "nvshmem"), (2, 2, "ipc"), (4, 8, "nvshmem")])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("force_put", [False, True], ids=["direct", "put"])
def test_launch_arguments_match_the_kernels(fake_cupy, N, G, transport, fp8, force_put):
    counts = kernel_param_counts()
    assert {"internode_notify_dispatch", "internode_cached_notify", "internode_dispatch", "internode_combine",
            "internode_put_bandwidth", "internode_carve_probe"} <= set(counts)
    R, T, H, K, E = N * G, 37, 256, 4, 4 * N * G
    rank = R - 1
    rng = np.random.default_rng(0)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64)
    w = rng.random((T, K), dtype=np.float32)
    x = (rng.integers(0, 100, (T, H), dtype=np.uint8), rng.random((T, H // 128), dtype=np.float32)) if fp8 \
        else rng.standard_normal((T, H), dtype=np.float32).astype(reference.bfloat16)
    per_rank, per_rdma, per_expert, in_rank = reference.get_dispatch_layout(idx, E, R, G)
    st = _state(rank, N, G, transport)
    st.force_put = force_put
    num_recv, num_rdma_recv = 11, 13
    st.fake_counts = np.zeros_like(st.counters)
    st.fake_counts[:2] = (num_recv, num_rdma_recv)
    dcfg = cfg.Config(8, 6, 256, 6, 128)
    info = validate.check_x(x, None)
    out = st.dispatch(info, None, per_rank, per_rdma, in_rank, per_expert, idx, w, 1, 0, dcfg, None, False, False, True)
    recv_x, recv_idx, recv_w, per_expert_list, handle, _ = out
    assert (recv_x[0] if fp8 else recv_x).shape == (num_recv, H)
    assert recv_idx.shape == (num_recv, K) and len(per_expert_list) == E // R
    assert len(handle) == 10 and handle[7].shape == (num_recv, 8) and handle[7].dtype == np.uint8
    assert handle[9].shape == (num_rdma_recv, G)
    ci.check_handle(handle, R, N, G, dcfg.num_channels)

    # cached dispatch, combine with weights and biases, num_worst_tokens
    st.dispatch(info, handle, None, None, None, None, None, None, 1, 0, dcfg, None, False, False, True)
    y = np.zeros((num_recv, H), dtype=np.float32).astype(reference.bfloat16)
    bias = np.zeros((T, H), dtype=np.float32).astype(reference.bfloat16)
    combined, combined_w, _ = st.combine(y, handle, recv_w, (bias, bias), lambda c: cfg.Config(2 * c, 6, 256, 6, 128),
                                         None, False, False)
    assert combined.shape == (T, H) and combined_w.shape == (T, K)
    worst = st.dispatch(info, None, per_rank, per_rdma, in_rank, per_expert, idx, w, 1, T * R, dcfg, None, False,
                        False, True)
    assert (worst[0][0] if fp8 else worst[0]).shape[0] == T * R
    assert worst[4][9].shape == (T * R, G)

    names = []
    for name, grid, block, args in st.launches:
        base = name.split("<")[0].removeprefix("ep::")
        names.append(base)
        assert len(args) == counts[base], f"{name}: {len(args)} arguments, the kernel takes {counts[base]}"
        assert [_arg_kind(a) for a in args] == kernel_signatures()[base], name
        assert f"<{N}, {G}, " in name and ci._TRANSPORT_TYPES[transport] in name
        assert block % 32 == 0 and 0 < block <= 512
        # every kernel gets the peer table of the mode (force_put: without load/store addresses), once
        table, other = (st.rdma_put_peers, st.rdma_peers) if force_put else (st.rdma_peers, st.rdma_put_peers)
        assert sum(a is table for a in args) == 1 and not any(a is other for a in args), name
        if base in ("internode_dispatch", "internode_combine"):
            assert grid == 2 * dcfg.num_channels
            assert block == ci.threads(base.removeprefix("internode_"), N, G)
        if base == "internode_notify_dispatch":
            assert grid == 1 + N
    assert names == ["internode_notify_dispatch", "internode_dispatch", "internode_cached_notify",
                     "internode_dispatch", "internode_cached_notify", "internode_combine",
                     "internode_notify_dispatch", "internode_dispatch"]


def test_cached_dispatch_and_combine_refuse_bad_arguments(fake_cupy):
    N, G, R, T, H = 2, 1, 2, 5, 128
    st = _state(0, N, G, "ipc")
    itr = [np.ones((T, R), bool), np.ones((3, R), bool)]
    h = iref.handle(itr, 0, G, 2)
    handle = (h.is_token_in_rank, h.rdma_channel_prefix_matrix, h.gbl_channel_prefix_matrix,
              h.recv_rdma_channel_prefix_matrix, h.recv_rdma_rank_prefix_sum, h.recv_gbl_channel_prefix_matrix,
              h.recv_gbl_rank_prefix_sum, iref.src_meta_bytes(h.recv_src_meta), h.send_rdma_head, h.send_nvl_head)
    x = np.zeros((T, H), np.float32).astype(reference.bfloat16)
    info = validate.check_x(x, None)
    dcfg = cfg.Config(4, 6, 256, 6, 128)
    with pytest.raises(ValueError, match="topk_idx"):
        st.dispatch(info, handle, None, None, None, None, np.zeros((T, 2), np.int64), None, 1, 0, dcfg, None, False,
                    False, True)
    with pytest.raises(ValueError, match="num_worst_tokens"):
        st.dispatch(info, handle, None, None, None, None, None, None, 1, 8, dcfg, None, False, False, True)
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank"):
        st.dispatch(info, None, np.zeros(R, np.int32), None, np.zeros((T, R), bool), np.zeros(4, np.int32), None,
                    None, 1, 0, dcfg, None, False, False, True)
    num_recv = h.recv_src_meta.shape[0]
    y = np.zeros((num_recv + 1, H), np.float32).astype(reference.bfloat16)
    with pytest.raises(ValueError, match=f"x: has {num_recv + 1} rows"):
        st.combine(y, handle, None, None, lambda c: cfg.Config(2 * c, 6, 256, 6, 128), None, False, False)
    with pytest.raises(ValueError, match="num_sms"):
        st.combine(y[:num_recv], handle, None, None, lambda c: cfg.Config(2 * c + 2, 6, 256, 6, 128),
                   None, False, False)
    with pytest.raises(ValueError, match="sub-rings"):
        st.combine(y[:num_recv], handle, None, None, lambda c: cfg.Config(2 * c, 200, 256, 6, 128),
                   None, False, False)
    assert st.launches == []
