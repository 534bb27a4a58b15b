"""benchmarks/deepep_side_by_side.py on the host backend: DeepEP-style code driving cupy_ep.deep_ep, its exact-sum
checks and call timings of every op recorded, and the side-by-side table (DeepEP's column "not run" here)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "deepep_side_by_side.py"
OPS = ("get_dispatch_layout", "dispatch", "cached_dispatch", "combine", "low_latency_dispatch", "low_latency_combine")


def _script():
    spec = importlib.util.spec_from_file_location("deepep_side_by_side", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.mpi(min_size=2)
def test_side_by_side_on_the_host_backend(comm, tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_EP_BACKEND", "host")
    sbs = _script()
    out = Path(comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None))
    sbs.main(["--impl", "cupy_ep", "--model", "qwen3-235b", "--tokens", "24", "--ll-tokens", "8", "--iters", "2",
              "--warmup", "0", "--out", str(out)], comm=comm)
    comm.Barrier()
    if comm.Get_rank():
        return
    doc = json.loads((out / "side_by_side_cupy_ep.json").read_text())
    assert (doc["impl"], doc["backend"], doc["num_ranks"], doc["model"]) == ("cupy_ep", "host", comm.Get_size(),
                                                                           "qwen3-235b")
    checks = [r["op"] for r in doc["results"] if r["timing"] == "check"]
    assert checks == ["combine(dispatch(x))", "low_latency_combine(low_latency_dispatch(x))"]
    calls = {r["op"]: r for r in doc["results"] if r["timing"] == "call"}
    assert sorted(calls) == sorted(OPS)
    assert all(r["median_us"] > 0 for r in calls.values())
    md = sbs.compare(out)
    assert (out / "side_by_side.md").read_text() == md
    assert f"| cached_dispatch | call | {calls['cached_dispatch']['median_us']:.1f} | not run | - |" in md


def test_side_by_side_refuses_an_odd_sm_count(capsys):
    with pytest.raises(SystemExit):
        _script().parse_args(["--impl", "cupy_ep", "--sms", "23"])
    assert "--sms: must be even" in capsys.readouterr().err
