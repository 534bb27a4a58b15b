"""The command lines of ``python -m cupy_ep.bench``, ``.soak`` and ``.tune`` and of ``scripts/bench.sh``: every option's
help states its default, ``--help`` works without the optional packages (and without MPI or CuPy), a bad value is
one argparse error (exit status 2) printed by one rank, also under mpiexec, and errors found once MPI is up (the
rank count, a missing GPU) end every rank the same way.

The subprocess tests run the real commands; their environment drops the launcher's variables of the test's own
process (a test under mpiexec would otherwise start its children as "rank 1", which prints nothing).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cupy_ep.tools import cli, soak, tune

REPO = Path(__file__).resolve().parents[2]
TOOLS = {"bench": cli, "soak": soak, "tune": tune}
# what --help must do without: the optional packages, MPI and CuPy (parsing comes before MPI starts)
BLOCKED = ("matplotlib", "tqdm", "torch", "mpi4py", "cupy", "cupyx")
# the benchmark's --help needs nothing but the interpreter: scripts/bench.sh --help may run a python on PATH that
# lacks the package's dependencies
BLOCKED_FOR_BENCH = BLOCKED + ("numpy", "ml_dtypes")
# (tool, argv, what its one error line says)
BAD_VALUES = [
    ("bench", ["--tokens", "-3"], "argument --tokens: must be >= 1, got -3"),
    ("bench", ["--sms", "x"], "argument --sms: not an int: 'x'"),
    ("bench", ["--sms", "8,5"], "argument --sms: an SM count must be an even number >= 4, got 5 (in '8,5')"),
    ("bench", ["--skew", "2"], "argument --skew: must be in [0, 1], got 2.0"),
    ("bench", ["--mode", "low-latency", "--tokens", "300", "--ll-max-tokens", "256"],
     "argument --tokens: --tokens 300 is above --ll-max-tokens 256"),
    ("soak", ["--check-every", "0"], "argument --check-every: must be >= 1, got 0"),
    ("soak", ["--num-sms", "7"], "argument --num-sms: an SM count must be an even number >= 4, got 7"),
    ("soak", ["--mode", "low-latency", "--hiddens", "100"],
     "argument --hiddens: hidden sizes must be positive multiples of 128, got '100'"),
    ("tune", ["--sms", "x"], "argument --sms: not an int: 'x'"),
    ("tune", ["--iters", "0"], "argument --iters: must be >= 1, got 0"),
    ("tune", ["--slots", "8", "--dispatch-chunks", "8", "--combine-chunks", "12"],
     "argument --slots: no chunk size is below a ring size [8]: nothing to sweep")]
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "OMPI_COMM_WORLD", "OMPI_MCA_", "MPI_LOCAL", "MV2_", "SLURM_")


def clean_env(extra_path: str | None = None) -> dict:
    """This process's environment without any MPI launcher's or torchrun's variables; the worktree first on
    PYTHONPATH (``extra_path`` before it)."""
    env = {k: v for k, v in os.environ.items()
           if k not in cli.LAUNCHER_RANK_VARS + ("WORLD_SIZE", "LOCAL_WORLD_SIZE")
           and not k.startswith(_LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(REPO), os.environ.get("PYTHONPATH")) if p)
    return env


def blocker_env(tmp_path: Path, blocked) -> dict:
    """An environment whose python cannot import ``blocked`` (a ``sitecustomize`` puts a finder first on
    ``sys.meta_path`` that refuses them); the test checks first that the block holds."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import sys
        _BLOCKED = {tuple(blocked)!r}

        class _Blocker:
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in _BLOCKED:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
                return None

        sys.meta_path.insert(0, _Blocker())
    """))
    env = clean_env(str(site))
    probe = ("import importlib, sys\n"
             f"for name in {tuple(blocked)!r}:\n"
             "    try:\n"
             "        importlib.import_module(name)\n"
             "    except ModuleNotFoundError:\n"
             "        continue\n"
             "    sys.exit(f'{name} imported despite the block')\n")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return env


def run(argv, env, timeout=120):
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def error_lines(text: str, prog: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"{prog}: error:")]


def help_of(parser, option: str) -> str:
    """An option's help as ``--help`` prints it (before line wrapping)."""
    action = next(a for a in parser._actions if option in a.option_strings)
    return cli.HelpFormatter(parser.prog)._expand_help(action)


# ------------------------------------------------------------------------------------------------------
# help texts
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_option_states_its_default(tool):
    parser = TOOLS[tool].build_parser()
    formatter = cli.HelpFormatter(parser.prog)
    options = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert len(options) >= 8
    for action in options:
        text = formatter._get_help_string(action) or ""
        assert action.help and "(default" in text, (action.option_strings, text)
    help_text = parser.format_help()
    assert help_text.count("(default") >= len(options)
    assert "(default: None)" not in help_text  # a default that depends on other options says what it is


