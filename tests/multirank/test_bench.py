"""The benchmark's timing arithmetic, records and reports on the CPU (no GPU: the timers are faked).

GpuTimer.steady's arithmetic (with ``_capture_steady`` and ``_time`` replaced), the normal-mode records and
markdown/plot, the low-latency records, markdown and host-overhead loop, and a host-backend run of
``python -m cupy_ep.bench`` checked against the JSON fields its reports promise.
"""
from __future__ import annotations

import argparse
import json
import sys
import types

import numpy as np
import pytest

from cupy_ep.tools import bench, bench_ll, cli, harness
from cupy_ep.tools.harness import GpuTimer, Timing

# The fields every normal-mode result and the document carry (the report's schema; later fields only add).
ISSUE_TOP = ("commit", "gpu", "driver", "num_ranks", "ceiling_gbps", "results")
ISSUE_RESULT = ("op", "dtype", "num_sms", "tokens", "hidden", "topk", "experts", "time_us_median", "time_us_min",
                "logical_gbps", "nvlink_gbps", "fraction_of_ceiling", "nccl_time_us", "ratio_to_nccl")
STEADY_RESULT = ("time_us_steady", "nvlink_gbps_steady", "fraction_of_ceiling_steady", "nccl_time_us_steady",
                 "ratio_to_nccl_steady")


# ------------------------------------------------------------------------------------------------------
# GpuTimer.steady with a fake timer
# ------------------------------------------------------------------------------------------------------
class _FakeGraph:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def launch(self, stream):
        self.log.append(self.name)


def _fake_timer(monkeypatch, ops_us, flush_us):
    """A GpuTimer without CuPy: captures return fake graphs; ``_time`` replays once and reports the given
    per-iteration times (slowest rank) of whichever graph it launched."""
    timer = GpuTimer.__new__(GpuTimer)
    timer.comm, timer.iters, timer.warmup = None, len(ops_us), 0
    launched, captured = [], []

    def capture(fn, n):
        captured.append((fn, n))
        return "stream", _FakeGraph("ops", launched), _FakeGraph("flush", launched)

    def fake_time(stream, launch):
        assert stream == "stream"
        launch()
        timer.last = np.asarray(ops_us if launched[-1] == "ops" else flush_us, dtype=float)
        return Timing(float(np.median(timer.last)), float(np.min(timer.last)))
    monkeypatch.setattr(timer, "_capture_steady", capture)
    monkeypatch.setattr(timer, "_time", fake_time)
    return timer, launched, captured


def test_steady_per_op_is_ops_minus_flush_over_n(monkeypatch):
    ops_us = [110.0, 100.0, 130.0, 120.0, 105.0]
    flush_us = [52.0, 50.0, 48.0]  # median 50
    timer, launched, captured = _fake_timer(monkeypatch, ops_us, flush_us)
    fn = object()
    t = timer.steady(fn, n=5)
    assert captured == [(fn, 5)]
    assert launched == ["ops", "flush"]
    assert t.median_us == pytest.approx((110.0 - 50.0) / 5)
    assert t.min_us == pytest.approx((100.0 - 50.0) / 5)
    np.testing.assert_allclose(timer.last, (np.array(ops_us) - 50.0) / 5)


def test_steady_p99_uses_per_op_times(monkeypatch):
    timer, _, _ = _fake_timer(monkeypatch, [float(v) for v in range(100, 200)], [40.0])
    timer.__class__ = bench_ll.LatencyTimer
    timer.steady(None, n=4)
    assert timer.p99() == pytest.approx(np.percentile((np.arange(100, 200) - 40.0) / 4, 99))


def test_steady_clamps_at_a_positive_floor(monkeypatch):
    # noise: the ops graph no slower than the flush-only graph
    timer, _, _ = _fake_timer(monkeypatch, [49.0, 50.0, 51.0], [50.0, 52.0, 51.0])
    t = timer.steady(None, n=10)
    assert t.min_us == harness.STEADY_FLOOR_US > 0
    assert t.median_us == harness.STEADY_FLOOR_US
    assert np.all(timer.last >= harness.STEADY_FLOOR_US)


def test_a_steady_time_at_the_floor_is_not_reported(monkeypatch):
    """A steady timing at the floor becomes None (reported "-"), so the record's device time is the graph's and
    no steady GB/s comes from 1 ns; a resolved steady timing stays as it is."""
    timer, _, _ = _fake_timer(monkeypatch, [49.0, 50.0, 51.0], [50.0, 52.0, 51.0])
    at_floor = timer.steady(None, n=10)
    assert harness.resolved(at_floor) is None and harness.resolved(None) is None
    fine = harness.Timing(12.5, 11.0)
    assert harness.resolved(fine) is fine
    graph = harness.Timing(100.0, 90.0)
    t = {"call": harness.Timing(200.0, 180.0), "graph": graph, "steady": harness.resolved(at_floor)}
    rec = bench.make_record({"op": "dispatch"}, t, row_bytes=1000, logical_rows=2000, nvl_rows=1000,
                            ceiling={"graph": 100.0, "steady": None}, nccl={})
    assert rec["kernel_time_us"] == 100.0 and rec["kernel_timing"] == "graph"
    assert rec["time_us_steady"] is None and rec["nvlink_gbps_steady"] is None
    assert rec["nvlink_gbps_graph"] == pytest.approx(1000 * 1000 / 100e-6 / 1e9)


def test_steady_median_is_taken_before_the_clamp(monkeypatch):
    timer, _, _ = _fake_timer(monkeypatch, [0.0, 60.0, 70.0, 80.0], [50.0])
    t = timer.steady(None, n=1)
    assert t.median_us == pytest.approx(15.0)  # median of (-50, 10, 20, 30)
    assert t.min_us == harness.STEADY_FLOOR_US


def test_steady_needs_at_least_one_op(monkeypatch):
    timer, _, _ = _fake_timer(monkeypatch, [1.0], [1.0])
    with pytest.raises(ValueError, match="n must be >= 1"):
        timer.steady(None, n=0)


def _fake_replays(monkeypatch, times_us):
    """A GpuTimer whose graph capture and ``_time`` are fakes: ``_time`` runs ``before`` and ``launch`` once,
    logging what reaches the stream in order, and reports ``times_us`` per iteration."""
    timer = GpuTimer.__new__(GpuTimer)
    timer.comm, timer.iters, timer.warmup = None, len(times_us), 0
    log = []

    class Stream(str):  # "stream", usable as `with stream:`
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Kernel:
        def __call__(self, grid, block, args, stream=None):
            log.append(("spin", int(args[0]), stream))

    def fake_time(stream, launch, before=None):
        if before is not None:
            before()
        log.append(("start", stream))
        launch()
        timer.last = np.asarray(times_us, dtype=float)
        return Timing(float(np.median(timer.last)), float(np.min(timer.last)))
    monkeypatch.setattr(harness, "warm_stream", lambda comm, ops: (ops(), Stream("stream"))[1])
    monkeypatch.setattr(harness, "capture_graph", lambda stream, ops: (ops(), _FakeGraph("replay", log))[1])
    monkeypatch.setattr("cupy_ep.jit.get_kernel", lambda filename, name: Kernel())
    monkeypatch.setattr(timer, "_time", fake_time)
    return timer, log


