"""GPU-less checks of the low-latency GPU path's pure-Python logic: layout sizes vs the DeepEP size hint,
warp-group choice, NVSHMEM environment defaults, the teardown decision of LowLatencyState.destroy."""
import os

import pytest

from cupy_ep import config
from cupy_ep.cuda_low_latency import groups_per_block, set_nvshmem_env


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


def test_signal_offsets_do_not_depend_on_hidden_or_tokens():
    a = config.low_latency_layout(128, 7168, 2, 256)
    b = config.low_latency_layout(16, 512, 2, 256)
    assert a["signal_offset_1"] == b["signal_offset_1"] == 1024


@pytest.mark.parametrize("items,blocks,want", [(1, 132, 1), (128, 132, 1), (133, 132, 2), (256, 132, 2),
                                               (512, 132, 4), (1024, 132, 8), (100000, 132, 8), (0, 132, 1)])
def test_groups_per_block(items, blocks, want):
    assert groups_per_block(items, blocks) == want


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

    from cupy_ep.cuda_low_latency import LowLatencyState
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
