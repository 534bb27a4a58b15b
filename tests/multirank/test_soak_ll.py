"""The low-latency soak (``python -m cupy_ep.soak --mode low-latency``) on the host backend: the shapes it draws,
a short run passes, and a corrupted result is caught."""
import argparse

import numpy as np
import pytest

from cupy_ep import reference
from cupy_ep.tools import soak, soak_ll

# small shapes: the host backend and the reference are numpy, M=8 keeps an iteration in milliseconds
ARGS = ["--mode", "low-latency", "--max-tokens", "8", "--hiddens", "128,512,1024", "--backend", "host"]


def test_shapes_are_valid_and_the_same_for_the_same_seed():
    hiddens = (128, 512, 1024)
    shapes = [soak_ll.iteration_shape(7, it, 8, 4, hiddens) for it in range(300)]
    assert shapes == [soak_ll.iteration_shape(7, it, 8, 4, hiddens) for it in range(300)]
    for s in shapes:
        assert len(s["tokens"]) == 4 and all(0 <= t <= 8 for t in s["tokens"])
        assert s["hidden"] in hiddens and s["experts"] % 4 == 0 and 1 <= s["topk"] <= 8
        assert not s["use_fp8"] or s["hidden"] % 512 == 0
        assert s["round_scale"] <= s["use_fp8"] and s["use_ue8m0"] <= s["round_scale"]
    for flag in ("use_fp8", "round_scale", "use_ue8m0", "hook", "zero_copy", "check"):
        assert any(s[flag] for s in shapes) and not all(s[flag] for s in shapes), flag
    assert {s["hidden"] for s in shapes} == set(hiddens)


def test_routing_has_distinct_experts_and_pads_with_minus_one():
    idx = soak_ll.routing(np.random.default_rng(0), 50, 8, 3, 0.0)
    assert idx.shape == (50, 8) and idx.dtype == np.int64
    assert (idx[:, 3:] == -1).all() and all(sorted(row[:3]) == [0, 1, 2] for row in idx)


def test_hiddens_argument():
    assert soak_ll.hidden_list("2048,7168") == (2048, 7168)
    for bad in ("100", "2048,", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            soak_ll.hidden_list(bad)


@pytest.mark.mpi(min_size=2)
def test_short_low_latency_soak_passes(comm, capsys):
    assert soak.main(ARGS + ["--iters", "12", "--check-every", "2"]) == 0
    if comm.Get_rank() == 0:
        assert "cupy_ep.soak --mode low-latency: 12 iterations" in capsys.readouterr().out


@pytest.mark.mpi(min_size=2)
def test_low_latency_soak_reports_a_mismatch(comm, monkeypatch, capsys):
    real = reference.low_latency_combine

    def off_by_one_ulp(*args, **kwargs):
        out = real(*args, **kwargs)
        bits = out.view(np.uint16).copy()
        if bits.size:
            bits.flat[0] ^= 1
        return bits.view(reference.bfloat16)

    monkeypatch.setattr(reference, "low_latency_combine", off_by_one_ulp)
    # every iteration is checked; the first with a token on some rank fails
    assert soak.main(ARGS + ["--iters", "5", "--check-every", "1", "--seed", "5"]) == 1
    if comm.Get_rank() == 0:
        assert "replay: python -m cupy_ep.soak --mode low-latency --seed 5" in capsys.readouterr().out


def test_device_failure_reports_a_timed_out_wait_after_the_device_is_idle(monkeypatch):
    import sys
    from types import SimpleNamespace

    from cupy_ep.errors import CommTimeoutError
    synced = []
    fake_cupy = SimpleNamespace(
        cuda=SimpleNamespace(runtime=SimpleNamespace(deviceSynchronize=lambda: synced.append(1))))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)

    def timed_out():
        assert synced, "the record is read only once the device is idle"
        raise CommTimeoutError("rank 3: device wait timed out after 10.0 s", {"kernel": "low_latency_dispatch"})

    assert soak_ll.device_failure(SimpleNamespace(backend="cuda", check_health=timed_out)).startswith(
        "CommTimeoutError: rank 3: device wait timed out")
    assert soak_ll.device_failure(SimpleNamespace(backend="cuda", check_health=lambda: None)) is None
    assert soak_ll.device_failure(SimpleNamespace(backend="host")) is None


@pytest.mark.mpi(min_size=2)
def test_low_latency_soak_reports_a_device_failure_not_a_mismatch(comm, monkeypatch, capsys):
    """A wait that timed out leaves garbage outputs (read as data they look like "MISMATCH ... recv_count"): the soak
    stops on every rank at that iteration, naming the rank and the error, before comparing anything."""
    calls = []

    def failing_on_rank_1_at_iteration_2(buf):
        calls.append(1)
        return "CommTimeoutError: rank 1: device wait timed out" if comm.Get_rank() == 1 and len(calls) == 3 else None

    monkeypatch.setattr(soak_ll, "device_failure", failing_on_rank_1_at_iteration_2)
    assert soak.main(ARGS + ["--iters", "5", "--check-every", "1"]) == 1
    assert len(calls) == 3                      # every rank stopped at the same iteration
    if comm.Get_rank() == 0:
        out = capsys.readouterr().out
        assert "DEVICE WAIT FAILED at iteration 2" in out and "rank 1: CommTimeoutError" in out
        assert "MISMATCH" not in out