def test_aligned_queues_the_barrier_and_the_spin_before_the_start_event(monkeypatch):
    timer, log = _fake_replays(monkeypatch, [30.0, 28.0, 40.0])
    calls = []
    t = timer.aligned(lambda: calls.append("op"), lambda stream: log.append(("align", stream)), per_replay=2,
                      spin_us=25.0)
    assert log == [("align", "stream"), ("spin", 25_000, "stream"), ("start", "stream"), "replay"]
    assert calls == ["op"] * 4  # the warm-up's two calls and the capture's two
    assert (t.median_us, t.min_us) == (15.0, 14.0)  # per op
    np.testing.assert_allclose(timer.last, [15.0, 14.0, 20.0])


def test_graph_queues_nothing_before_the_start_event(monkeypatch):
    timer, log = _fake_replays(monkeypatch, [30.0])
    t = timer.graph(lambda: None)
    assert log == [("start", "stream"), "replay"] and t.median_us == 30.0


# ------------------------------------------------------------------------------------------------------
# normal mode: records, markdown, plot, options
# ------------------------------------------------------------------------------------------------------
BASE = dict(op="cached_dispatch", dtype="bf16", num_sms=24, tokens=4096, hidden=7168, topk=8, experts=256)


def _timings(call=300.0, graph=250.0, steady=200.0):
    return {"call": Timing(call, call - 10), "graph": Timing(graph, graph - 5) if graph else None,
            "steady": Timing(steady, steady - 2) if steady else None}


def test_make_record_compares_like_with_like():
    row, rows = 14336, 1000
    rec = bench.make_record(BASE, _timings(), row, 2 * rows, rows, {"graph": 300.0, "steady": 320.0},
                            {"call": 250.0, "graph": 240.0, "steady": 230.0})
    for key in ISSUE_RESULT + STEADY_RESULT:
        assert key in rec, key

    def gbps(us):
        return rows * row / (us * 1e-6) / 1e9
    assert rec["nvlink_gbps"] == pytest.approx(gbps(300.0))
    assert rec["logical_gbps"] == pytest.approx(2 * gbps(300.0))
    assert rec["nvlink_gbps_graph"] == pytest.approx(gbps(250.0))
    assert rec["nvlink_gbps_steady"] == pytest.approx(gbps(200.0))
    assert rec["fraction_of_ceiling"] == pytest.approx(gbps(300.0) / 300.0)          # the headline (graph) ceiling
    assert rec["fraction_of_ceiling_graph"] == pytest.approx(gbps(250.0) / 300.0)
    assert rec["fraction_of_ceiling_steady"] == pytest.approx(gbps(200.0) / 320.0)   # the steady ceiling
    assert rec["ratio_to_nccl"] == pytest.approx(300.0 / 250.0)
    assert rec["ratio_to_nccl_graph"] == pytest.approx(250.0 / 240.0)
    assert rec["ratio_to_nccl_steady"] == pytest.approx(200.0 / 230.0)
    assert rec["time_us_steady"] == 200.0 and rec["time_us_steady_min"] == 198.0


def test_make_record_without_graph_steady_or_baselines():
    rec = bench.make_record(dict(BASE, op="dispatch"), _timings(graph=None, steady=None), 14336, 10, 5, {}, {})
    for key in STEADY_RESULT + ("time_us_graph", "nvlink_gbps_graph", "fraction_of_ceiling_graph",
                                "nccl_time_us_graph", "ratio_to_nccl_graph", "time_us_steady_min",
                                "fraction_of_ceiling", "nccl_time_us", "ratio_to_nccl"):
        assert rec[key] is None, key
    assert "steady" not in bench.log_line(rec) and "graph" not in bench.log_line(rec)


def test_make_record_layout_moves_no_bytes():
    rec = bench.make_record(dict(BASE, op="layout", dtype="-", num_sms=0), _timings(), 0, 0, 0,
                            {"graph": 300.0, "steady": 320.0}, {})
    assert rec["nvlink_gbps"] == 0.0 and rec["fraction_of_ceiling"] == 0.0
    assert rec["nvlink_gbps_steady"] == 0.0 and rec["fraction_of_ceiling_steady"] is None


def _gpu_doc():
    ceiling, nccl = {"graph": 330.0, "steady": 345.0}, {"call": 250.0, "graph": 230.0, "steady": 225.0}
    results = []
    for tokens, sms_list in ((4096, (8, 24)), (1024, (24,))):
        for sms in sms_list:
            base = dict(BASE, num_sms=sms, tokens=tokens)
            results.append(bench.make_record(dict(base, op="dispatch"), _timings(graph=None, steady=None), 14336,
                                             2000, 1000, ceiling, nccl))
            results.append(bench.make_record(base, _timings(), 14336, 2000, 1000, ceiling, nccl))
            results.append(bench.make_record(dict(base, op="combine"), _timings(), 14336, 2000, 1000, ceiling,
                                             nccl))
    args = {"tokens": 4096, "default_sms": 24, "hidden": 7168, "topk": 8, "experts": 256, "steady_n": 10}
    return {"commit": "abc1234", "backend": "cuda", "num_ranks": 2, "gpu": "NVIDIA H200", "driver": "580",
            "ceiling_gbps": 330.0, "ceiling_by_sms": {"8": 200.0, "24": 330.0},
            "ceiling_gbps_steady": 345.0, "ceiling_by_sms_steady": {"8": 210.0, "24": 345.0},
            "startup": {}, "args": args, "results": results}


def test_markdown_table_has_steady_columns_and_says_which_ceiling():
    doc = _gpu_doc()
    md = bench.markdown_table(doc)
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| op |"))
    for column in ("call us", "graph us", "steady us", "of ceiling (graph / steady)",
                   "NCCL us (call / graph / steady)", "ours/NCCL (call / graph / steady)"):
        assert column in header
    assert "call us (min)" not in header
    assert "330.0 GB/s per GPU as graph replays (`ceiling_gbps`)" in md
    assert "345.0 GB/s steady (`ceiling_gbps_steady`)" in md
    assert "*steady* = 10 ops back to back" in md
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| op |")]
    assert len(rows) == len(doc["results"])
    ncols = header.count("|")
    assert all(row.count("|") == ncols for row in rows)
    cached = next(row for row in rows if row.startswith("| cached_dispatch | bf16 | 24 | 4096 |"))
    assert "| 300.0 | 250.0 | 200.0 |" in cached


def test_op_label_names_zero_copy_and_bf16_partials():
    assert harness.op_label({"op": "cached_dispatch"}) == "cached_dispatch"
    assert harness.op_label({"op": "combine", "zero_copy": True}) == "combine zero-copy"
    assert harness.op_label({"op": "ll_combine", "partials": "24-bit"}) == "ll_combine"
    assert harness.op_label({"op": "ll_combine", "partials": "bf16"}) == "ll_combine (bf16 partials)"
    doc = _gpu_doc()
    doc["results"].append(dict(doc["results"][-1], zero_copy=True))
    assert "| combine zero-copy | bf16 | 24 | 1024 |" in bench.markdown_table(doc)


def test_markdown_table_of_a_host_run():
    doc = dict(_gpu_doc(), backend="host", gpu=None, driver=None, ceiling_gbps=None, ceiling_by_sms=None,
               ceiling_gbps_steady=None, ceiling_by_sms_steady=None)
    doc["results"] = [bench.make_record(BASE, _timings(graph=None, steady=None), 14336, 10, 5, {}, {})]
    md = bench.markdown_table(doc)
    assert "no GPU" in md and "- GB/s steady" in md
    assert "| cached_dispatch | bf16 | 24 | 4096 | 300.0 | - | - |" in md


