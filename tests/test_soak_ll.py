"""The low-latency soak (``python -m cupy_ep.soak --mode low-latency``) on the host backend: the shapes it draws,
a short run passes, and a corrupted result is caught."""
import argparse

import numpy as np
import pytest

from cupy_ep import reference, soak, soak_ll

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
