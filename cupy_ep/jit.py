"""The single way to get a kernel: NVRTC compile of ``cuda_src/``, template instantiation by name
expression, a disk cache keyed by a hash of all of ``cuda_src/``, and a launchable function.

    k = jit.get_kernel("intranode.cu", "intranode::dispatch<2, long long>")
    k((grid,), (threads,), (arg0, arg1, ...), shared_mem=0, stream=s)

``compile_only`` does the same compile without a GPU (CI uses it) and reports registers and spills.
Every compile also gets ``common/ids.cuh``, generated from :mod:`cupy_ep.ids` (kernel ids, roles, shapes and
limits that Python owns), as an in-memory header; the cache key covers its text.
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
import time
from pathlib import Path

from .errors import CompileError

_OPTIONS = ("-std=c++17", "-lineinfo")


@functools.lru_cache(maxsize=None)
def source_dir() -> Path:
    """``cuda_src/``: package data when installed, the checkout's top-level folder otherwise."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "common" / "wait.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cupy_ep: cannot find cuda_src/ next to {here}")


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """SHA-256 over the relative paths and contents of every file under ``cuda_src/``, subfolders included (a
    kernel compiles from its entry file and any header it includes, at any depth), and over the generated
    headers."""
    h = hashlib.sha256()
    for path in source_files():
        h.update(path.relative_to(source_dir()).as_posix().encode())
        h.update(path.read_bytes())
    for name, text in sorted(generated_headers().items()):
        h.update(name.encode())
        h.update(text.encode())
    return h.hexdigest()


def generated_headers() -> dict:
    """``{include name: text}`` of the headers Python generates for every compile (they exist only in memory)."""
    from . import ids
    return {ids.HEADER_NAME: ids.header()}


#: What cuda_src/ holds: entry files (.cu) and headers (.cuh); pyproject.toml's package-data ships the same patterns.
SOURCE_SUFFIXES = (".cu", ".cuh")


def source_files() -> list:
    """Every kernel source file under ``cuda_src/`` (entry files and headers, in subfolders too), sorted."""
    root = source_dir()
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES)


def cache_dir() -> Path:
    base = os.environ.get("CUPY_EP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "cupy_ep", "kernels")
    return Path(base) / source_hash()[:16]


class _Nvrtc:
    """NVRTC through ctypes (the library CuPy would use, found by cuda.pathfinder). We do not use
    cupy_backends' wrapper: its getCUBIN drops the cubin's last byte (it sizes it like a NUL-terminated
    PTX string), which nvJitLink rejects as a malformed ELF."""

    def __init__(self):
        import ctypes
        from cuda import pathfinder
        self.ct = ctypes
        self.lib = ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path)

    def _check(self, rc, prog=None, what=""):
        if rc != 0:
            err = self.lib.nvrtcGetErrorString
            err.restype = self.ct.c_char_p
            raise CompileError(f"NVRTC {what}: {err(rc).decode()}", self.log(prog) if prog is not None else "")

    def version(self) -> tuple:
        major, minor = self.ct.c_int(), self.ct.c_int()
        self._check(self.lib.nvrtcVersion(self.ct.byref(major), self.ct.byref(minor)), what="version")
        return major.value, minor.value

    def supported_archs(self) -> list:
        n = self.ct.c_int()
        self._check(self.lib.nvrtcGetNumSupportedArchs(self.ct.byref(n)), what="archs")
        archs = (self.ct.c_int * n.value)()
        self._check(self.lib.nvrtcGetSupportedArchs(archs), what="archs")
        return list(archs)

    def log(self, prog) -> str:
        size = self.ct.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, self.ct.byref(size))
        buf = self.ct.create_string_buffer(size.value + 1)
        self.lib.nvrtcGetProgramLog(prog, buf)
        return buf.value.decode(errors="replace")

    def compile(self, source: str, filename: str, names, options, headers=None):
        """-> (cubin bytes, {name expression: lowered name}, log). ``headers``: ``{include name: text}`` that
        ``#include "name"`` finds in memory."""
        ct, lib = self.ct, self.lib
        prog = ct.c_void_p()
        headers = headers or {}
        texts = (ct.c_char_p * len(headers))(*[t.encode() for t in headers.values()])
        include_names = (ct.c_char_p * len(headers))(*[n.encode() for n in headers])
        self._check(lib.nvrtcCreateProgram(ct.byref(prog), source.encode(), filename.encode(), len(headers),
                                           texts, include_names), what="create")
        try:
            for name in names:
                self._check(lib.nvrtcAddNameExpression(prog, name.encode()), prog, f"name {name}")
            opts = (ct.c_char_p * len(options))(*[o.encode() for o in options])
            rc = lib.nvrtcCompileProgram(prog, len(options), opts)
            if rc != 0:
                raise CompileError(f"NVRTC failed on {filename} for {list(names)}", self.log(prog))
            size = ct.c_size_t()
            self._check(lib.nvrtcGetCUBINSize(prog, ct.byref(size)), prog, "cubin size")
            cubin = ct.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, cubin), prog, "cubin")
            mapping = {}
            for name in names:
                lowered = ct.c_char_p()
                self._check(lib.nvrtcGetLoweredName(prog, name.encode(), ct.byref(lowered)), prog, "lowered name")
                mapping[name] = lowered.value.decode()
            return cubin.raw, mapping, self.log(prog)
        finally:
            lib.nvrtcDestroyProgram(ct.byref(prog))