def test_plot_prefers_steady(tmp_path):
    pytest.importorskip("matplotlib")
    doc = _gpu_doc()
    assert bench._device_gbps(doc["results"][1])[1] == "steady"
    assert bench._device_gbps(doc["results"][0])[1] == "call"
    assert bench._nccl_gbps(doc["results"][0]) == pytest.approx(
        doc["results"][0]["nvlink_gbps"] * 300.0 / 225.0)
    bench.plot(doc, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_options():
    args = bench.parse_args([], gpu=True)
    assert args.steady_n == 10 and args.ll_token_sweep == [0, 128]
    args = bench.parse_args(["--steady-n", "0", "--ll-token-sweep", "0,1,32,128"], gpu=False)
    assert args.steady_n == 0 and args.ll_token_sweep == [0, 1, 32, 128]
    with pytest.raises(SystemExit):
        bench.parse_args(["--steady-n", "-1"])
    # the low-latency buffer's M defaults to --tokens; --ll-max-tokens sets it apart from the batch
    assert bench_ll.max_tokens(bench.parse_args(["--tokens", "96"])) == 96
    assert bench_ll.max_tokens(bench.parse_args(["--tokens", "96", "--ll-max-tokens", "256"])) == 256
    with pytest.raises(SystemExit):
        bench.parse_args(["--ll-max-tokens", "0"])


def test_low_latency_mode_refuses_more_tokens_than_max_tokens(capsys, monkeypatch):
    """--tokens above --ll-max-tokens is an argparse error (exit status 2) before MPI starts, naming both options."""
    monkeypatch.setattr(bench.cupy_ep, "start_world", lambda: pytest.fail("MPI started before the arguments"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--mode", "low-latency", "--tokens", "300", "--ll-max-tokens", "256"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    if (cli.launcher_rank() or 0) == 0:  # under a launcher (pytest --with-mpi) only rank 0 prints the error
        assert "error: argument --tokens: --tokens 300 is above --ll-max-tokens 256" in err
    else:
        assert err == ""


def _run_host_bench(out_dir) -> dict | None:
    bench.main(["--backend", "host", "--tokens", "32", "--hidden", "256", "--experts", "16", "--topk", "4",
                "--iters", "2", "--warmup", "0", "--out", str(out_dir)])
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.Get_rank():
        return None
    return json.loads((out_dir / f"bench_host_ep{comm.Get_size()}.json").read_text())


def _check_host_doc(doc):
    for key in ISSUE_TOP + ("ceiling_gbps_steady", "ceiling_by_sms_steady"):
        assert key in doc, key
    assert doc["results"]
    for rec in doc["results"]:
        for key in ISSUE_RESULT + STEADY_RESULT:
            assert key in rec, key
        assert rec["time_us_steady"] is None  # the host backend has no device time
    # the warm start's parts add up to the process's age (the rest is unaccounted_s, logged not hidden)
    st = doc["startup"]
    parts = bench.STARTUP_PARTS
    assert st["mpi_start"] == "already"  # pytest-mpi started MPI before the benchmark's main
    for key in parts:
        assert st[key] is not None and st[key] >= 0, key
    if st["process_to_first_dispatch_s"] is not None:  # Linux /proc
        assert st["unaccounted_s"] == pytest.approx(st["process_to_first_dispatch_s"] - sum(st[k] for k in parts))
        assert st["warm_start_s"] == pytest.approx(st["process_to_first_dispatch_s"] - st["mpi_init_s"])


@pytest.mark.mpi(min_size=2)  # the benchmark needs 2..8 ranks
def test_host_run_writes_the_schema(comm, tmp_path):
    out = comm.bcast(tmp_path if comm.Get_rank() == 0 else None)
    doc = _run_host_bench(out)
    if comm.Get_rank() == 0:
        _check_host_doc(doc)
        assert doc["backend"] == "host" and doc["nccl"].startswith("not measured")
        assert doc["shared_gpu_ranks"] is None
        md = (out / f"bench_host_ep{comm.Get_size()}.md").read_text()
        assert "steady us" in md
        assert md.startswith("# cupy_ep benchmark: host-backend results (numpy + MPI on the CPU, no GPU)")


@pytest.mark.mpi(min_size=2)
def test_host_run_writes_outside_the_committed_results_by_default(comm, tmp_path, monkeypatch):
    """Without --out a host run writes to out/bench_host (ignored by git), not to benchmarks/results."""
    cwd = comm.bcast(tmp_path if comm.Get_rank() == 0 else None)
    monkeypatch.chdir(cwd)
    bench.main(["--backend", "host", "--tokens", "16", "--hidden", "128", "--experts", "8", "--topk", "2",
                "--iters", "1", "--warmup", "0", "--sms", "4"])
    comm.Barrier()
    if comm.Get_rank() == 0:
        stem = f"bench_host_ep{comm.Get_size()}"
        # the same files as a GPU run (the plot where matplotlib is installed)
        names = sorted(p.name for p in (cwd / "out" / "bench_host").iterdir())
        assert names in ([f"{stem}.json", f"{stem}.md"], [f"{stem}.json", f"{stem}.md", f"{stem}.png"])
        assert not (cwd / "benchmarks").exists()
        doc = json.loads((cwd / "out" / "bench_host" / f"{stem}.json").read_text())
        assert doc["args"]["out"] == "out/bench_host" and doc["backend"] == "host"
    comm.Barrier()


# ------------------------------------------------------------------------------------------------------
# ranks sharing a GPU: no NCCL baseline, said loudly, files of their own (stand-ins for the GPU parts)
# ------------------------------------------------------------------------------------------------------
SKIPPED = "skipped: ranks 0, 1 share a GPU (NCCL refuses two ranks on one GPU)"


def _fake_cupy(monkeypatch, bus_ids=None):
    """A stand-in for CuPy's runtime: the device name, the driver, this rank's PCI bus id."""
    rt = types.SimpleNamespace(getDeviceProperties=lambda d: {"name": b"NVIDIA H200"}, driverGetVersion=lambda: 13000,
                               getDevice=lambda: 0, deviceGetPCIBusId=lambda d: (bus_ids or {}).get(d, "0000:18:00.0"))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt)))


def test_nccl_baseline_is_skipped_where_ranks_share_a_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # NCCL must not even be imported
    assert harness.nccl_baseline(object(), [[0, 1]]) == (None, SKIPPED)
    nc, status = harness.nccl_baseline(object(), [[0, 1], [2, 3]])
    assert nc is None and status == ("skipped: ranks 0, 1 share a GPU; ranks 2, 3 share a GPU (NCCL refuses two "
                                     "ranks on one GPU)")
    assert harness.results_stem("bench_gpu_ep2", [[0, 1]]) == "bench_gpu_ep2_shared_gpu"
    assert harness.results_stem("bench_gpu_ep2", []) == "bench_gpu_ep2"
    line = harness.shared_gpu_warning("cupy_ep.bench", [[0, 1]], SKIPPED)
    assert "RANKS SHARE A GPU (ranks 0, 1 share a GPU)" in line and "not NVLink figures" in line and SKIPPED in line


@pytest.mark.mpi(min_size=2)
def test_shared_gpus_finds_the_ranks_on_one_gpu(comm, monkeypatch):
    """Every rank reports the same host and bus id (a stand-in runtime): they all share one GPU; with a bus id
    of its own per rank, none does."""
    _fake_cupy(monkeypatch)
    assert harness.shared_gpus(comm) == [list(range(comm.Get_size()))]
    _fake_cupy(monkeypatch, {0: f"0000:{comm.Get_rank():02x}:00.0"})
    assert harness.shared_gpus(comm) == []


