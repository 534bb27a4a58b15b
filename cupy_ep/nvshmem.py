"""NVSHMEM host runtime through ctypes on the ``nvidia-nvshmem-cu13`` wheel's ``libnvshmem_host.so.3``.

The unique id is made on rank 0 and broadcast over the Buffer's communicator (mpi4py or torch.distributed:
:mod:`cupy_ep.bootstrap`); every rank then initialises with it
(``nvshmemx_set_attr_uniqueid_args`` + ``nvshmemx_hostlib_init_attr``). Kernels that use the device API are
compiled relocatable and linked with ``libnvshmem_device.a`` by :mod:`cupy_ep.jit`; each loaded module then
needs :meth:`Nvshmem.init_module` (it copies the device state into the module). NVSHMEM's documentation gives
the struct layouts used here (verified against the 3.4.5 headers).

Used by the low-latency path (cuda/low_latency.py, run on GPUs) and the internode path (cuda/internode.py: one
world per GPU index over the ranks of that index; not yet run on a GPU).
"""
from __future__ import annotations

import ctypes
import os
import struct

from .errors import BackendUnavailableError, CupyEpError

_INIT_WITH_UNIQUEID = 1 << 3
_UNIQUEID_BYTES = 128
_INIT_ATTR_BYTES = 144
# version words of nvshmemx_init_attr_t, its args and uid args (NVSHMEM 3.4)
_ATTR_VERSIONS = ((0, 0x10090), (16, 0x10080), (24, 0x10018))


def _library():
    from . import jit
    path = os.path.join(os.path.dirname(jit.nvshmem_paths()["include"]), "lib", "libnvshmem_host.so.3")
    if not os.path.isfile(path):
        raise BackendUnavailableError(f"NVSHMEM host library not found at {path}")
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    lib.nvshmem_malloc.restype = ctypes.c_void_p
    lib.nvshmem_align.restype = ctypes.c_void_p
    lib.nvshmem_ptr.restype = ctypes.c_void_p
    lib.nvshmem_align.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
    lib.nvshmem_malloc.argtypes = [ctypes.c_size_t]
    lib.nvshmem_ptr.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.nvshmem_free.argtypes = [ctypes.c_void_p]
    return lib


class Nvshmem:
    """One NVSHMEM world over ``comm`` (all its ranks are PEs), on this process's current GPU.

    Use as a context manager or call :meth:`finalize`. Environment: ``NVSHMEM_DISABLE_NVLS=1`` is always
    forced (NVLink multicast is never used); on a box without an RDMA NIC set
    ``NVSHMEM_REMOTE_TRANSPORT=none``.
    """

    def __init__(self, comm, device_id: int):
        import cupy
        os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
        self.comm, self.rank, self.num_ranks = comm, comm.Get_rank(), comm.Get_size()
        self.lib = _library()
        cupy.cuda.Device(device_id).use()
        cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))  # the primary context exists before init
        uid = ctypes.create_string_buffer(_UNIQUEID_BYTES)
        if self.rank == 0:
            self._check(self.lib.nvshmemx_get_uniqueid(uid), "nvshmemx_get_uniqueid")
        self._uid = ctypes.create_string_buffer(comm.bcast(uid.raw if self.rank == 0 else None, root=0),
                                                _UNIQUEID_BYTES)  # kept alive: the attr points at it
        self._attr = ctypes.create_string_buffer(_INIT_ATTR_BYTES)
        for offset, version in _ATTR_VERSIONS:
            struct.pack_into("<i", self._attr, offset, version)
        self._check(self.lib.nvshmemx_set_attr_uniqueid_args(self.rank, self.num_ranks, self._uid, self._attr),
                    "nvshmemx_set_attr_uniqueid_args")
        self._check(self.lib.nvshmemx_hostlib_init_attr(_INIT_WITH_UNIQUEID, self._attr),
                    "nvshmemx_hostlib_init_attr")
        self._modules: list[int] = []
        self._alive = True

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise CupyEpError(f"{what} failed with code {rc}")

    def align(self, nbytes: int, alignment: int = 128) -> int:
        """Collective symmetric allocation; returns the device pointer (same offset on every PE)."""
        ptr = self.lib.nvshmem_align(alignment, nbytes)
        if not ptr:
            raise CupyEpError(f"nvshmem_align of {nbytes} bytes failed")
        return ptr

    def free(self, ptr: int) -> None:
        self.lib.nvshmem_free(ptr)

    def peer_ptr(self, ptr: int, pe: int) -> int:
        """Address of ``ptr`` on PE ``pe`` usable by loads/stores (NVLink), or 0 if only puts reach it."""
        return self.lib.nvshmem_ptr(ptr, pe) or 0

    def barrier_all(self) -> None:
        self.lib.nvshmem_barrier_all()

    def init_module(self, module_ptr: int) -> None:
        """Copy NVSHMEM's device state into a loaded CUmodule that links the device library."""
        self._check(self.lib.nvshmemx_cumodule_init(ctypes.c_void_p(module_ptr)), "nvshmemx_cumodule_init")
        self._modules.append(module_ptr)

    def finalize(self) -> None:
        if not self._alive:
            return
        for m in self._modules:
            self.lib.nvshmemx_cumodule_finalize(ctypes.c_void_p(m))
        self.lib.nvshmemx_hostlib_finalize()
        self._alive = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finalize()
        return False
