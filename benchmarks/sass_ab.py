"""The machine code of the hot kernels in two trees of cupy_ep, compared without a GPU:

    python benchmarks/sass_ab.py BASE_TREE [HEAD_TREE]      (HEAD_TREE: this checkout by default)

A tree is a folder holding ``cupy_ep/`` and ``cuda_src/`` (``scripts/bench_ab.sh prepare COMMIT`` writes one to
``.carry/ab_base``). Each tree compiles its kernels for sm_90 with its own ``cupy_ep.jit.compile_only`` (this
environment's NVRTC, in a subprocess with the tree first on the path); ``nvdisasm`` (on PATH, or from the
``nvidia-cuda-nvdisasm`` wheel: ``pip install nvidia-cuda-nvdisasm``) turns the cubins into SASS.

Per kernel the table gives the instruction count of each tree (NOPs left out), how many instructions differ once
registers, predicates and immediates are written alike (a multiset difference: a renamed register or a moved
instruction is no difference, an added or removed one is), and the memory instructions of each tree (global,
shared and local loads and stores, atomics, bulk copies, barriers). Identical code runs alike, so a kernel with
no differing instructions needs no timing to show it is not slower; a difference names the kernels that do.
This complements ``scripts/bench_ab.sh`` on a GPU shared by two ranks, where run-to-run noise is several percent.
"""
from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: per kernel file, the instantiations compared: the ones the benchmark times at 2 ranks (intranode, the IPC
#: internode build at 2 nodes x 1 GPU, low latency with FP8 and int64 top-k)
KERNELS = {
    "layout.cu": ["ep::get_dispatch_layout<long long>"],
    "intranode.cu": ["ep::notify_dispatch<2>", "ep::cached_notify_dispatch<2>", "ep::cached_notify_combine<2>",
                     "ep::dispatch<2, long long>", "ep::combine<2>", "ep::dispatch_direct<2, long long>",
                     "ep::combine_direct<2>"],
    "internode.cu": ["ep::internode_dispatch<2, 1, ep::IpcRdma, long long>",
                     "ep::internode_combine<2, 1, ep::IpcRdma>"],
    "low_latency.cu": ["ep::dispatch<true, long long>", "ep::combine<long long>"],
}

_FUNCTION = re.compile(r"^\s*\.text\.(\S+):")
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_MEMORY = re.compile(r"^(@!?U?P\w* )?(LDG|STG|LDS|STS|LDL|STL|LD|ST|ATOM|ATOMS|ATOMG|RED|UBLKCP|UTMA|SYNCS|MEMBAR|"
                     r"FENCE|CCTL)\b")

# What one tree runs in its subprocess: compile every kernel, write the cubins and the lowered names.
_DUMP = """
import json, sys
from cupy_ep import jit
kernels, out = json.loads(sys.argv[1]), sys.argv[2]
names = {}
for filename, exprs in kernels.items():
    result = jit.compile_only(filename, exprs, arch="sm_90")
    open(f"{out}/{filename}.cubin", "wb").write(result.cubin)
    names[filename] = result.mapping
json.dump(names, open(f"{out}/names.json", "w"))
"""


def parse_sass(text: str) -> dict[str, list[str]]:
    """``{mangled kernel name: [instruction, ...]}`` of ``nvdisasm -c`` output (NOPs left out)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None and m.group(1) != "NOP":
            current.append(m.group(1))
    return out


def normalize(instruction: str) -> str:
    """An instruction with its registers, predicates, branch labels and immediates written alike."""
    s = re.sub(r"\.L_x_\d+", "L", instruction)
    s = re.sub(r"\bU?R\d+\b", "R", s)
    s = re.sub(r"\bU?P\d\b", "P", s)
    s = re.sub(r"-?0x[0-9a-f]+|\b\d+\b", "I", s)
    return s


def compare(base: list[str], head: list[str]) -> dict:
    """Counts of two kernels' instruction lists: ``base``, ``head``, ``differing`` (the multiset difference of
    the normalized instructions, both ways), ``memory_base``, ``memory_head``."""
    a = collections.Counter(map(normalize, base))
    b = collections.Counter(map(normalize, head))
    def memory(c):
        return sum(n for ins, n in c.items() if _MEMORY.match(ins))
    return {"base": len(base), "head": len(head), "differing": sum(((a - b) + (b - a)).values()),
            "memory_base": memory(a), "memory_head": memory(b)}


def _nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
        for root in nvidia.__path__:
            for candidate in Path(root).glob("cu*/bin/nvdisasm"):
                return str(candidate)
    except ImportError:
        pass
    sys.exit("sass_ab.py: nvdisasm not found (PATH, or pip install nvidia-cuda-nvdisasm)")


def disassemble(tree: Path, workdir: Path) -> dict[str, dict[str, list[str]]]:
    """``{expression: instructions}`` per kernel file of one tree, compiled with that tree's cupy_ep."""
    workdir.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", _DUMP, json.dumps(KERNELS), str(workdir)], cwd=tree, env=env, check=True)
    names = json.loads((workdir / "names.json").read_text())
    tool = _nvdisasm()
    out = {}
    for filename, mapping in names.items():
        text = subprocess.run([tool, "-c", str(workdir / f"{filename}.cubin")], capture_output=True, text=True,
                              check=True).stdout
        functions = parse_sass(text)
        out[filename] = {expr: functions.get(mangled, []) for expr, mangled in mapping.items()}
    return out


def markdown(base: dict, head: dict) -> str:
    lines = ["| kernel | instructions base | head | differing | memory base | head |", "|---|---|---|---|---|---|"]
    for filename, exprs in KERNELS.items():
        for expr in exprs:
            c = compare(base[filename][expr], head[filename][expr])
            lines.append(f"| `{expr}` | {c['base']} | {c['head']} | {c['differing']} | {c['memory_base']} | "
                         f"{c['memory_head']} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    trees = [Path(argv[0]).resolve(), Path(argv[1] if len(argv) > 1 else Path(__file__).parents[1]).resolve()]
    for tree in trees:
        if not (tree / "cupy_ep").is_dir() or not (tree / "cuda_src").is_dir():
            print(f"sass_ab.py: {tree} holds no cupy_ep/ and cuda_src/", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory() as tmp:
        base, head = (disassemble(t, Path(tmp) / name) for t, name in zip(trees, ("base", "head")))
        print(markdown(base, head))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