def _shared_bench(out_dir):
    """A Bench as run() leaves it on two ranks sharing a GPU: NCCL skipped, records without NCCL times."""
    b = bench.Bench.__new__(bench.Bench)
    b.args = argparse.Namespace(tokens=4096, default_sms=24, hidden=7168, topk=8, experts=256, steady_n=10,
                                out=str(out_dir))
    b.R, b.rank, b.gpu = 2, 0, True
    b.buf = types.SimpleNamespace(backend="cuda")
    b.shared, b.nccl, b.nccl_status = [[0, 1]], None, SKIPPED
    b.ceiling = {"by_sms": {24: 300.0}, "gbps": 300.0, "by_sms_steady": {24: 310.0}, "gbps_steady": 310.0}
    b.startup = {}
    b.shapes, b.skipped, b.routing = [bench.models.MODELS["deepseek-v3"]], [], []
    b.jit_startup = b.jit_run = {"compiled": 0, "compile_s": 0.0, "disk_cache_hits": 0, "memory_cache_hits": 0}
    b.records = [bench.make_record(dict(BASE, op=op), _timings(), 14336, 2000, 1000,
                                   {"graph": 300.0, "steady": 310.0}, {}) for op in ("cached_dispatch", "combine")]
    return b


def test_shared_gpu_results_say_so_and_take_their_own_names(tmp_path, monkeypatch):
    _fake_cupy(monkeypatch)
    monkeypatch.setattr("subprocess.run", lambda *a, **k: (_ for _ in ()).throw(OSError("no nvidia-smi")))
    monkeypatch.setenv("CUPY_EP_COMMIT", "abc1234")
    b = _shared_bench(tmp_path)
    b.write()
    assert not (tmp_path / "bench_gpu_ep2.json").exists()  # the committed one-GPU-per-rank results' name
    doc = json.loads((tmp_path / "bench_gpu_ep2_shared_gpu.json").read_text())
    assert doc["nccl"] == SKIPPED and doc["shared_gpu_ranks"] == [[0, 1]]
    for rec in doc["results"]:
        for key in ("nccl_time_us", "ratio_to_nccl", "ratio_to_nccl_graph", "ratio_to_nccl_steady"):
            assert rec[key] is None, key
        assert rec["time_us_steady"] == 200.0  # every op still timed
    md = (tmp_path / "bench_gpu_ep2_shared_gpu.md").read_text()
    assert md.startswith("# cupy_ep benchmark (cuda, 2 ranks, NVIDIA H200, ranks sharing a GPU)")
    assert ("**Ranks share a GPU** (ranks 0, 1 share a GPU; e.g. as CUDA MPS clients): the timings are HBM copies "
            "through the shared GPU, not NVLink figures, and the copy ceiling is that of the shared GPU.") in md
    assert f"NCCL baseline {SKIPPED}" in md
    row = next(line for line in md.splitlines() if line.startswith("| cached_dispatch |"))
    assert row.endswith("| - / - / - | - / - / - |")  # NCCL us and ours/NCCL
    if (tmp_path / "bench_gpu_ep2_shared_gpu.png").exists():  # matplotlib installed
        assert (tmp_path / "bench_gpu_ep2_shared_gpu.png").stat().st_size > 0


def test_one_gpu_per_rank_results_keep_their_names(tmp_path, monkeypatch):
    _fake_cupy(monkeypatch)
    monkeypatch.setattr(bench, "plot", lambda doc, path: None)
    b = _shared_bench(tmp_path)
    b.shared, b.nccl_status = [], "measured"
    b.write()
    doc = json.loads((tmp_path / "bench_gpu_ep2.json").read_text())
    assert doc["nccl"] == "measured" and doc["shared_gpu_ranks"] == []
    assert "share a GPU" not in (tmp_path / "bench_gpu_ep2.md").read_text()


# ------------------------------------------------------------------------------------------------------
# low-latency mode: records, markdown, host overhead
# ------------------------------------------------------------------------------------------------------
class _FakeLLTimer:
    """Times by name: call 200, graph 40, steady 12 (NCCL: its function's own value); p99 = median + 1."""

    def __init__(self):
        self.calls = []
        self.steady_ns = []

    def _t(self, us):
        self.us = us
        return Timing(us, us - 1)

    def __call__(self, fn):
        self.calls.append(("call", fn))
        return self._t(fn("call"))

    def graph(self, fn, per_replay=1):
        self.calls.append(("graph", fn))
        self.per_replay = per_replay
        return self._t(fn("graph"))

    def aligned(self, fn, align, per_replay=1):
        self.calls.append(("aligned", fn))
        self.align = align
        return self._t(fn("aligned"))

    def steady(self, fn, n):
        self.calls.append(("steady", fn))
        self.steady_ns.append(n)
        return self._t(fn("steady"))

    def p99(self):
        return self.us + 1


def _ll_bench(steady_n=10, tokens=128):
    from mpi4py import MPI
    b = bench_ll.LowLatencyBench.__new__(bench_ll.LowLatencyBench)
    b.args = argparse.Namespace(tokens=tokens, hidden=7168, topk=8, experts=256, iters=200, steady_n=steady_n,
                                ll_token_sweep=[0, 128])
    b.comm, b.rank, b.R, b.M, b.gpu = MPI.COMM_SELF, 0, 2, tokens, True
    b.steady_n = bench_ll.even_steady_n(steady_n)
    b.records = []
    return b


def _ll_runs():
    ours = {"call": 200.0, "graph": 40.0, "aligned": 14.0, "steady": 12.0}
    theirs = {"graph": 48.0, "aligned": 33.0, "steady": 30.0}

    def op(how):
        return ours[how]

    def nccl(how):
        return theirs[how]
    return {"ll_dispatch": (op, nccl, "fp8"), "ll_combine": (op, nccl, "bf16"), "ll_combine_bf16p": (op, nccl, "bf16"),
            "ll_combine_logfmt": (op, nccl, "bf16")}


def test_even_steady_n():
    assert [bench_ll.even_steady_n(n) for n in (0, 1, 2, 9, 10)] == [0, 2, 2, 10, 10]


def test_ll_records_time_nccl_the_same_way():
    b, timer = _ll_bench(steady_n=9), _FakeLLTimer()
    b.nccl = argparse.Namespace(align=object())
    b.time_ops(timer, _ll_runs(), 128, ("call", "graph", "aligned", "steady"))
    assert set(timer.steady_ns) == {10}  # rounded up to even: two buffers alternate
    assert timer.align is b.nccl.align  # the aligned rows line the ranks up by NCCL
    by = {(r["op"], r.get("partials"), r["timing"]): r for r in b.records}
    assert len(by) == 16
    for op in (("ll_dispatch", None), ("ll_combine", "24-bit"), ("ll_combine", "bf16"), ("ll_combine", "logfmt")):
        call, graph, steady = by[op + ("call",)], by[op + ("graph",)], by[op + ("steady",)]
        assert (call["graph"], graph["graph"], steady["graph"]) == (False, True, True)
        assert (call["time_us_median"], graph["time_us_median"], steady["time_us_median"]) == (200.0, 40.0, 12.0)
        assert call["nccl_time_us"] == graph["nccl_time_us"] == 48.0 and call["nccl_timing"] == "graph"
        assert steady["nccl_time_us"] == 30.0 and steady["nccl_timing"] == "steady"
        assert steady["ratio_to_nccl"] == pytest.approx(12.0 / 30.0)
        assert steady["time_us_p99"] == 13.0 and steady["steady_n"] == 10 and call["steady_n"] is None
        aligned = by[op + ("aligned",)]
        assert aligned["graph"] and aligned["time_us_median"] == 14.0
        assert aligned["nccl_time_us"] == 33.0 and aligned["nccl_timing"] == "aligned"
        for r in (call, graph, aligned, steady):
            assert r["tokens"] == 128 and r["max_tokens"] == 128
    # NCCL graph-timed once per op (shared by call and graph rows), aligned once, steady once
    assert sum(1 for how, fn in timer.calls if fn.__name__ == "nccl") == 12


