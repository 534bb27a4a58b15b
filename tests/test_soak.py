"""The soak driver on the host backend: a short run passes, and a corrupted result is caught."""
import numpy as np
import pytest

from cupy_ep import reference, soak


@pytest.mark.mpi(min_size=2)
def test_short_soak_passes(comm):
    assert soak.main(["--iters", "12", "--check-every", "3", "--max-tokens", "64", "--backend", "host"]) == 0


@pytest.mark.mpi(min_size=2)
def test_soak_reports_a_mismatch(comm, monkeypatch):
    real = reference.combine

    def off_by_one_ulp(*args, **kwargs):
        out, w = real(*args, **kwargs)
        bits = out.view(np.uint16).copy()
        if bits.size:
            bits.flat[0] ^= 1
        return bits.view(reference.bfloat16), w

    monkeypatch.setattr(reference, "combine", off_by_one_ulp)
    # iteration 0 is always checked; make sure it has tokens on some rank
    assert soak.main(["--iters", "3", "--check-every", "1", "--max-tokens", "64", "--backend", "host",
                      "--seed", "5"]) == 1
