"""benchmarks/ab_inprocess.py: a second tree of cupy_ep imported beside the checkout's, and the paired table."""
import importlib.util
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ab_inprocess", _ROOT / "benchmarks" / "ab_inprocess.py")
ab_inprocess = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_inprocess)


def test_load_tree_is_a_separate_package():
    import cupy_ep
    from cupy_ep import config
    name = "cupy_ep_ab_test_copy"
    try:
        copy = ab_inprocess.load_tree(_ROOT, name)
        assert copy is not cupy_ep and copy.__name__ == name
        assert copy.config is not config and copy.config.__name__ == f"{name}.config"
        assert copy.Buffer is not cupy_ep.Buffer and copy.Buffer.__module__ == f"{name}.buffer"
        # the copy computes what the checkout computes (same sources here)
        assert copy.config.low_latency_rdma_size_hint(128, 7168, 2, 256) == \
            config.low_latency_rdma_size_hint(128, 7168, 2, 256)
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def test_load_tree_refuses_a_folder_without_the_package(tmp_path):
    with pytest.raises((ImportError, FileNotFoundError)):
        ab_inprocess.load_tree(tmp_path, "cupy_ep_ab_missing")
    assert "cupy_ep_ab_missing" not in sys.modules


def test_summarize_pairs_each_repetition():
    samples = {("combine bf16", "steady"): {"base": [100.0, 110.0, 90.0, 100.0], "head": [102.0, 99.0, 93.6, 101.0]},
               ("ll_dispatch fp8", "steady"): {"base": [None, 20.0], "head": [5.0, 22.0]}}
    rows = {(r["op"], r["timing"]): r for r in ab_inprocess.summarize(samples)}
    r = rows[("combine bf16", "steady")]
    # pairs 1.02, 0.9, 1.04, 1.01: their median, not the medians' ratio (100.0 / 100.5 ... )
    assert r["reps"] == 4 and r["ratio"] == pytest.approx((1.01 + 1.02) / 2)
    assert r["low"] == pytest.approx(0.9) and r["high"] == pytest.approx(1.04)
    assert r["base_us"] == pytest.approx(100.0) and r["head_us"] == pytest.approx(100.0)
    assert r["base_spread"] == pytest.approx(110.0 / 90.0 - 1)
    # an unresolved steady time leaves its repetition out of the pairs
    r = rows[("ll_dispatch fp8", "steady")]
    assert r["reps"] == 1 and r["ratio"] == pytest.approx(1.1) and r["base_us"] == 20.0
    text = ab_inprocess.markdown(list(rows.values()), {"base_commit": "aaa", "head_commit": "bbb", "gpu": "G",
                                                       "ranks": 2, "shared_gpu": True, "reps": 4, "iters": 50,
                                                       "first": "base", "date": "2026-12-06"})
    assert "| combine bf16 | steady | 100.0 | 100.0 | 1.015 | 0.900-1.040 | 22.2 % |" in text
