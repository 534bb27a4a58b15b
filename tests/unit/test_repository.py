"""The repository describes the software as it is: no development history in the README, the docs, the code, the
tests, the scripts or the examples (history lives in git and CHANGELOG.md), and no experiment material on the
main branch (experiments live in the ignored .scratch/ folder).

Runs on the files git tracks, so it needs a git checkout; elsewhere (an unpacked sdist) it skips."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("README.md", "docs", "cupy_ep", "cuda_src", "tests", "scripts", "examples", "benchmarks")

# Built from pieces so that this file, which is checked too, does not match its own patterns.
_S, _R, _I = "[Ss]" + "ession", "[Rr]" + "eview", "[Ii]" + "ssue"
HISTORY = {
    "a session number": re.compile(rf"\b{_S} [0-9]+"),
    "a run label": re.compile(r"\bS[12][0-9]" + r"[A-Z]\b"),
    "review narration": re.compile(rf"{_R} (fix|mend)"),
    "an issue number": re.compile(rf"\b{_I} #?[0-9]+"),
    "a reference to a tracker issue": re.compile(rf"\b(the|this|that) {_I}\b(?! tracker)"),
    "a reviewer's note": re.compile(r"(#|//)\s*" + "RE" + r"VIEW\b"),
    "a reference to the experiments folder": re.compile("benchmarks/" + "experiments"),
    "a reference to old results": re.compile("results/" + "history"),
    "a reference to a research folder": re.compile(r"(?<![\w.-])" + "re" + "search/"),
}
REMOVED = ("benchmarks/" + "experiments/", "benchmarks/results/" + "history/")


def _tracked(*paths: str) -> list[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    proc = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--", *paths], capture_output=True)
    if proc.returncode != 0:
        pytest.skip("not a git checkout")
    return [p for p in proc.stdout.decode().split("\0") if p]


def test_no_development_history_in_tracked_files():
    found = []
    for rel in _tracked(*CHECKED):
        path = ROOT / rel
        if not path.is_file():  # deleted in the work tree but not yet from the index
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a binary file
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for what, pattern in HISTORY.items():
                if pattern.search(line):
                    found.append(f"{rel}:{lineno}: {what}: {line.strip()[:120]}")
    assert not found, ("development history in the repository (describe the software as it is; history belongs in "
                       "git and CHANGELOG.md):\n" + "\n".join(found))


def test_no_experiment_material_is_tracked():
    tracked = _tracked(*REMOVED)
    assert not tracked, (f"experiment material is tracked ({len(tracked)} files, e.g. {tracked[0]}); keep experiments "
                         "in the ignored .scratch/ folder and commit results to benchmarks/results/")


def test_the_patterns_catch_what_they_are_for():
    bad = [f"{'Se' + 'ssion'} 12 measured", "the S2" + "4B run", f"{'re' + 'view'} fix: x", f"see {'is' + 'sue'} 6",
           f"as the {'is' + 'sue'} requires", "# " + "RE" + "VIEW: is this right?", "// " + "RE" + "VIEW: x",
           "benchmarks/" + "experiments/s1/x.log", "results/" + "history/a.md", "in ../re" + "search/deepep.md"]
    good = ["one session of MPI", "SMs 24", "reviewed", "the issue tracker", "benchmarks/results/bench_gpu_ep2.md",
            "cupy_ep.research_tools"]
    for line in bad:
        assert any(p.search(line) for p in HISTORY.values()), line
    for line in good:
        assert not any(p.search(line) for p in HISTORY.values()), line