def test_ll_sweep_records_without_nccl():
    b, timer = _ll_bench(), _FakeLLTimer()
    b.time_ops(timer, _ll_runs(), 0, ("steady",), with_nccl=False)
    assert [(r["timing"], r["tokens"], r["max_tokens"], r["nccl_time_us"]) for r in b.records] == \
        [("steady", 0, 128, None)] * 4
    assert all(how == "steady" and fn.__name__ == "op" for how, fn in timer.calls)


def test_ll_without_nccl_runs_every_op_without_aligned_timing():
    """Ranks sharing a GPU: no NCCL functions (no NCCL bytes exchanged), no aligned rows, every op still timed."""
    b, timer = _ll_bench(), _FakeLLTimer()
    b.nccl = None
    assert b.main_timings() == ("call", "graph", "steady")
    b.nccl = argparse.Namespace(align=object())
    assert b.main_timings() == ("call", "graph", "aligned", "steady")
    b.nccl = None
    b.buf = types.SimpleNamespace(low_latency_dispatch=None, low_latency_combine=None)
    # (COMM_SELF with R = 2: an NCCL byte exchange would fail here)
    runs = b.ops(None, None, None, None, None, np.zeros((4, 8), dtype=np.int64))
    assert set(runs) == {"ll_dispatch", "ll_combine", "ll_combine_bf16p", "ll_combine_logfmt", "ll_round_trip"}
    assert all(nccl_fn is None for _, nccl_fn, _ in runs.values())
    b.time_ops(timer, {op: (lambda how: 12.0, None, dtype) for op, (_, _, dtype) in runs.items()}, 128,
               b.main_timings())
    assert sorted({r["timing"] for r in b.records}) == ["call", "graph", "steady"]
    assert len(b.records) == 15
    assert all(r["nccl_time_us"] is None and r["ratio_to_nccl"] is None and r["nccl_timing"] is None
               for r in b.records)


def test_ll_shared_gpu_report(tmp_path, monkeypatch):
    _fake_cupy(monkeypatch)
    monkeypatch.setenv("CUPY_EP_COMMIT", "abc1234")
    for transport, stem in (("nvshmem", "bench_ll_gpu_ep2_shared_gpu"), ("ipc", "bench_ll_gpu_ep2_ipc_shared_gpu")):
        b, timer = _ll_bench(), _FakeLLTimer()
        b.args.out, b.args.iters = str(tmp_path), 200
        b.transport, b.shared, b.nccl, b.nccl_status = transport, [[0, 1]], None, SKIPPED
        b.time_ops(timer, {"ll_dispatch": (lambda how: 12.0, None, "fp8")}, 128, b.main_timings())
        b.write()
        doc = json.loads((tmp_path / f"{stem}.json").read_text())
        assert doc["nccl"] == SKIPPED and doc["shared_gpu_ranks"] == [[0, 1]]
        assert doc["aligned"].startswith("skipped: it lines the ranks up by a one-int NCCL all-reduce")
        md = (tmp_path / f"{stem}.md").read_text()
        assert md.startswith("# cupy_ep low-latency benchmark (EP2, NVIDIA H200, ranks sharing a GPU)")
        assert "**Ranks share a GPU** (ranks 0, 1 share a GPU" in md and f"NCCL baseline {SKIPPED}" in md
        assert "The *aligned* rows are left out" in md
        assert "| ll_dispatch | fp8 | steady | 12.0 | 13.0 | - | - | - |" in md
        assert "| aligned |" not in md
    assert not (tmp_path / "bench_ll_gpu_ep2.json").exists()


def test_internode_shared_gpu_report(tmp_path, monkeypatch):
    from cupy_ep.tools import bench_internode
    _fake_cupy(monkeypatch)
    monkeypatch.setenv("CUPY_EP_COMMIT", "abc1234")
    b = bench_internode.InternodeBench.__new__(bench_internode.InternodeBench)
    b.args = argparse.Namespace(tokens=4096, hidden=7168, topk=8, experts=256, iters=20, out=str(tmp_path))
    b.R, b.N, b.G, b.sms, b.transport, b.shared = 2, 2, 1, 24, "ipc", [[0, 1]]
    b.records = [{"op": "internode_dispatch", "dtype": "bf16", "time_us_median": 100.0, "rdma_gbps": 50.0,
                  "nvl_gbps": 60.0, "rdma_ceiling_gbps": 100.0, "rdma_vs_ceiling": 0.5}]
    b.write()
    doc = json.loads((tmp_path / "bench_internode_ipc_ep2_shared_gpu.json").read_text())
    assert doc["shared_gpu_ranks"] == [[0, 1]]
    md = (tmp_path / "bench_internode_ipc_ep2_shared_gpu.md").read_text()
    assert "ranks sharing a GPU)" in md.splitlines()[0]
    assert "**Ranks share a GPU**" in md and "not network figures" in md


def _ll_plot_doc(b, backend="cuda", **about):
    """The document LowLatencyBench.write hands the plot (harness.write_report: the stamp, ``about``, results)."""
    return dict(commit="abc1234", gpu=None if backend == "host" else "NVIDIA H200", num_ranks=b.R, backend=backend,
                skipped=[], args=dict(vars(b.args)), results=b.records, **about)


def test_ll_plot_takes_graph_timing_where_measured_and_nccl_beside(tmp_path):
    """Per model shape and op the record at --tokens, graph-timed where measured (else the call, as on the host
    backend), NCCL's figure from the same record; the sweep's rows stay out. The plot is written, a host run's
    and a shared-GPU run's title say so."""
    b, timer = _ll_bench(), _FakeLLTimer()
    b.nccl = argparse.Namespace(align=object())
    for model, experts in (("deepseek-v3", 256), ("kimi-k3", 896)):
        b.args.model_name, b.args.experts = model, experts
        b.time_ops(timer, _ll_runs(), 128, ("call", "graph", "aligned", "steady"))
        b.time_ops(timer, _ll_runs(), 0, ("steady",), with_nccl=False)
    doc = _ll_plot_doc(b)
    rows = bench_ll.plot_rows(doc)
    assert list(rows) == ["deepseek-v3", "kimi-k3"]
    keys = {key for key, _ in bench_ll.PLOT_OPS}
    for model, by_op in rows.items():
        assert set(by_op) == keys - {("ll_round_trip", None)}  # (_ll_runs has no round trip)
        for r in by_op.values():
            assert (r["model"], r["timing"], r["tokens"], r["time_us_median"], r["nccl_time_us"]) == \
                (model, "graph", 128, 40.0, 48.0)
    assert bench_ll.plot_notes(doc) == []
    shared = dict(shared_gpu_ranks=[[0, 1]], nccl=SKIPPED)
    assert bench_ll.plot_notes(_ll_plot_doc(b, **shared)) == [
        "ranks 0, 1 share a GPU: HBM copies through the shared GPU, not NVLink figures; no NCCL baseline"]
    host, timer = _ll_bench(), _FakeLLTimer()
    host.time_ops(timer, {op: (fn, None, dtype) for op, (fn, _, dtype) in _ll_runs().items()}, 128, ("call",))
    host_doc = _ll_plot_doc(host, backend="host")
    assert [r["timing"] for r in bench_ll.plot_rows(host_doc)[None].values()] == ["call"] * 4
    assert bench_ll.plot_notes(host_doc) == ["host backend (numpy + MPI on the CPU): not GPU numbers"]
    pytest.importorskip("matplotlib")
    skipped = [{"model": "big", "experts": 64, "topk": 40, "hidden": 1024, "mode": "low-latency", "reason": "top-k"}]
    for name, d in (("gpu", dict(doc, skipped=skipped)), ("shared", _ll_plot_doc(b, **shared)), ("host", host_doc)):
        bench_ll.plot(d, tmp_path / f"{name}.png")
        assert (tmp_path / f"{name}.png").stat().st_size > 0


