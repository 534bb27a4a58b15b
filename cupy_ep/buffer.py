"""``Buffer``: the public entry point (DeepEP V1 API).

``Buffer(...)`` picks a backend: the CUDA path (``CudaBuffer`` in this file: CUDA IPC buffers, a
high-priority communication stream, kernels from ``cuda_src/``) when a GPU is present, the numpy + MPI
``HostBuffer`` (host/backend.py) when not. ``backend="cuda"|"host"`` forces the choice and
``buf.backend`` says which one runs.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import warnings

import numpy as np

from . import config as _config
from . import event as _event
from .errors import BackendUnavailableError, BufferUnusableError


def gpu_available() -> bool:
    """True when CuPy can see at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no libcuda, no cupy: all mean "no GPU"
        return False


def _choose_backend(backend: str | None) -> str:
    backend = backend or os.environ.get("CUPY_EP_BACKEND") or None
    if backend not in (None, "cuda", "host"):
        raise ValueError(f"backend: must be 'cuda', 'host' or None, got {backend!r}")
    if backend == "cuda" and not gpu_available():
        raise BackendUnavailableError("backend='cuda' was asked for, but CuPy sees no GPU here")
    if backend is None:
        backend = "cuda" if gpu_available() else "host"
    return backend


def default_timeout_s() -> float:
    return float(os.environ.get("CUPY_EP_TIMEOUT_S", "100"))