@functools.lru_cache(maxsize=None)
def _nvrtc() -> _Nvrtc:
    return _Nvrtc()


def nvrtc_version() -> tuple:
    return _nvrtc().version()


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


# ---- NVSHMEM: files that include nvshmem.cuh are compiled relocatable and linked with the wheel's
# ---- libnvshmem_device.a by nvJitLink (no compiler toolchain)
#: Compile option that selects NVSHMEM inside a file that supports both transports (internode.cu: its
#: NvshmemRdma transport exists only with it); such a compile is relocatable and linked like an NVSHMEM file.
NVSHMEM_DEFINE = "-DCUPY_EP_NVSHMEM"


def uses_nvshmem(filename: str, extra_options=(), source: str | None = None) -> bool:
    text = (source_dir() / filename).read_text() if source is None else source
    return NVSHMEM_DEFINE in extra_options or '#include "transport/nvshmem.cuh"' in text


@functools.lru_cache(maxsize=None)
def nvshmem_paths() -> dict:
    """Include folders, the device library and the version of the ``nvidia-nvshmem-cu13`` wheel."""
    import importlib.metadata
    from cuda import pathfinder
    try:
        include = pathfinder.find_nvidia_header_directory("nvshmem")
    except Exception as e:  # noqa: BLE001  (pathfinder raises several kinds)
        include = None
        reason = str(e)
    if not include:
        raise CompileError("NVSHMEM kernels need the nvidia-nvshmem-cu13 wheel: pip install 'cupy-ep[nvshmem]'",
                           locals().get("reason", ""))
    import cupy
    cccl = Path(cupy.__file__).parent / "_core" / "include" / "cupy" / "_cccl" / "libcudacxx"
    return {"include": include, "cudart": pathfinder.find_nvidia_header_directory("cudart"), "cccl": str(cccl),
            "device_lib": str(Path(include).parent / "lib" / "libnvshmem_device.a"),
            "version": importlib.metadata.version("nvidia-nvshmem-cu13")}


def _nvshmem_options() -> tuple:
    p = nvshmem_paths()
    # -default-device: NVSHMEM 3.4's headers have an un-annotated constructor NVRTC rejects otherwise.
    return ("-rdc=true", "-default-device", f"-I{p['include']}", f"-I{p['cudart']}", f"-I{p['cccl']}")