def test_ll_nccl_capture_failure_is_not_fatal():
    b, timer = _ll_bench(), _FakeLLTimer()

    def nccl(how):
        raise RuntimeError("capture not supported")
    b.time_ops(timer, {"ll_dispatch": (lambda how: 12.0, nccl, "fp8")}, 128, ("steady",))
    assert b.records[0]["nccl_time_us"] is None and b.records[0]["ratio_to_nccl"] is None


def test_host_us_per_call():
    from mpi4py import MPI
    calls, syncs = [], []
    host, wall = bench_ll.host_us_per_call(MPI.COMM_SELF, lambda: calls.append(1), 7, lambda: syncs.append(1))
    assert len(calls) == 7 and len(syncs) == 2
    assert 0 < host <= wall


def test_ll_markdown():
    b, timer = _ll_bench(), _FakeLLTimer()
    b.nccl = argparse.Namespace(align=object())
    b.time_ops(timer, _ll_runs(), 128, ("call", "graph", "aligned", "steady"))
    b.time_ops(timer, _ll_runs(), 0, ("steady",), with_nccl=False)
    for op, dtype in (("ll_dispatch", "fp8"), ("ll_combine", "bf16")):
        b.records.append({"op": op, "graph": False, "timing": "host", "host_us_per_call": 150.0,
                          "host_wall_us_per_call": 160.0, "calls": 200, "time_us_median": None, "dtype": dtype,
                          "tokens": 128, "max_tokens": 128})  # (an older record: no check_values field)
    b.records.append({"op": "ll_dispatch", "graph": False, "timing": "host", "host_us_per_call": 250.0,
                      "host_wall_us_per_call": 260.0, "check_values": True, "calls": 200, "time_us_median": None,
                      "dtype": "fp8", "tokens": 128, "max_tokens": 128})
    b.records.append({"op": "ll_dispatch", "graph": False, "timing": "stamps", "rounds": 30, "time_us_median": None,
                      "dtype": "fp8", "tokens": 128, "max_tokens": 128,
                      "phases_us": {"send_start": 0.0, "send_end": 9.5, "recv_end": 30.25},
                      "phases_max_us": {"send_start": 0.5, "send_end": 12.0, "recv_end": 31.0},
                      "phases_by_rank_us": [{"send_start": 0.0, "send_end": 9.5, "recv_end": 30.25},
                                            {"send_start": 1.5, "send_end": 11.0, "recv_end": 32.0}]})
    b.records.append(dict(b.records[-1], l2_flushed=True, phases_us={"send_start": 0.0, "send_end": 11.0},
                          phases_max_us=None, phases_by_rank_us=None))
    md = "\n".join(bench_ll.markdown_lines(b.records, b.args, 2, {"gpu": "NVIDIA H200", "commit": "abc1234"}))
    assert "| ll_dispatch | 128 | warm | median | 0.0 | 9.5 | 30.2 |" in md
    assert "| ll_dispatch | 128 | warm | slowest | 0.5 | 12.0 | 31.0 |" in md
    assert "| ll_dispatch | 128 | warm | rank 1 | 1.5 | 11.0 | 32.0 |" in md
    assert "| rank 0 |" not in md  # the median row is rank 0's
    assert "| ll_dispatch | 128 | flushed | median | 0.0 | 11.0 | - |" in md
    assert "| ll_dispatch | 128 | flushed | slowest |" not in md
    assert "| op | T | L2 | stat | send_start | send_end | recv_end |" in md
    assert "| ll_dispatch | fp8 | steady | 12.0 | 13.0 | 30.0 | steady | 0.40 |" in md
    assert "| ll_combine | bf16 | call | 200.0 | 201.0 | 48.0 | graph | 4.17 |" in md
    assert "| ll_combine (bf16 partials) | bf16 | steady | 12.0 | 13.0 | 30.0 | steady | 0.40 |" in md
    assert "T = 0 is the fixed cost" in md
    assert "| ll_dispatch | fp8 | 0 | 12.0 | 13.0 | - | - |" in md
    assert "| ll_combine | bf16 | 128 | 150.0 | 160.0 | False |" in md
    assert "| ll_dispatch | fp8 | 128 | 250.0 | 260.0 | True |" in md
    assert "*steady* = 10 ops back to back" in md
    assert "| ll_dispatch | fp8 | aligned | 14.0 | 15.0 | 33.0 | aligned | 0.42 |" in md
    assert "*aligned* = the same replays" in md


def test_git_commit_flags_a_tree_that_differs_from_head(tmp_path, monkeypatch):
    """A copy of the checkout with a stale .git (as on the GPU machine) must not pass for HEAD's code."""
    import shutil
    import subprocess
    from cupy_ep.tools.harness import git_commit as _git_commit
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    monkeypatch.delenv("CUPY_EP_COMMIT", raising=False)
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    def run(*a):
        return subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True, text=True)
    run("init", "-q")
    (tmp_path / "f.txt").write_text("one\n")
    run("add", "f.txt")
    run("commit", "-q", "-m", "one")
    head = run("rev-parse", "--short", "HEAD").stdout.strip()
    assert _git_commit(tmp_path) == head
    (tmp_path / "f.txt").write_text("two\n")
    assert _git_commit(tmp_path) == head + "+dirty"
    monkeypatch.setenv("CUPY_EP_COMMIT", "abc1234")
    assert _git_commit(tmp_path) == "abc1234"


def test_ll_host_overhead_measures_with_and_without_value_checks(monkeypatch):
    """One record per op and check_values setting; the Buffer's flag is what each call sees, and it is left False
    (the benchmark's setting) afterwards, also when a call raises."""
    b = _ll_bench()
    seen = []

    class Buf:
        check_values = False
    b.buf = Buf()
    monkeypatch.setattr(bench_ll, "host_us_per_call", lambda comm, fn, calls, sync: (fn(), (10.0, 11.0))[1])
    monkeypatch.setattr(bench_ll, "HOST_CALLS", 3)
    cupy_stub = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(
        deviceSynchronize=lambda: None)))
    monkeypatch.setitem(sys.modules, "cupy", cupy_stub)
    runs = {"ll_dispatch": (lambda: seen.append(("d", b.buf.check_values)), None, "fp8"),
            "ll_combine": (lambda: seen.append(("c", b.buf.check_values)), None, "bf16")}
    b.host_overhead(runs, 128)
    assert seen == [("d", False), ("c", False), ("d", True), ("c", True)]
    assert [(r["op"], r["check_values"]) for r in b.records] == [
        ("ll_dispatch", False), ("ll_combine", False), ("ll_dispatch", True), ("ll_combine", True)]
    assert b.buf.check_values is False

    def boom():
        raise RuntimeError("call failed")
    b.buf.check_values = False
    with pytest.raises(RuntimeError):
        b.host_overhead({"ll_dispatch": (boom, None, "fp8")}, 128)
    assert b.buf.check_values is False


