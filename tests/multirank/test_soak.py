"""The soak driver on the host backend: a short run passes, and a corrupted result is caught."""
import numpy as np
import pytest

from cupy_ep import reference
from cupy_ep.tools import harness, soak


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


def test_progress_without_tqdm(monkeypatch):
    """tqdm is optional (the bench extra): without it the iterations run as a plain range."""
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # import tqdm raises ImportError
    items = range(3, 7)
    assert harness.progress(items, 0, "soak") is items


@pytest.mark.mpi(min_size=2)
def test_soak_on_cuda_without_a_gpu_is_one_error(comm, capsys):
    from cupy_ep import gpu_available
    if gpu_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit) as e:
        soak.main(["--iters", "1", "--backend", "cuda"])
    assert e.value.code == 2
    assert comm.allgather(e.value.code) == [2] * comm.Get_size()
    err = capsys.readouterr().err
    expected = 1 if comm.Get_rank() == 0 else 0
    assert err.count("python -m cupy_ep.soak: error: argument --backend: cuda, but this rank sees no GPU") == expected
