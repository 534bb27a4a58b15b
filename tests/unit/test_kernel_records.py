"""The launchers' argument records (cupy_ep/cuda/kernels*.py) against the kernels' signatures in cuda_src/: each
record's fields are its kernel's parameters, by name and in order, so that a parameter added, removed or moved on
one side only fails here, on the CPU, instead of handing a kernel its neighbour's value. And every ``__global__``
of a path's source has a record, except the probes that only the GPU tests launch."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cupy_ep.cuda import kernels, kernels_internode, kernels_low_latency

SRC = Path(__file__).resolve().parents[2] / "cuda_src"
MODULES = (kernels, kernels_internode, kernels_low_latency)
#: kernels no path launches (the GPU tests call them directly to compare the device's layout sums, or to clean)
UNLAUNCHED = {"intranode.cu": {"carve_probe"}, "low_latency.cu": {"clean_low_latency_buffer", "ll_carve_probe"}}

_GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*\(([^{]*?)\)\s*\{",
                     re.S)


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", re.sub(r"//[^\n]*", "", text), flags=re.S)


def signatures(text: str) -> dict[str, list[str]]:
    """``{kernel name: its parameter names in order}`` of every ``__global__`` function in CUDA source ``text``."""
    out = {}
    for name, params in _GLOBAL.findall(_strip_comments(text)):
        assert name not in out, f"two __global__ functions named {name}"
        out[name] = [re.sub(r"\[.*\]", "", p).strip().split()[-1].lstrip("*&") for p in params.split(",")]
    return out


def _records():
    return [(module.__name__.rpartition(".")[2], name, filename, record)
            for module in MODULES for name, (filename, record) in module.RECORDS.items()]


@pytest.mark.parametrize("module, name, filename, record",
                         [pytest.param(*r, id=f"{r[0]}.{r[3].__name__}") for r in _records()])
def test_record_fields_are_the_kernel_parameters(module, name, filename, record):
    params = signatures((SRC / filename).read_text())
    assert name in params, f"{module}.RECORDS names {name}, which {filename} does not define"
    assert list(record._fields) == params[name], f"{module}.{record.__name__} against {filename}'s {name}"


@pytest.mark.parametrize("filename", ["layout.cu", "intranode.cu", "internode.cu", "low_latency.cu"])
def test_every_kernel_a_path_launches_has_a_record(filename):
    recorded = {name for _, name, f, _ in _records() if f == filename}
    kernels_here = set(signatures((SRC / filename).read_text()))
    assert kernels_here - recorded == UNLAUNCHED.get(filename, set())
    assert recorded <= kernels_here


def test_record_names_are_unique_per_file():
    keys = [(f, name) for _, name, f, _ in _records()]
    assert len(keys) == len(set(keys))


def test_the_reader_reads_templates_launch_bounds_and_comments():
    text = """
    template <int kN, typename T>
    __global__ void __launch_bounds__(Groups<kN>::kThreads, 1)  // a comment (with parentheses)
        k(int4* a, const unsigned long long* peers, /* b */ const int b, long long c[4]) {
    }
    __global__ void plain(void** ptrs, const DeviceCtx* ctx) { }
    """
    assert signatures(text) == {"k": ["a", "peers", "b", "c"], "plain": ["ptrs", "ctx"]}


def test_a_moved_parameter_fails_the_comparison():
    """The check compares order, not only the set of names."""
    from typing import Any, NamedTuple
    fields = list(kernels_internode.InternodeCachedNotify._fields)
    fields[1], fields[2] = fields[2], fields[1]
    swapped = NamedTuple("Swapped", [(f, Any) for f in fields])
    params = signatures((SRC / "internode.cu").read_text())["internode_cached_notify"]
    assert list(swapped._fields) != params and sorted(swapped._fields) == sorted(params)