def test_shared_gpu_ranks_groups_ranks_on_one_gpu():
    gpus = [("a", "0000:18"), ("a", "0000:18"), ("a", "0000:2a"), ("b", "0000:18"), ("a", "0000:2a")]
    assert harness.shared_gpu_ranks(gpus) == [[0, 1], [2, 4]]  # host b's GPU 0000:18 is another GPU
    assert harness.shared_gpu_ranks([("a", "0"), ("a", "1")]) == []


# ------------------------------------------------------------------------------------------------------
# model shapes, routings, bytes, the round trip, kernel counters (host backend)
# ------------------------------------------------------------------------------------------------------
def test_presets_and_their_limits():
    from cupy_ep.config import MAX_TOPK
    from cupy_ep.reference import LOW_LATENCY_MAX_TOPK
    from cupy_ep.tools import cli, models
    assert [(s.experts, s.topk, s.hidden) for s in models.MODELS.values()] == [
        (256, 8, 7168), (256, 6, 4096), (384, 6, 7168), (896, 16, 3584), (512, 22, 1024), (128, 8, 4096)]
    args = cli.parse_args(["--model", "kimi-k3"])
    assert (args.experts, args.topk, args.hidden) == (896, 16, 3584) and args.shapes[0].name == "kimi-k3"
    assert cli.parse_args([]).shapes == [models.MODELS["deepseek-v3"]]
    assert [s.name for s in cli.parse_args(["--model", "all"]).shapes] == list(models.MODELS)
    custom = cli.parse_args(["--hidden", "1024"]).shapes
    assert custom == [models.Shape("custom", 256, 8, 1024)]
    for name in models.MODELS:
        shape = models.MODELS[name]
        ll = models.skip_reason(shape, "low-latency", 8)
        assert (ll is None) == (shape.topk <= LOW_LATENCY_MAX_TOPK), (name, ll)
        if ll is not None:
            assert f"top-{shape.topk} is above the low-latency kernels' limit of {LOW_LATENCY_MAX_TOPK}" in ll
        assert (models.skip_reason(shape, "normal", 8) is None) == (shape.topk <= MAX_TOPK)
    assert models.skip_reason(models.MODELS["deepseek-v4-pro"], "normal", 5) == \
        "384 experts do not split evenly over 5 ranks"
    # every preset runs in every mode at the ranks the tests use
    for shape in models.MODELS.values():
        for mode in ("normal", "low-latency", "internode"):
            assert [models.skip_reason(shape, mode, r) for r in (1, 2, 4, 8)] == [None] * 4, (shape, mode)
    assert models.skip_reason(models.Shape("wide", 64, 33, 1024), "low-latency", 2) == \
        f"top-33 is above the low-latency kernels' limit of {LOW_LATENCY_MAX_TOPK} experts per token"


@pytest.mark.parametrize("argv,message", [
    (["--model", "gpt-9"], "argument --model: unknown model 'gpt-9'"),
    (["--routing", "zipf:0"], "argument --routing: zipf:S needs S > 0, got 0"),
    (["--routing", "hot-expert:1.5"], "argument --routing: hot-expert:F needs F in [0, 1], got 1.5"),
    (["--routing", "skewed"], "argument --routing: expected uniform, zipf:S or hot-expert:F, got 'skewed'")])
