"""The tools under torchrun: ``python -m torch.distributed.run --standalone --nproc-per-node 2 -m cupy_ep.bench``
(normal and low-latency), ``-m cupy_ep.soak`` (both modes) and ``-m cupy_ep.tune`` on the host backend, with tiny
sizes. Each must run as under mpiexec (the same lines and files, printed and written by rank 0 once; the
same routing and checks, which depend on the seed only) and never import ``mpi4py.MPI``: a ``sitecustomize`` in
the children refuses that import and leaves a marker file when anything asks for it.

Single-process tests: each starts its own launcher (torchrun, and mpiexec for the comparison where one is on PATH).
The benchmark's NCCL baseline, which only a GPU runs, is checked here for the part a CPU can see: where a rank
cannot use it, every rank skips it alike.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# launcher variables of this test's own process (a test started under a launcher would hand its rank to the children)
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "CUPY_EP_BOOTSTRAP")
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "OMPI_COMM_WORLD", "OMPI_MCA_", "MPI_LOCAL", "MV2_", "SLURM_")
TIMEOUT_S = 240

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


def child_env(tmp_path: Path) -> tuple[dict, Path]:
    """The children's environment (host backend, no launcher variables of this process, the worktree first on
    PYTHONPATH, a ``sitecustomize`` that refuses ``mpi4py.MPI``) and the marker file it writes on such an
    import."""
    site, marker = tmp_path / "site", tmp_path / "mpi_imported"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import os, sys

        class _RefuseMPI:
            def find_spec(self, name, path=None, target=None):
                if name == "mpi4py.MPI":
                    with open({str(marker)!r}, "a") as f:
                        f.write(f"rank {{os.environ.get('RANK')}}: {{sys.argv}}\\n")
                    raise ModuleNotFoundError("mpi4py.MPI is refused under torchrun by the test", name=name)
                return None

        if "TORCHELASTIC_RUN_ID" in os.environ:  # the torchrun children only, not the mpiexec comparison
            sys.meta_path.insert(0, _RefuseMPI())
    """))
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith(_LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(REPO), os.environ.get("PYTHONPATH")) if p)
    env.update(CUPY_EP_BACKEND="host", OMP_NUM_THREADS="1", CUPY_EP_COMMIT="test")
    return env, marker