@functools.lru_cache(maxsize=None)
def _nvjitlink():
    import ctypes
    from cuda import pathfinder
    lib = ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("nvJitLink").abs_path)
    for name in ("nvJitLinkCreate", "nvJitLinkAddData", "nvJitLinkAddFile", "nvJitLinkComplete",
                 "nvJitLinkGetLinkedCubinSize", "nvJitLinkGetLinkedCubin", "nvJitLinkGetErrorLogSize",
                 "nvJitLinkGetErrorLog", "nvJitLinkDestroy"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def link_with_nvshmem(relocatable_cubin: bytes, arch: str) -> bytes:
    """nvJitLink: our relocatable cubin + ``libnvshmem_device.a`` -> an executable cubin."""
    import ctypes
    lib = _nvjitlink()
    handle = ctypes.c_void_p()
    opts = (ctypes.c_char_p * 1)(f"-arch={arch}".encode())

    def check(rc, what):
        if rc != 0:
            size = ctypes.c_size_t()
            lib.nvJitLinkGetErrorLogSize(handle, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvJitLinkGetErrorLog(handle, log)
            raise CompileError(f"nvJitLink {what} failed with code {rc}", log.value.decode(errors="replace"))

    check(lib.nvJitLinkCreate(ctypes.byref(handle), 1, opts), "create")
    try:
        check(lib.nvJitLinkAddData(handle, 1, relocatable_cubin, ctypes.c_size_t(len(relocatable_cubin)),
                                   b"kernels.cubin"), "add cubin")  # NVJITLINK_INPUT_CUBIN
        check(lib.nvJitLinkAddFile(handle, 6, nvshmem_paths()["device_lib"].encode()), "add library")  # LIBRARY
        check(lib.nvJitLinkComplete(handle), "link")
        size = ctypes.c_size_t()
        check(lib.nvJitLinkGetLinkedCubinSize(handle, ctypes.byref(size)), "size")
        out = ctypes.create_string_buffer(size.value)
        check(lib.nvJitLinkGetLinkedCubin(handle, out), "get cubin")
        return out.raw
    finally:
        lib.nvJitLinkDestroy(ctypes.byref(handle))


def compile_cubin(filename: str, name_expressions, arch: str = "sm_90", extra_options=(),
                  verbose: bool = False, source: str | None = None) -> CompileResult:
    """Compile ``cuda_src/<filename>`` (a path relative to ``cuda_src/``, e.g. ``"probes/copy.cu"``) with NVRTC for
    ``arch``; no GPU needed. Includes resolve from ``cuda_src/`` (``#include "common/wait.cuh"``). Files that include
    ``transport/nvshmem.cuh`` are compiled relocatable and linked with NVSHMEM's device library. ``source``: compile
    this text instead of the file's (a probe generated by a test; ``filename`` names it in messages).

    Raises:
        CompileError: with NVRTC's (or nvJitLink's) log when the source does not compile (link).
    """
    nvrtc = _nvrtc()
    src_dir = source_dir()
    if source is None:
        source = (src_dir / filename).read_text()
    nvshmem = uses_nvshmem(filename, tuple(extra_options), source)
    options = _OPTIONS + (f"-arch={arch}", f"-I{src_dir}") + tuple(extra_options)
    if nvshmem:
        options += _nvshmem_options()
    if verbose:
        options += ("--ptxas-options=-v",)
    cubin, mapping, log = nvrtc.compile(source, filename, list(name_expressions), options, generated_headers())
    if nvshmem:
        cubin = link_with_nvshmem(cubin, arch)
    return CompileResult(cubin, mapping, log, arch)


def compile_only(filename: str, name_expressions, arch: str = "sm_90", extra_options=(),
                 source: str | None = None) -> CompileResult:
    """GPU-free compile used by the tests; ``.resources()`` reports registers and spills."""
    return compile_cubin(filename, list(name_expressions), arch=arch, extra_options=extra_options, verbose=True,
                         source=source)


def _cache_key(filename: str, name: str, arch: str, extra_options) -> str:
    linked = nvshmem_paths()["version"] if uses_nvshmem(filename, tuple(extra_options)) else None
    text = json.dumps([filename, name, arch, list(_OPTIONS), list(extra_options), nvrtc_version(), linked])
    return hashlib.sha1(text.encode()).hexdigest()


# What this process's get_kernel calls did (``counters()``): instantiations compiled by NVRTC (cold: not in the
# disk cache) and the seconds spent compiling, disk-cache hits (warm) and in-memory hits (already loaded).
_counters = {"compiled": 0, "compile_s": 0.0, "disk_cache_hits": 0, "memory_cache_hits": 0}


def counters() -> dict:
    """A snapshot of this process's kernel counters: ``compiled`` (instantiations compiled, the disk cache cold
    for them), ``compile_s`` (seconds in those compiles, linking included), ``disk_cache_hits`` (instantiations
    loaded from the disk cache: warm), ``memory_cache_hits`` (``get_kernel`` calls answered by an already loaded
    kernel). Subtract two snapshots to count what a stretch of code compiled."""
    with _lock:
        return dict(_counters)


def _load_or_compile(filename: str, name: str, arch: str, extra_options) -> tuple[bytes, str]:
    """Cubin and lowered name of one instantiation, from the disk cache or a fresh compile."""
    folder = cache_dir()
    key = _cache_key(filename, name, arch, extra_options)
    cubin_path, meta_path = folder / f"{key}.cubin", folder / f"{key}.json"
    if cubin_path.is_file() and meta_path.is_file():
        try:
            cached = cubin_path.read_bytes(), json.loads(meta_path.read_text())["lowered"]
            _counters["disk_cache_hits"] += 1
            return cached
        except (OSError, ValueError, KeyError):
            pass  # a damaged entry is recompiled below
    t0 = time.perf_counter()
    result = compile_cubin(filename, [name], arch=arch, extra_options=extra_options)
    _counters["compiled"] += 1
    _counters["compile_s"] += time.perf_counter() - t0
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
    supported = [a for a in _nvrtc().supported_archs() if a <= cc]
    return f"sm_{max(supported) if supported else cc}"


class Kernel:
    """A loaded kernel: ``k(grid, block, args, shared_mem=0, stream=None)``.

    Arguments are passed as CuPy passes them (arrays as pointers, numpy scalars as their C type): always
    use ``numpy.int32`` / ``numpy.float32`` / ``numpy.uint64`` for scalars."""

    def __init__(self, module, function, name: str):
        self._module = module        # keeps the CUmodule alive
        self._function = function
        self.name = name
        # The dynamic shared memory the function may take (its MAX_DYNAMIC_SHARED_SIZE_BYTES, set on demand).
        # Without the attribute, static + dynamic must fit in 48 KB, so it is set for any dynamic size, not only
        # above 48 KB: the low-latency combine (~19 KB static) failed to launch with 32-48 KB dynamic (top-k 2-3)
        # as its first call (CUDA_ERROR_INVALID_VALUE).
        self._smem_limit = 0

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
        if kernel is not None:
            _counters["memory_cache_hits"] += 1
        else:
            arch = device_arch(device_id)
            cubin, lowered = _load_or_compile(filename, name, arch, tuple(extra_options))
            module = cupy.cuda.function.Module()
            module.load(cubin)
            kernel = Kernel(module, module.get_function(lowered), name)
            _loaded[key] = kernel
    return kernel