def test_model_and_routing_refused(capsys, argv, message):
    from cupy_ep.tools import cli
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv, rank=0)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_routings():
    from cupy_ep import reference
    T, K, E, R = 2000, 8, 64, 4
    # uniform: the distinct top-K of one uniform score per expert
    rng = np.random.default_rng(3)
    want = np.argsort(-np.random.default_rng(3).random((T, E), dtype=np.float32), axis=1)[:, :K]
    assert np.array_equal(harness.make_routing(rng, T, K, E, R, 0.0), want)
    hot = harness.make_routing(np.random.default_rng(3), T, K, E, R, 0.0, "hot-expert:1")
    assert np.all((hot == harness.HOT_EXPERT).any(axis=1))
    half = harness.make_routing(np.random.default_rng(3), T, K, E, R, 0.0, "hot-expert:0.5")
    assert 0.5 < (half == harness.HOT_EXPERT).any(axis=1).mean() < 0.6  # half the tokens, plus uniform picks
    for routing in ("uniform", "zipf:1.5", "hot-expert:0.5"):
        idx = harness.make_routing(np.random.default_rng(3), T, K, E, R, 0.0, routing, seed=11)
        assert idx.shape == (T, K) and idx.dtype == np.int64
        assert all(len(set(row)) == K for row in idx)  # distinct experts per token
    loads = {r: harness.busiest_load(harness.rank_loads(
        [harness.make_routing(np.random.default_rng(s), T, K, E, R, 0.0, r, seed=11) for s in range(R)], E, R))
        for r in ("uniform", "zipf:1.5")}
    assert loads["uniform"] < 1.05 < loads["zipf:1.5"]
    # skew: a skewed token's experts all on rank 0
    skewed = harness.make_routing(np.random.default_rng(3), T, 4, E, R, 1.0, "zipf:1.5")
    assert np.all(skewed < E // R)
    itr = reference.token_rank_matrix(half, E, R)
    assert harness.rank_loads([half], E, R).tolist() == itr.sum(axis=0).tolist()
    assert harness.busiest_load([0, 0]) is None and harness.busiest_load([1, 3]) == 1.5


def test_low_latency_bytes_by_hand():
    per_rank = np.array([3, 5])  # selections bound for rank 0 and rank 1, from rank 0
    got = bench_ll.op_bytes(per_rank, 0, 256)
    fp8, bf16 = 256 + 2 * 4 + 16, 512
    assert got["ll_dispatch"] == (8 * fp8, 5 * fp8)
    assert got["ll_combine"] == got["ll_combine_logfmt"] == (8 * bf16, 5 * bf16)
    assert got["ll_round_trip"] == (16 * bf16, 10 * bf16)


def test_low_latency_skips_shapes_beyond_its_limits(capsys):
    """Every shape beyond the low-latency kernels' limits (top-k, hidden unit): each is named as skipped with the
    reason, no buffer is made, nothing raises."""
    from mpi4py import MPI
    from cupy_ep.reference import LOW_LATENCY_MAX_TOPK
    from cupy_ep.tools import cli, models
    args = cli.parse_args(["--mode", "low-latency"], gpu=True)
    args.shapes = [models.Shape("wide-topk", 64, LOW_LATENCY_MAX_TOPK + 1, 1024),
                   models.Shape("odd-hidden", 64, 8, 1000)]
    bench_ll.main(args, MPI.COMM_SELF)
    out = capsys.readouterr().out
    assert (f"SKIPPED wide-topk: top-{LOW_LATENCY_MAX_TOPK + 1} is above the low-latency kernels' limit of "
            f"{LOW_LATENCY_MAX_TOPK}") in out
    assert "SKIPPED odd-hidden: hidden 1000 is not a multiple of 128 (low-latency mode)" in out
    assert "no model shape to run" in out


def test_jit_counters_count_compiles_and_cache_hits(tmp_path, monkeypatch):
    from cupy_ep import jit
    compiled = []

    def fake_compile(filename, names, arch, extra_options=()):
        compiled.append(names)
        return types.SimpleNamespace(cubin=b"cubin", mapping={names[0]: "lowered_" + names[0]})
    monkeypatch.setattr(jit, "compile_cubin", fake_compile)
    monkeypatch.setattr(jit, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(jit, "_cache_key", lambda filename, name, arch, extra: f"{filename}-{name}")
    before = jit.counters()
    assert jit._load_or_compile("a.cu", "k<1>", "sm_90", ()) == (b"cubin", "lowered_k<1>")   # cold
    assert jit._load_or_compile("a.cu", "k<2>", "sm_90", ()) == (b"cubin", "lowered_k<2>")   # cold
    assert jit._load_or_compile("a.cu", "k<1>", "sm_90", ()) == (b"cubin", "lowered_k<1>")   # warm
    after = jit.counters()
    assert after["compiled"] - before["compiled"] == 2 == len(compiled)
    assert after["disk_cache_hits"] - before["disk_cache_hits"] == 1
    assert after["compile_s"] >= before["compile_s"]
    assert bench.jit_delta(before)["compiled"] == 2


def _routing_reference(comm, args_tokens, shape, routing, seed, skew=0.0):
    """Every rank's top-k of the benchmark's inputs, rebuilt in numpy."""
    R = comm.Get_size()
    return [harness.make_inputs(r, R, args_tokens, shape.hidden, shape.topk, shape.experts, skew, seed, routing)[2]
            for r in range(R)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("routing", ["uniform", "zipf:1.2", "hot-expert:0.5"])
def test_host_run_of_every_preset(comm, tmp_path, routing):
    """Every preset on the host backend: each runs (normal mode fits them all), its busiest-rank load and its
    bytes equal what numpy gives for the same seed, the round trip moves both halves' bytes, and the report
    has a table per model shape."""
    from cupy_ep import reference
    from cupy_ep.tools import models
    out = comm.bcast(tmp_path if comm.Get_rank() == 0 else None)
    R = comm.Get_size()
    bench.main(["--backend", "host", "--model", "all", "--routing", routing, "--seed", "5", "--tokens", "12",
                "--iters", "1", "--warmup", "0", "--out", str(out)])
    if comm.Get_rank():
        return
    doc = json.loads((out / f"bench_host_ep{R}.json").read_text())
    assert [m["name"] for m in doc["models"]] == list(models.MODELS) and doc["skipped"] == []
    assert doc["jit"]["run"]["compiled"] == 0  # the host backend compiles nothing
    md = (out / f"bench_host_ep{R}.md").read_text()
    assert md.startswith("# cupy_ep benchmark: host-backend results")
    for shape in models.MODELS.values():
        idx = _routing_reference(comm, 12, shape, routing, 5)
        loads = harness.rank_loads(idx, shape.experts, R)
        (entry,) = [r for r in doc["routing"] if r["model"] == shape.name]
        assert entry["recv_tokens_per_rank"] == loads.tolist()
        assert entry["busiest_rank_load"] == pytest.approx(loads.max() / loads.mean())
        assert f"## {shape.name}: {shape.experts} experts, top-{shape.topk}, hidden {shape.hidden}" in md
        recs = {(r["op"], r["dtype"], r["zero_copy"]): r for r in doc["results"] if r["model"] == shape.name}
        itr = [reference.token_rank_matrix(i, shape.experts, R) for i in idx]
        received = sum(int(m[:, 0].sum()) for m in itr)             # rank 0's rows, its own included
        from_peers = received - int(itr[0][:, 0].sum())
        sent_out = int(itr[0].sum()) - int(itr[0][:, 0].sum())       # rank 0's rows to the other ranks
        row, row8 = 2 * shape.hidden, shape.hidden + 4 * (-(-shape.hidden // 128))
        assert (recs["dispatch", "bf16", False]["logical_bytes"], recs["dispatch", "bf16", False]["nvlink_bytes"]) \
            == (received * row, sent_out * row)
        assert recs["cached_dispatch", "fp8", False]["logical_bytes"] == received * row8
        assert (recs["combine", "bf16", False]["logical_bytes"], recs["combine", "bf16", False]["nvlink_bytes"]) \
            == (received * row, from_peers * row)
        trip = recs["round_trip", "bf16", False]
        assert (trip["logical_bytes"], trip["nvlink_bytes"]) == (2 * received * row, (sent_out + from_peers) * row)
        assert trip["busiest_rank_load"] == entry["busiest_rank_load"] and trip["routing"] == routing
        assert trip["kernel_time_us"] is None and trip["time_us_median"] > 0  # host: the call only
        assert trip["logical_gbps"] == pytest.approx(trip["logical_bytes"] / (trip["time_us_median"] * 1e3))


@pytest.mark.mpi(min_size=2)
def test_host_run_of_low_latency_presets(comm, tmp_path):
    """--mode low-latency on the host backend: presets run (verified, call-timed, their bytes and busiest-rank load
    what numpy gives), top-16 (kimi-k3) too."""
    from cupy_ep.tools import models
    out = comm.bcast(tmp_path if comm.Get_rank() == 0 else None)
    R = comm.Get_size()
    bench.main(["--mode", "low-latency", "--backend", "host", "--model", "deepseek-v4-flash,kimi-k3", "--routing",
                "zipf:1.1", "--seed", "9", "--tokens", "6", "--iters", "1", "--warmup", "0", "--out", str(out)])
    if comm.Get_rank():
        return
    shape = models.MODELS["deepseek-v4-flash"]
    doc = json.loads((out / f"bench_ll_host_ep{R}.json").read_text())
    assert doc["backend"] == "host" and doc["gpu"] is None
    assert doc["skipped"] == []
    assert {r["model"] for r in doc["results"]} == {"deepseek-v4-flash", "kimi-k3"}
    recs = {r["op"] + (f"/{r['partials']}" if r.get("partials") else ""): r for r in doc["results"]
            if r["model"] == "deepseek-v4-flash"}
    assert set(recs) == {"ll_dispatch", "ll_combine/24-bit", "ll_combine/bf16", "ll_combine/logfmt", "ll_round_trip"}
    idx = []
    for r in range(R):  # the benchmark's inputs: x first, then the routing, from seed + rank
        rng = np.random.default_rng(9 + r)
        rng.standard_normal((6, shape.hidden), dtype=np.float32)
        idx.append(harness.make_routing(rng, 6, shape.topk, shape.experts, R, 0.0, "zipf:1.1", 9))
    loads = harness.rank_loads(idx, shape.experts, R)
    per_rank = np.bincount(idx[0].ravel() // (shape.experts // R), minlength=R)  # rank 0's selections per rank
    want = bench_ll.op_bytes(per_rank, 0, shape.hidden)
    for op, rec in recs.items():
        assert rec["model"] == "deepseek-v4-flash" and rec["timing"] == "call" and rec["time_us_median"] > 0
        assert rec["recv_tokens_per_rank"] == loads.tolist()
        assert rec["busiest_rank_load"] == pytest.approx(loads.max() / loads.mean())
        assert (rec["logical_bytes"], rec["nvlink_bytes"]) == want[op.split("/")[0]]
    md = (out / f"bench_ll_host_ep{R}.md").read_text()
    assert md.startswith("# cupy_ep low-latency benchmark: host-backend results")
    assert "## deepseek-v4-flash: 256 experts, top-6, hidden 4096" in md
    assert "## kimi-k3: 896 experts, top-16, hidden 3584" in md and "**Skipped**" not in md
    assert "| ll_round_trip | bf16 | call |" in md
    # each shape's run: its wall time and its kernel counters (the host backend compiles none)
    assert [r["model"] for r in doc["shape_runs"]] == ["deepseek-v4-flash", "kimi-k3"]
    for run in doc["shape_runs"]:
        assert run["wall_s"] > 0 and run["jit"]["compiled"] == 0
        assert f"| {run['model']} | {run['wall_s']:.1f} | 0 compiled in 0.00 s" in md
    # the plot of each shape's ops, as a normal-mode run's (where matplotlib is installed)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / f"bench_ll_host_ep{R}.png").stat().st_size > 0
