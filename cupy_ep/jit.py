"""The single way to get a kernel: NVRTC compile of ``cuda_src/``, template instantiation by name
expression, a disk cache keyed by a hash of all of ``cuda_src/``, and a launchable function.

    k = jit.get_kernel("intranode.cu", "intranode::dispatch<2, long long>")
    k((grid,), (threads,), (arg0, arg1, ...), shared_mem=0, stream=s)

``compile_only`` does the same compile without a GPU (CI uses it) and reports registers and spills.
We call NVRTC ourselves (``cupy_backends.cuda.libs.nvrtc``) rather than ``cupy.RawModule`` so that the arch is
explicit, compiling needs no device, and the cache key covers the headers (CuPy's does not).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import tempfile
import threading
from pathlib import Path

from .errors import CompileError

_OPTIONS = ("-std=c++17", "-lineinfo")


@functools.lru_cache(maxsize=None)
def source_dir() -> Path:
    """``cuda_src/``: package data when installed, the checkout's top-level folder otherwise."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cupy_ep: cannot find cuda_src/ next to {here}")


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """SHA-256 over the names and contents of every file in ``cuda_src/`` (headers included)."""
    h = hashlib.sha256()
    for path in sorted(source_dir().glob("*.cu*")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_dir() -> Path:
    base = os.environ.get("CUPY_EP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "cupy_ep", "kernels")
    return Path(base) / source_hash()[:16]


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc
    return nvrtc


def nvrtc_version() -> tuple:
    return tuple(_nvrtc().getVersion())


@dataclasses.dataclass
class CompileResult:
    cubin: bytes
    mapping: dict            # name expression -> lowered (mangled) name
    log: str
    arch: str

    def resources(self) -> dict:
        """Per mangled kernel name: registers, spill stores/loads, stack bytes, from ``ptxas -v``."""
        out, current = {}, None
        for line in self.log.splitlines():
            m = re.search(r"Compiling entry function '([^']+)'|Function properties for (\S+)", line)
            if m:
                current = m.group(1) or m.group(2)
                out.setdefault(current, {})
            if current is None:
                continue
            m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
            if m:
                out[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                    spill_loads=int(m.group(3)))
            m = re.search(r"Used (\d+) registers", line)
            if m:
                out[current]["registers"] = int(m.group(1))
        return out


def compile_cubin(filename: str, name_expressions, arch: str = "sm_90", extra_options=(),
                  verbose: bool = False) -> CompileResult:
    """Compile ``cuda_src/<filename>`` with NVRTC for ``arch``; no GPU needed.

    Raises:
        CompileError: with NVRTC's log when the source does not compile.
    """
    nvrtc = _nvrtc()
    src_dir = source_dir()
    source = (src_dir / filename).read_text()
    options = _OPTIONS + (f"-arch={arch}", f"-I{src_dir}") + tuple(extra_options)
    if verbose:
        options += ("--ptxas-options=-v",)
    prog = nvrtc.createProgram(source, filename, (), ())
    try:
        for name in name_expressions:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise CompileError(f"NVRTC failed on {filename} for {list(name_expressions)} ({arch}): {e}",
                               nvrtc.getProgramLog(prog)) from None
        cubin = nvrtc.getCUBIN(prog)
        mapping = {name: nvrtc.getLoweredName(prog, name) for name in name_expressions}
        log = nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return CompileResult(cubin, mapping, log, arch)


def compile_only(filename: str, name_expressions, arch: str = "sm_90") -> CompileResult:
    """GPU-free compile used by the tests; ``.resources()`` reports registers and spills."""
    return compile_cubin(filename, list(name_expressions), arch=arch, verbose=True)


def _cache_key(filename: str, name: str, arch: str, extra_options) -> str:
    text = json.dumps([filename, name, arch, list(_OPTIONS), list(extra_options), nvrtc_version()])
    return hashlib.sha1(text.encode()).hexdigest()


def _load_or_compile(filename: str, name: str, arch: str, extra_options) -> tuple[bytes, str]:
    """Cubin and lowered name of one instantiation, from the disk cache or a fresh compile."""
    folder = cache_dir()
    key = _cache_key(filename, name, arch, extra_options)
    cubin_path, meta_path = folder / f"{key}.cubin", folder / f"{key}.json"
    if cubin_path.is_file() and meta_path.is_file():
        try:
            return cubin_path.read_bytes(), json.loads(meta_path.read_text())["lowered"]
        except (OSError, ValueError, KeyError):
            pass  # a damaged entry is recompiled below
    result = compile_cubin(filename, [name], arch=arch, extra_options=extra_options)
    lowered = result.mapping[name]
    folder.mkdir(parents=True, exist_ok=True)
    # Atomic writes: several ranks may compile the same kernel into one cache at once.
    for path, data in ((cubin_path, result.cubin), (meta_path, json.dumps({"lowered": lowered}).encode())):
        fd, tmp = tempfile.mkstemp(dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return result.cubin, lowered


def device_arch(device_id: int | None = None) -> str:
    import cupy
    cc = int(cupy.cuda.Device(device_id).compute_capability)
    supported = [a for a in _nvrtc().getSupportedArchs() if a <= cc]
    return f"sm_{max(supported) if supported else cc}"


class Kernel:
    """A loaded kernel: ``k(grid, block, args, shared_mem=0, stream=None)``.

    Arguments are passed as CuPy passes them (arrays as pointers, numpy scalars as their C type): always
    use ``numpy.int32`` / ``numpy.float32`` / ``numpy.uint64`` for scalars."""

    def __init__(self, module, function, name: str):
        self._module = module        # keeps the CUmodule alive
        self._function = function
        self.name = name
        self._smem_limit = 48 * 1024

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None):
        if shared_mem > self._smem_limit:
            from cupy.cuda import driver
            driver.funcSetAttribute(self._function.ptr, 8, shared_mem)  # MAX_DYNAMIC_SHARED_SIZE_BYTES
            self._smem_limit = shared_mem
        self._function(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem, stream=stream)


_lock = threading.Lock()
_loaded: dict = {}


def get_kernel(filename: str, name: str, extra_options=()) -> Kernel:
    """The kernel ``name`` (a name expression such as ``"intranode::dispatch<2, long long>"``) of
    ``cuda_src/<filename>``, compiled for the current device, cached on disk and in memory."""
    import cupy
    device_id = cupy.cuda.Device().id
    key = (device_id, filename, name, tuple(extra_options))
    with _lock:
        kernel = _loaded.get(key)
        if kernel is None:
            arch = device_arch(device_id)
            cubin, lowered = _load_or_compile(filename, name, arch, tuple(extra_options))
            module = cupy.cuda.function.Module()
            module.load(cubin)
            kernel = Kernel(module, module.get_function(lowered), name)
            _loaded[key] = kernel
    return kernel