def test_list_defaults_are_shown_as_they_are_typed():
    assert help_of(cli.build_parser(), "--sms").endswith("(default: 8,16,24,32 on a GPU, 4 on the host backend)")
    assert help_of(cli.build_parser(), "--ll-token-sweep").endswith("(default: 0,128)")
    assert help_of(cli.build_parser(), "--steady-n").endswith("(default: 10)")
    assert help_of(tune.build_parser(), "--sms").endswith("(default: 8,16,24,32,40,48)")
    assert help_of(soak.build_parser(), "--hiddens").endswith("(default: 2048,4096,7168)")
    assert soak.parse_args([]).hiddens == (2048, 4096, 7168)
    assert tune.parse_args([]).sms == [8, 16, 24, 32, 40, 48]


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_help_works_without_optional_packages_mpi_or_cupy(tool, tmp_path):
    env = blocker_env(tmp_path, BLOCKED_FOR_BENCH if tool == "bench" else BLOCKED)
    done = run([sys.executable, "-m", f"cupy_ep.{tool}", "--help"], env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith(f"usage: python -m cupy_ep.{tool}")
    for action in TOOLS[tool].build_parser()._actions:
        for option in action.option_strings:
            assert option in done.stdout, option


# ------------------------------------------------------------------------------------------------------
# bad values: one argparse error, exit status 2, printed by rank 0 only
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tool,argv,message", BAD_VALUES, ids=[f"{t} {' '.join(a)}" for t, a, _ in BAD_VALUES])
def test_a_bad_value_is_one_argparse_error(tool, argv, message, tmp_path):
    env = blocker_env(tmp_path, BLOCKED)  # and it ends before MPI or CuPy would load
    done = run([sys.executable, "-m", f"cupy_ep.{tool}", *argv], env)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    assert error_lines(done.stderr, f"python -m cupy_ep.{tool}") == [f"python -m cupy_ep.{tool}: error: {message}"]


def _mpiexec() -> str:
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        pytest.skip("no mpiexec on PATH")
    return found


@pytest.mark.parametrize("tool,argv", [("bench", ["--tokens", "-3"]), ("bench", ["--sms", "x"]),
                                       ("soak", ["--check-every", "0"]), ("tune", ["--sms", "5"])])
def test_a_bad_value_under_mpiexec_prints_once(tool, argv, tmp_path):
    env = blocker_env(tmp_path, BLOCKED)
    done = run([_mpiexec(), "-n", "2", sys.executable, "-m", f"cupy_ep.{tool}", *argv], env, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "Traceback" not in out
    assert len(error_lines(out, f"python -m cupy_ep.{tool}")) == 1, out
    assert sum(line.startswith("usage:") for line in out.splitlines()) == 1, out


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_help_under_mpiexec_prints_once(tool, tmp_path):
    env = blocker_env(tmp_path, BLOCKED)
    done = run([_mpiexec(), "-n", "2", sys.executable, "-m", f"cupy_ep.{tool}", "--help"], env, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert sum(line.startswith("usage:") for line in out.splitlines()) == 1, out
    assert out.count("show this help message and exit") == 1


def test_a_world_error_under_mpiexec_prints_once(tmp_path):
    """A problem found once MPI is up (here: experts that the rank count does not divide) is one argparse error
    too, printed by rank 0, every rank exiting with status 2 before any buffer exists."""
    done = run([_mpiexec(), "-n", "2", sys.executable, "-m", "cupy_ep.bench", "--experts", "15", "--topk", "4",
                "--out", str(tmp_path)], clean_env(), timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "Traceback" not in out
    errors = error_lines(out, "python -m cupy_ep.bench")
    assert errors == ["python -m cupy_ep.bench: error: argument --experts: must be a multiple of the rank count 2, "
                      "got 15"], out
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------------
# the rank before MPI starts, and who prints
# ------------------------------------------------------------------------------------------------------
def _no_launcher(monkeypatch):
    for name in list(os.environ):
        if name in cli.LAUNCHER_RANK_VARS or name.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)


@pytest.mark.parametrize("env,rank", [({}, None), ({"OMPI_COMM_WORLD_RANK": "3"}, 3), ({"PMI_RANK": "1"}, 1),
                                      ({"PMIX_RANK": "2"}, 2), ({"MV2_COMM_WORLD_RANK": "5"}, 5),
                                      ({"SLURM_PROCID": "4"}, 4), ({"RANK": "6", "LOCAL_RANK": "0"}, 6),
                                      ({"LOCAL_RANK": "1"}, 1),
                                      # an mpirun inside a Slurm job step: the MPI launcher's own rank wins
                                      ({"SLURM_PROCID": "0", "PMI_RANK": "1"}, 1),
                                      ({"PMI_RANK": ""}, None)])
def test_launcher_rank(monkeypatch, env, rank):
    _no_launcher(monkeypatch)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.launcher_rank() == rank


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_only_rank_0_prints(monkeypatch, capsys, tool):
    _no_launcher(monkeypatch)
    bad = {"bench": ["--tokens", "0"], "soak": ["--iters", "-1"], "tune": ["--tokens", "x"]}[tool]
    monkeypatch.setenv("PMI_RANK", "1")
    for argv, status in ((bad, 2), (["--help"], 0)):
        with pytest.raises(SystemExit) as e:
            TOOLS[tool].parse_args(argv)
        assert e.value.code == status
        assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("PMI_RANK", "0")
    with pytest.raises(SystemExit) as e:
        TOOLS[tool].parse_args(bad)
    assert e.value.code == 2
    assert len(error_lines(capsys.readouterr().err, f"python -m cupy_ep.{tool}")) == 1


class _FakeComm:
    """What fail_once uses of a communicator: this rank, and every rank's problem."""

    def __init__(self, rank, problems):
        self.rank, self.problems = rank, problems

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return len(self.problems)

    def allgather(self, mine):
        assert mine == self.problems[self.rank]
        return list(self.problems)


def test_fail_once(capsys):
    cli.fail_once(_FakeComm(0, [None, None]), cli.build_parser(), None)  # no problem: returns
    for rank, printed in ((0, True), (1, False)):
        with pytest.raises(SystemExit) as e:
            cli.fail_once(_FakeComm(rank, [None, "this rank sees no GPU"]), cli.build_parser(),
                            "this rank sees no GPU" if rank == 1 else None)
        assert e.value.code == 2
        err = capsys.readouterr().err
        if printed:  # a problem one rank alone has is named with its rank
            assert error_lines(err, "python -m cupy_ep.bench") == [
                "python -m cupy_ep.bench: error: this rank sees no GPU (rank 1)"]
        else:
            assert err == ""


@pytest.mark.parametrize("argv,ranks,gpu,message", [
    (["--experts", "15"], 2, False, "argument --experts: must be a multiple of the rank count 2, got 15"),
    (["--mode", "low-latency"], 2, False, "argument --mode: low-latency needs a GPU, and this rank sees none"),
    (["--backend", "cuda"], 2, False, "argument --backend: cuda, but this rank sees no GPU"),
    (["--mode", "low-latency", "--topk", "33", "--experts", "64"], 2, True,
     "argument --topk: the low-latency kernels take at most 32, got 33"),
    (["--topk", "40", "--experts", "64"], 2, True, "argument --topk: must be at most 32, got 40"),
    (["--mode", "internode"], 1, True, "argument --mode: internode needs at least 2 ranks (2 nodes), got 1"),
    ([], 2, False, None), (["--mode", "internode"], 2, True, None)])
def test_check_world(capsys, argv, ranks, gpu, message):
    args = cli.parse_args(argv, gpu=gpu, rank=0)
    comm = _FakeComm(0, [message] * ranks)
    if message is None:
        cli.check_world(args, comm, gpu)
        return
    with pytest.raises(SystemExit) as e:
        cli.check_world(args, comm, gpu)
    assert e.value.code == 2
    assert error_lines(capsys.readouterr().err, "python -m cupy_ep.bench") == [
        f"python -m cupy_ep.bench: error: {message}"]


@pytest.mark.mpi(min_size=2)
def test_check_world_ends_every_rank_alike(comm, capsys):
    args = cli.parse_args(["--experts", str(comm.Get_size() * 4 + 1)], gpu=False, rank=comm.Get_rank())
    with pytest.raises(SystemExit) as e:
        cli.check_world(args, comm, False)
    assert e.value.code == 2
    assert comm.allgather(e.value.code) == [2] * comm.Get_size()
    errors = error_lines(capsys.readouterr().err, "python -m cupy_ep.bench")
    assert len(errors) == (1 if comm.Get_rank() == 0 else 0)


@pytest.mark.mpi(min_size=2)
def test_tune_without_a_gpu_is_one_error(comm, capsys):
    from cupy_ep import gpu_available
    if gpu_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit) as e:
        tune.main(["--iters", "1"])
    assert e.value.code == 2
    assert comm.allgather(e.value.code) == [2] * comm.Get_size()
    errors = error_lines(capsys.readouterr().err, "python -m cupy_ep.tune")
    assert errors == (["python -m cupy_ep.tune: error: cupy_ep.tune times the GPU kernels, and this rank sees no GPU"]
                      if comm.Get_rank() == 0 else [])


# ------------------------------------------------------------------------------------------------------
# the benchmark's options
# ------------------------------------------------------------------------------------------------------
def test_bench_defaults_follow_the_mode_and_the_backend():
    assert cli.parse_args([]).tokens == 4096
    assert cli.parse_args(["--mode", "low-latency"]).tokens == cli.LL_DEFAULT_TOKENS
    assert cli.parse_args(["--mode", "low-latency", "--tokens", "64"]).tokens == 64
    args = cli.parse_args([])
    assert (args.sms, args.iters, args.out) == (None, None, None)  # until the backend is known
    gpu, host = cli.parse_args([], gpu=True), cli.parse_args([], gpu=False)
    assert (gpu.sms, gpu.default_sms, gpu.token_sweep, gpu.iters, gpu.warmup) == ([8, 16, 24, 32], 24,
                                                                                 [512, 1024, 2048, 8192], 50, 5)
    assert (host.sms, host.default_sms, host.token_sweep, host.iters, host.warmup) == ([4], 4, [], 3, 1)
    assert gpu.out == "benchmarks/results" and host.out == "out/bench_host"
    assert cli.parse_args(["--out", "x"], gpu=False).out == "x"
    assert cli.parse_args(["--token-sweep", "", "--iters", "7"], gpu=True).token_sweep == []
    assert cli.parse_args(["--iters", "7"], gpu=True).iters == 7


def test_host_results_are_ignored_by_git():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    host_out = cli.BACKEND_DEFAULTS["out"][1]
    done = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", f"{host_out}/bench_host_ep2.json"])
    assert done.returncode == 0, f"{host_out} is not ignored by git"
    done = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "benchmarks/results/bench_gpu_ep2.json"])
    assert done.returncode == 1