def torchrun(tmp_path: Path, tool: str, argv, nproc: int = 2) -> tuple[subprocess.CompletedProcess, str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node nproc -m cupy_ep.<tool> argv`` in
    ``tmp_path``; returns the finished process and its stdout + stderr. Fails the test when ``mpi4py.MPI`` was
    asked for."""
    env, marker = child_env(tmp_path)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), "-m", f"cupy_ep.{tool}", *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    text = done.stdout + done.stderr
    assert not marker.exists(), f"mpi4py.MPI imported under torchrun:\n{marker.read_text()}\n{text}"
    return done, text


def mpiexec(tmp_path: Path, tool: str, argv, nproc: int = 2) -> tuple[subprocess.CompletedProcess, str] | None:
    """The same tool under ``mpiexec -n nproc`` (None where no launcher or mpi4py is here)."""
    launcher = shutil.which("mpiexec") or shutil.which("mpirun")
    if launcher is None or importlib.util.find_spec("mpi4py") is None:
        return None
    env, _ = child_env(tmp_path)
    done = subprocess.run([launcher, "-n", str(nproc), sys.executable, "-m", f"cupy_ep.{tool}", *argv], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    return done, done.stdout + done.stderr


def lines_with(text: str, start: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(start)]


def check_ok(done, text: str) -> None:
    assert done.returncode == 0, text


BENCH = ["--backend", "host", "--tokens", "16", "--hidden", "128", "--experts", "8", "--topk", "2", "--iters", "1",
         "--warmup", "0", "--sms", "4", "--seed", "11"]
BENCH_LL = ["--mode", "low-latency", "--backend", "host", "--model", "deepseek-v4-flash", "--tokens", "6", "--iters",
            "1", "--warmup", "0", "--seed", "11"]


def _bench_doc(folder: Path, stem: str) -> tuple[dict, str]:
    names = sorted(p.name for p in folder.iterdir())
    # one set of files (rank 0's): the same as an MPI run, the plot where matplotlib is installed
    assert names in ([f"{stem}.json", f"{stem}.md"], [f"{stem}.json", f"{stem}.md", f"{stem}.png"]), names
    return json.loads((folder / f"{stem}.json").read_text()), (folder / f"{stem}.md").read_text()


def _launch_independent(doc: dict) -> dict:
    """What a run computes whatever launched it: the ranks, the routing and every record's op, shape and bytes."""
    keys = ("op", "dtype", "num_sms", "tokens", "model", "zero_copy", "partials", "logical_bytes", "nvlink_bytes")
    return {"num_ranks": doc["num_ranks"], "backend": doc["backend"], "nccl": doc["nccl"], "routing": doc["routing"],
            "records": sorted(tuple(str(r.get(k)) for k in keys) for r in doc["results"])}


@needs_torch
def test_bench_under_torchrun_is_the_mpi_run(tmp_path):
    """``-m cupy_ep.bench`` under torchrun: rank 0 alone prints and writes the host results, the world started by
    torch.distributed (``startup.mpi_start``), NCCL said to be absent, every op verified; the records, bytes and
    routing equal an mpiexec run's of the same arguments."""
    tr = tmp_path / "torchrun"
    tr.mkdir()
    done, text = torchrun(tr, "bench", BENCH + ["--out", str(tr / "res")])
    check_ok(done, text)
    assert len(lines_with(text, "cupy_ep.bench: backend=host ranks=2 tokens=16")) == 1, text
    assert len(lines_with(text, "  verified against cupy_ep.reference: dispatch bf16/fp8")) == 1, text
    assert len(lines_with(text, "  warm start (s; world start torchrun)")) == 1, text
    assert lines_with(text, "cupy_ep.bench: wrote ") == [f"cupy_ep.bench: wrote {tr / 'res'}/bench_host_ep2."
                                                         + ("json/.md/.png" if (tr / "res" / "bench_host_ep2.png")
                                                            .exists() else "json/.md")], text
    doc, md = _bench_doc(tr / "res", "bench_host_ep2")
    assert doc["startup"]["mpi_start"] == "torchrun" and doc["num_ranks"] == 2 and doc["backend"] == "host"
    assert doc["nccl"] == "not measured: the host backend has no NCCL" and doc["gpu"] is None
    assert md.startswith("# cupy_ep benchmark: host-backend results")
    assert {r["op"] for r in doc["results"]} == {"layout", "dispatch", "cached_dispatch", "combine", "round_trip"}
    assert all(r["time_us_median"] > 0 for r in doc["results"])
    mp = tmp_path / "mpi"
    mp.mkdir()
    ran = mpiexec(mp, "bench", BENCH + ["--out", str(mp / "res")])
    if ran is None:
        pytest.skip("no mpiexec or mpi4py here: the torchrun run alone was checked")
    check_ok(*ran)
    mpi_doc, _ = _bench_doc(mp / "res", "bench_host_ep2")
    assert mpi_doc["startup"]["mpi_start"] in ("overlapped", "mpi4py", "ctypes")
    assert _launch_independent(doc) == _launch_independent(mpi_doc)


@needs_torch
def test_bench_low_latency_under_torchrun_is_the_mpi_run(tmp_path):
    """``-m cupy_ep.bench --mode low-latency`` under torchrun: verified, one report from rank 0, the same records,
    bytes and routing as under mpiexec."""
    tr = tmp_path / "torchrun"
    tr.mkdir()
    done, text = torchrun(tr, "bench", BENCH_LL + ["--out", str(tr / "res")])
    check_ok(done, text)
    assert len(lines_with(text, "cupy_ep.bench --mode low-latency: backend=host ranks=2 tokens=6")) == 1, text
    assert len(lines_with(text, "  verified against cupy_ep.reference: low-latency dispatch")) == 1, text
    assert len(lines_with(text, "cupy_ep.bench --mode low-latency: wrote ")) == 1, text
    doc, md = _bench_doc(tr / "res", "bench_ll_host_ep2")
    assert doc["backend"] == "host" and doc["gpu"] is None and doc["skipped"] == []
    assert md.startswith("# cupy_ep low-latency benchmark: host-backend results")
    assert {r["op"] for r in doc["results"]} == {"ll_dispatch", "ll_combine", "ll_round_trip"}
    mp = tmp_path / "mpi"
    mp.mkdir()
    ran = mpiexec(mp, "bench", BENCH_LL + ["--out", str(mp / "res")])
    if ran is None:
        pytest.skip("no mpiexec or mpi4py here: the torchrun run alone was checked")
    check_ok(*ran)
    mpi_doc, _ = _bench_doc(mp / "res", "bench_ll_host_ep2")
    keys = ("op", "dtype", "partials", "timing", "tokens", "model", "recv_tokens_per_rank", "logical_bytes",
            "nvlink_bytes")
    assert sorted(tuple(str(r.get(k)) for k in keys) for r in doc["results"]) == \
        sorted(tuple(str(r.get(k)) for k in keys) for r in mpi_doc["results"])
    assert (doc["num_ranks"], doc["transport"], doc["nccl"]) == (mpi_doc["num_ranks"], mpi_doc["transport"],
                                                                 mpi_doc["nccl"])


@needs_torch
@pytest.mark.parametrize("mode, argv, summary", [
    ("normal", ["--iters", "6", "--check-every", "2", "--max-tokens", "32"],
     "cupy_ep.soak: 6 iterations from 0 (seed 7, backend host, 2 ranks): 0 mismatches, "),
    ("low-latency", ["--mode", "low-latency", "--iters", "4", "--check-every", "1", "--max-tokens", "8",
                     "--hiddens", "128"],
     "cupy_ep.soak --mode low-latency: 4 iterations from 0 (seed 7, backend host, 2 ranks, M=8): 0 mismatches, ")])
def test_soak_under_torchrun_is_the_mpi_run(tmp_path, mode, argv, summary):
    """``-m cupy_ep.soak`` (both modes) under torchrun: no mismatch, one summary line from rank 0, the same line
    (the same iterations compared with the reference) as under mpiexec."""
    argv = argv + ["--seed", "7", "--backend", "host"]
    done, text = torchrun(tmp_path, "soak", argv)
    check_ok(done, text)
    (line,) = lines_with(text, summary)
    assert line.endswith(" compared with the reference") and " 0 compared" not in line
    ran = mpiexec(tmp_path, "soak", argv)
    if ran is None:
        pytest.skip("no mpiexec or mpi4py here: the torchrun run alone was checked")
    check_ok(*ran)
    assert lines_with(ran[1], summary) == [line]


@needs_torch
def test_soak_mismatch_under_torchrun_stops_every_rank(tmp_path):
    """A corrupted reference under torchrun: every rank stops with exit status 1 (torchrun's own is non-zero) and
    rank 0 alone prints the mismatch and the replay command."""
    site = tmp_path / "corrupt"
    site.mkdir()
    # run the soak with reference.combine off by one bf16 ulp in its first value (the test_soak.py corruption)
    (site / "corrupt_soak.py").write_text(textwrap.dedent("""
        import sys
        import numpy as np
        from cupy_ep import reference
        from cupy_ep.tools import soak

        real = reference.combine

        def off_by_one_ulp(*args, **kwargs):
            out, w = real(*args, **kwargs)
            bits = out.view(np.uint16).copy()
            if bits.size:
                bits.flat[0] ^= 1
            return bits.view(reference.bfloat16), w

        reference.combine = off_by_one_ulp
        sys.exit(soak.main(sys.argv[1:]))
    """))
    env, marker = child_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join((str(site), env["PYTHONPATH"]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "corrupt_soak", "--iters", "3", "--check-every", "1", "--max-tokens", "64",
                           "--backend", "host", "--seed", "5"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    text = done.stdout + done.stderr
    assert not marker.exists(), text
    assert done.returncode != 0, text
    assert len(lines_with(text, "MISMATCH at iteration 0 (seed 5")) == 1, text
    assert lines_with(text, "replay: ") == ["replay: python -m cupy_ep.soak --seed 5 --start 0 --iters 1"], text
    assert "exitcode  : 1" in text, text  # torchrun's report of a rank's own exit status


@needs_torch
def test_tune_under_torchrun_without_a_gpu_is_one_error(tmp_path):
    """``-m cupy_ep.tune`` under torchrun on a machine without a GPU: the one argparse error, printed once (rank
    0), exit status 2 as under mpiexec; no file written."""
    from cupy_ep import gpu_available
    if gpu_available():
        pytest.skip("a GPU is visible: tune would run its sweep")
    out = tmp_path / "tuned.json"
    done, text = torchrun(tmp_path, "tune", ["--iters", "1", "--out", str(out)])
    assert done.returncode != 0, text
    assert "exitcode  : 2" in text, text
    error = "python -m cupy_ep.tune: error: cupy_ep.tune times the GPU kernels, and this rank sees no GPU"
    assert lines_with(text, "python -m cupy_ep.tune: error:") == [error], text
    assert not out.exists()


@needs_torch
def test_help_under_torchrun_prints_once(tmp_path):
    """``--help`` under torchrun: parsed before the world starts, printed by rank 0 only (RANK), exit status 0."""
    done, text = torchrun(tmp_path, "bench", ["--help"])
    check_ok(done, text)
    assert len(lines_with(text, "usage: python -m cupy_ep.bench")) == 1, text


# ------------------------------------------------------------------------------------------------------
# the NCCL baseline: its own cupy.cuda.nccl communicator under either launcher, skipped alike on every rank
# ------------------------------------------------------------------------------------------------------
class _GatherComm:
    """A stand-in communicator whose allgather returns what each rank gave (``values``, this rank's slot
    replaced by its own)."""

    def __init__(self, rank, values):
        self.rank, self.values = rank, values

    def allgather(self, mine):
        return [mine if r == self.rank else v for r, v in enumerate(self.values)]


def test_nccl_baseline_without_nccl_on_one_rank_is_skipped_on_all(monkeypatch):
    """One rank's CuPy without NCCL: every rank gets (None, the same skip naming that rank), so none waits in the
    baseline's unique-id broadcast for a rank that skipped it."""
    from cupy_ep.tools import harness
    monkeypatch.setattr(harness, "nccl_unavailable", lambda: None)
    got = harness.nccl_baseline(_GatherComm(0, [None, "no libnccl"]), [])
    assert got == (None, "skipped: CuPy has no usable NCCL (no libnccl; rank 1)")
    monkeypatch.setattr(harness, "nccl_unavailable", lambda: "no libnccl")
    assert harness.nccl_baseline(_GatherComm(1, [None, None]), []) == got
    # ranks sharing a GPU are named first, as before (no collective needed: every rank knows the groups)
    assert harness.nccl_baseline(object(), [[0, 1]])[1].startswith("skipped: ranks 0, 1 share a GPU")


def test_nccl_unavailable_reads_cupys_flag(monkeypatch):
    """CuPy's nccl module imports without libnccl and says so in ``available``; the reason names the fix."""
    from cupy_ep.tools import harness
    nccl = types.ModuleType("cupy.cuda.nccl")
    cuda = types.ModuleType("cupy.cuda")
    cupy = types.ModuleType("cupy")
    cuda.nccl, cupy.cuda = nccl, cuda
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    nccl.available = False
    assert "cupy.cuda.nccl.available is False" in harness.nccl_unavailable()
    nccl.available = True
    assert harness.nccl_unavailable() is None
