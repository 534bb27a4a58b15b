"""What a non-editable install ships: pyproject.toml lists every package of cupy_ep/ (a package left out installs
without its modules, and a Buffer then fails to import them), and its package-data globs cover every kernel source
the run-time compiler reads from cuda_src/."""
from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_is_listed():
    listed = set(_setuptools()["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "cupy_ep").rglob("__init__.py")}
    assert found - listed == set(), "packages missing from pyproject.toml [tool.setuptools] packages"
    assert listed - found - {"cupy_ep.cuda_src"} == set(), "pyproject.toml lists packages that do not exist"


def test_every_kernel_source_is_package_data():
    st = _setuptools()
    assert st["package-dir"]["cupy_ep.cuda_src"] == "cuda_src"
    globs = st["package-data"]["cupy_ep.cuda_src"]
    sources = [p.relative_to(ROOT / "cuda_src").as_posix() for p in (ROOT / "cuda_src").rglob("*")
               if p.is_file() and p.suffix in (".cu", ".cuh", ".h")]
    assert sources
    missing = [s for s in sources if not any(fnmatch.fnmatch(s, g) for g in globs)]
    assert missing == [], f"kernel sources outside the package-data globs {globs}"