@pytest.mark.parametrize("argv,message", [
    (["--hidden", "100"], "argument --hidden: must be a multiple of 16, got 100"),
    (["--mode", "low-latency", "--hidden", "1040"], "argument --hidden: must be a multiple of 128 in --mode "
                                                    "low-latency, got 1040"),
    (["--topk", "9", "--experts", "8"], "argument --topk: must be at most --experts 8, got 9"),
    (["--mode", "internode", "--backend", "host"], "argument --backend: --mode internode runs on a GPU only"),
    (["--default-sms", "6", "--sms", "4,"], "argument --sms: an empty item in '4,'"),
    (["--sms", ""], "argument --sms: needs at least one value"),
    (["--ll-token-sweep", "0,-1"], "argument --ll-token-sweep: must be >= 0, got -1 (in '0,-1')"),
    (["--mode", "bogus"], "argument --mode: invalid choice")])
def test_bench_refuses(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv, rank=0)
    assert e.value.code == 2
    errors = error_lines(capsys.readouterr().err, "python -m cupy_ep.bench")
    assert len(errors) == 1 and message in errors[0], errors


def test_soak_and_tune_options():
    args = soak.parse_args([])
    assert (args.iters, args.start, args.seed, args.max_tokens, args.check_every, args.num_sms) == \
        (10000, 0, 2026, soak.DEFAULT_MAX_TOKENS, 50, 12)
    assert soak.parse_args(["--mode", "low-latency"]).max_tokens == 128
    assert soak.parse_args(["--mode", "low-latency", "--max-tokens", "8"]).max_tokens == 8
    args = tune.parse_args(["--sms", "8,16", "--slots", "128"])
    assert args.sms == [8, 16] and args.slots == [128] and args.max_sms == 24


# ------------------------------------------------------------------------------------------------------
# scripts/bench.sh --help
# ------------------------------------------------------------------------------------------------------
def test_bench_sh_help_prints_once_without_mpi(tmp_path):
    env = blocker_env(tmp_path, BLOCKED_FOR_BENCH)
    env.update(CUPY_EP_SKIP_INSTALL="1", CUPY_EP_PYTHON=sys.executable, CUPY_EP_MPIEXEC="/nonexistent/mpiexec")
    done = run(["bash", str(REPO / "scripts" / "bench.sh"), "--mode", "low-latency", "--help"], env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("The main job of the README")
    assert out.count("scripts/bench.sh --help") == 1  # its own usage, once
    assert sum(line.startswith("usage: python -m cupy_ep.bench") for line in out.splitlines()) == 1
    assert "[mpirun]" not in done.stderr and done.stderr == ""
