"""The test tree's tiers and order: tests/unit holds single-process tests only, every file with an MPI-marked test
lives in tests/multirank (scripts/test.sh runs the MPI steps on tests/multirank alone), tests/gpu is split by path,
and the tests marked ``runs_last`` (they leave the CUDA context or their buffers unusable) run after all others,
whatever their file names (tests/conftest.py's collection hook)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import move_runs_last_to_end, pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
GPU_PATHS = ("common", "internode", "intranode", "low_latency")


class _Item:
    """The part of a pytest item the ordering hook reads: a node id and its markers."""

    def __init__(self, nodeid, *marks):
        self.nodeid, self.marks = nodeid, [m.mark for m in marks]

    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)


class _Config:
    def getoption(self, name, default=None):
        return False


def _collect(*args) -> list[str]:
    """Node ids that ``pytest --collect-only -q ARGS`` lists, in run order (a fresh interpreter at the repo root)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, f"collection failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_runs_last_tests_move_after_the_others_each_part_in_order():
    last = pytest.mark.runs_last(reason="leaves the buffer unusable")
    items = [_Item("a::t1"), _Item("z_timeout::t1", last), _Item("a::t2"), _Item("b::t1", pytest.mark.mpi(min_size=2)),
             _Item("m_timeout::t1", last), _Item("c::t1")]
    pytest_collection_modifyitems(_Config(), items)
    assert [i.nodeid for i in items] == ["a::t1", "a::t2", "b::t1", "c::t1", "z_timeout::t1", "m_timeout::t1"]


def test_an_order_without_runs_last_tests_is_left_as_it_is():
    items = [_Item(n) for n in ("c::t", "a::t", "b::t")]
    move_runs_last_to_end(items)
    assert [i.nodeid for i in items] == ["c::t", "a::t", "b::t"]


def test_runs_last_without_a_reason_is_refused():
    items = [_Item("a::t"), _Item("b::t", pytest.mark.runs_last)]
    with pytest.raises(pytest.UsageError, match=r"^b::t: runs_last needs a reason"):
        move_runs_last_to_end(items)


def test_the_gpu_timeout_modules_run_after_every_other_gpu_test():
    ids = _collect("tests/gpu")
    files = [i.split("::")[0] for i in ids]
    marked = {"tests/gpu/intranode/test_intranode_timeout.py", "tests/gpu/low_latency/test_low_latency_timeout.py"}
    assert marked <= set(files)
    first_marked = min(files.index(f) for f in marked)
    assert set(files[first_marked:]) == marked, "an unmarked GPU test runs after a runs_last one"
    # everything else keeps pytest's own order: the folders, then the files, alphabetically
    rest = list(dict.fromkeys(files[:first_marked]))
    assert rest == sorted(rest)


def test_mpi_marked_tests_are_all_in_tests_mpi_and_every_file_there_has_one():
    ids = _collect("-m", "mpi", "tests/unit", "tests/multirank")
    files = {i.split("::")[0] for i in ids}
    assert not {f for f in files if not f.startswith("tests/multirank/")}, "tests/unit holds single-process tests only"
    assert files == {f"tests/multirank/{p.name}" for p in (TESTS / "multirank").glob("test_*.py")}


def test_every_test_file_is_in_a_tier():
    assert not list(TESTS.glob("test_*.py")), "a test file belongs in tests/unit, tests/multirank or tests/gpu/<path>"
    assert not list((TESTS / "gpu").glob("test_*.py")), \
        f"a GPU test file belongs in tests/gpu/{{{','.join(GPU_PATHS)}}}"
    folders = [TESTS / "unit", TESTS / "multirank", TESTS / "gpu"] + [TESTS / "gpu" / p for p in GPU_PATHS]
    # packages, so that equal file names in two folders (tests/multirank and tests/gpu/common both have a
    # test_model_shapes.py) are two modules
    assert [f for f in folders if not (f / "__init__.py").is_file()] == []
    assert {p.name for p in (TESTS / "gpu").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(GPU_PATHS)


def test_no_test_folder_is_named_after_a_pytest_mpi_marker():
    """pytest-mpi tells an MPI test by ``"mpi" in item.keywords``, and a test's keywords hold the name of every
    folder above it: every test under a folder named ``mpi`` would count as MPI-marked (run at every rank by
    --only-mpi, skipped by the single-process step), whatever its own markers say."""
    markers = {"mpi", "mpi_skip", "mpi_xfail", "mpi_break"}
    assert [p for p in TESTS.rglob("*") if p.is_dir() and p.name in markers] == []