class Buffer:
    """Expert-parallel communication buffer of one rank (DeepEP V1 compatible).

    Args:
        comm: mpi4py communicator of the expert-parallel group (default ``MPI.COMM_WORLD``).
        num_nvl_bytes: bytes of the NVLink (CUDA IPC) buffer; size it with
            ``Config.get_nvl_buffer_size_hint`` or :meth:`get_nvl_buffer_size_hint`.
        num_rdma_bytes: bytes of the NVSHMEM symmetric buffer; 0 for the intranode normal mode, and at
            least :meth:`get_low_latency_rdma_size_hint` with ``low_latency_mode=True``.
        low_latency_mode: also set up the low-latency (decode) path: NVSHMEM is initialised over ``comm``
            and ``low_latency_dispatch``/``low_latency_combine`` become available (the normal-mode calls
            keep working when ``num_nvl_bytes`` is given too). Two buffers alternate per low-latency call;
            a CUDA graph fixes the buffer at capture, so a graph must hold an even number of low-latency
            calls (dispatch + combine pairs, as in DeepEP): an odd number is refused on the device at the
            second replay with a ``CommError``.
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy: accepted for
            DeepEP compatibility.
        enable_shrink: with ``low_latency_mode``, DeepEP's shrink mode: a rank that times out in a low-latency call
            is masked and left out of the later ones (``low_latency_update_mask_buffer`` / ``_query_`` /
            ``_clean_mask_buffer``).
        backend: ``"cuda"``, ``"host"`` or None (auto: cuda when a GPU is visible).
        device: GPU ordinal; default the rank on this machine modulo the visible GPUs.
        timeout_s: timeout in seconds of every wait for another rank (device waits; host waits on the host
            backend), default ``CUPY_EP_TIMEOUT_S`` or 100.
        num_ranks_per_node: GPUs per NVLink domain (default: the MPI shared-memory split). When the ranks span
            more than one such domain, the internode path runs (cupy_ep/cuda/internode.py).
        internode_transport: ``"nvshmem"`` (default; env ``CUPY_EP_INTERNODE_TRANSPORT``) or ``"ipc"`` (the RDMA
            domain through CUDA-IPC stores: for testing several "nodes" on one box). CUDA backend only.
        low_latency_transport: ``"nvshmem"`` (default; env ``CUPY_EP_LL_TRANSPORT``) or ``"ipc"``: the
            low-latency buffer as a CUDA-IPC allocation opened by every rank of the node instead of NVSHMEM
            symmetric memory. The same kernels (every peer by NVLink stores), no NVSHMEM wheel or start-up, and
            ranks may share a GPU; one node only (as the low-latency path is either way). CUDA backend only.
        check_values: check ``topk_idx`` values on the host (costs a device sync; off for benchmarks). With
            False, a low-latency call whose arguments look like the last ones that passed (types, dtypes, shapes,
            contiguity, device, scalar values) also skips re-checking them (host time per call).
    """

    #: SMs used by dispatch/combine unless a Config says otherwise (even; Config explains how they are used).
    num_sms: int = 20

    def __new__(cls, *args, backend: str | None = None, **kwargs):
        if cls is Buffer:
            if _choose_backend(backend) == "host":
                from .host.backend import HostBuffer
                return super().__new__(HostBuffer)
            return super().__new__(CudaBuffer)
        return super().__new__(cls)

    def __init__(self, comm=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, *,
                 backend: str | None = None, device: int | None = None, timeout_s: float | None = None,
                 num_ranks_per_node: int | None = None, check_values: bool = True):
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        from .validate import check_comm
        check_comm(comm)
        self.comm = comm
        self.rank = comm.Get_rank()
        self.num_ranks = comm.Get_size()
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be a non-negative int, got {value!r}")
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        try:
            self.timeout_s = float(timeout_s) if timeout_s is not None else default_timeout_s()
        except (TypeError, ValueError):
            raise TypeError(f"timeout_s: must be a number of seconds, got {timeout_s!r}") from None
        if not self.timeout_s > 0:  # also refuses NaN
            raise ValueError(f"timeout_s: must be positive, got {self.timeout_s}")
        self.check_values = check_values
        self._destroyed = False
        self._unusable_reason: str | None = None

    # ---- class-level knobs (DeepEP API) -------------------------------------------------------------
    @classmethod
    def set_num_sms(cls, new_num_sms: int) -> None:
        """Set the SMs dispatch/combine use by default (even, >= 2)."""
        if not isinstance(new_num_sms, int) or new_num_sms < 2 or new_num_sms % 2:
            raise ValueError(f"new_num_sms: must be an even int >= 2, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int, hidden_bytes: int | None = None) -> _config.Config:
        return _config.get_dispatch_config(num_ranks, Buffer.num_sms, hidden_bytes)

    @staticmethod
    def get_combine_config(num_ranks: int, hidden_bytes: int | None = None) -> _config.Config:
        return _config.get_combine_config(num_ranks, Buffer.num_sms, hidden_bytes)

    @staticmethod
    def get_nvl_buffer_size_hint(hidden_bytes: int, num_ranks: int) -> int:
        """``num_nvl_bytes`` that the default dispatch and combine configs need for this hidden size."""
        return max(Buffer.get_dispatch_config(num_ranks, hidden_bytes).get_nvl_buffer_size_hint(hidden_bytes, num_ranks),
                   Buffer.get_combine_config(num_ranks, hidden_bytes).get_nvl_buffer_size_hint(hidden_bytes, num_ranks))

    @staticmethod
    def get_zero_copy_nvl_size_hint(num_max_tokens_per_rank: int, hidden_bytes: int, num_ranks: int,
                                    num_topk: int = 8) -> int:
        """``num_nvl_bytes`` for zero-copy dispatch and combine (``zero_copy=True``) of up to
        ``num_max_tokens_per_rank`` tokens on every rank: a dispatch may receive all ranks' tokens, a combine
        receives each of the owner's tokens once per rank. ``hidden_bytes`` as in
        :meth:`get_nvl_buffer_size_hint` (BF16 rows; FP8 rows with their scales are smaller). At least the
        ring hint of the default configs."""
        t, r = num_max_tokens_per_rank, num_ranks
        scales = -(-(hidden_bytes // 2) // 128)
        zero_copy = max(_config.direct_dispatch_bytes(256, r * t, hidden_bytes, num_topk, 0),
                        _config.direct_dispatch_bytes(256, r * t, hidden_bytes // 2, num_topk, scales),
                        _config.direct_combine_bytes(r, t, hidden_bytes, num_topk))
        return max(_config.align_up(_config.NOTIFY_BYTES + zero_copy),
                   Buffer.get_nvl_buffer_size_hint(hidden_bytes, num_ranks))

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """``num_rdma_bytes`` the low-latency kernels need (DeepEP's hint, sized for BF16 rows; the host backend
        itself needs none): :func:`cupy_ep.config.low_latency_rdma_size_hint`. Callable before any Buffer exists.

        Args:
            num_max_dispatch_tokens_per_rank: M, the most tokens any rank dispatches in one call (the same on
                every rank).
            hidden: H, the hidden size.
            num_ranks: the ranks of the expert-parallel group.
            num_experts: E, all experts.

        Returns:
            int, bytes."""
        return _config.low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                  num_experts)

    @staticmethod
    def capture() -> _event.EventOverlap:
        """An ``EventOverlap`` recorded on the caller's current stream (DeepEP's ``Buffer.capture()``, for
        ``previous_event=``): torch's ``torch.cuda.current_stream()`` for torch users, CuPy's current stream for
        CuPy users (:func:`cupy_ep.interop.caller_kind` says how it tells them apart); its
        ``current_stream_wait()`` makes that framework's current stream wait. Without a GPU, or with
        ``CUPY_EP_BACKEND=host``: a complete :class:`~cupy_ep.event.HostEvent` (the host backend's calls are
        synchronous)."""
        if _choose_backend(None) == "host":
            return _event.EventOverlap(_event.HOST_EVENT)
        return _event.capture()

    @staticmethod
    def is_sm90_compiled() -> bool:
        """DeepEP compatibility: whether the kernels use the SM90 features (TMA bulk copies, mbarriers). cupy_ep
        compiles them at run time for the GPU it runs on, so this is True when the current GPU has compute
        capability 9.0 or newer, False without a GPU (the host backend)."""
        if not gpu_available():
            return False
        import cupy
        return int(cupy.cuda.Device().compute_capability) >= 90

    # ---- raw access (DeepEP API) ----------------------------------------------------------------------
    def get_comm_stream(self):
        """The stream the communication kernels run on (``async_finish`` calls, hooks), in the caller's framework:
        a ``torch.cuda.ExternalStream`` for torch users, the ``cupy.cuda.Stream`` for CuPy users (as
        :meth:`capture` tells them apart; ``buf.comm_stream`` is always the CuPy one); None on the host backend,
        which runs every call synchronously on the host."""
        return None

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        """A view of this rank's own communication buffer, as DeepEP's: the ``num_nvl_bytes`` NVLink buffer, or
        with ``use_rdma_buffer`` the ``num_rdma_bytes`` one (low-latency or internode). For tests and custom
        kernels: the next call may overwrite it, and writing it while a call runs corrupts that call.

        Args:
            dtype: numpy / CuPy dtype, or a torch dtype (then a torch tensor comes back).
            size: element count or shape; default: every whole element from ``offset`` to the buffer's end.
            offset: bytes from the start of the buffer (a multiple of the dtype's size).

        Returns:
            ``[size]`` (or ``size``-shaped) array of ``dtype`` on the buffer's GPU (CUDA backend), or over host memory
            that lives as long as the Buffer (host backend, which has no device buffer; zeroed at first use)."""
        from . import interop, validate
        self._check_usable()
        dtype, itemsize = interop.requested_dtype(dtype)
        region = "num_rdma_bytes" if use_rdma_buffer else "num_nvl_bytes"
        shape = validate.check_buffer_view(getattr(self, region), itemsize, size, offset, region)
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        return interop.view_bytes(self._buffer_bytes(offset, nbytes, bool(use_rdma_buffer)), dtype, shape)

    def _buffer_bytes(self, offset: int, nbytes: int, rdma: bool):
        """``nbytes`` bytes at ``offset`` of this rank's NVLink (or RDMA) buffer as a 1-D uint8 array."""
        raise NotImplementedError

    # ---- lifetime -----------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._destroyed:
            raise BufferUnusableError("this Buffer was destroyed; create a new one")
        if self._unusable_reason:
            raise BufferUnusableError(f"this Buffer is unusable: {self._unusable_reason}")

    def destroy(self) -> None:
        """Release everything (collective: every rank must call it)."""
        self._destroyed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.destroy()
        return False

    def _resolve_config(self, config, kind: str, hidden_bytes: int, num_channels: int | None = None
                        ) -> _config.Config:
        """``config`` checked, or the default for ``kind``. ``num_channels``: a channel count the call must
        use (an internode combine takes its dispatch handle's); an intranode combine has its own."""
        if config is None:
            getter = _config.get_dispatch_config if kind == "dispatch" else _config.get_combine_config
            cfg = getter(self.num_ranks, Buffer.num_sms, hidden_bytes)
            if num_channels is not None and cfg.num_channels != num_channels:
                cfg = dataclasses.replace(cfg, num_sms=2 * num_channels)
            return cfg
        if not isinstance(config, _config.Config):
            raise TypeError(f"config: must be a cupy_ep.Config, got {type(config).__name__}")
        return config


from .cuda.backend import CudaBuffer  # noqa: E402  (defined after Buffer, which it subclasses)


def _warn_host_backend(rank: int) -> None:
    if rank == 0:
        warnings.warn("cupy_ep: no GPU visible, using the host (numpy + MPI) backend", stacklevel=3)
        print("cupy_ep: no GPU visible -> host backend (numpy + MPI alltoallv)", file=sys.stderr)
