"""``BackendBase``: what the CUDA and the host backend share: the constructor's common argument checks, the
lifetime state (destroyed, unusable) and the config defaults. :class:`cupy_ep.Buffer` holds one backend; the
backends are never Buffers themselves."""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from . import config as _config
from .errors import BufferUnusableError


default_timeout_s = _config.default_timeout_s


class BackendBase:
    """One rank's backend state; the arguments as :class:`cupy_ep.Buffer`'s (checked here, for both backends)."""

    _unusable_reason: str | None = None  # why the buffer refuses every later call (a failed wait)
    #: the context a public call runs in (the CUDA backend: its device); the host backend needs none
    scope = contextlib.nullcontext()
    #: the framework this buffer serves where no array names one (``get_comm_stream``): "torch" for a buffer over a
    #: torch.distributed group, else unknown (None) until a call's arrays name one (:meth:`note_arrays`)
    framework: str | None = None

    def __init__(self, comm=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, *,
                 backend: str | None = None, device: int | None = None, timeout_s: float | None = None,
                 num_ranks_per_node: int | None = None, check_values: bool = True):
        try:
            self.timeout_s = float(timeout_s) if timeout_s is not None else default_timeout_s()
        except (TypeError, ValueError):
            raise TypeError(f"timeout_s: must be a number of seconds, got {timeout_s!r}") from None
        if not self.timeout_s > 0:  # also refuses NaN
            raise ValueError(f"timeout_s: must be positive, got {self.timeout_s}")
        from .bootstrap import as_comm, is_torch_group
        from .validate import check_comm
        self.framework = "torch" if is_torch_group(comm) else None
        comm = as_comm(comm, timeout_s=self.timeout_s)
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
        self.check_values = check_values
        self._destroyed = False

    def get_comm_stream(self):
        return None

    def note_arrays(self, x) -> None:
        """Remember the framework of a call's main array (``x``, or an FP8 pair's first item): the one a later
        call without arrays serves. Anything that is not a CuPy array or torch tensor leaves it as it was."""
        from . import interop
        lib = interop.library_of(x[0] if isinstance(x, (tuple, list)) and x else x)
        if lib is not None:
            self.framework = lib

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        from . import interop, validate
        self.check_usable()
        dtype, itemsize = interop.requested_dtype(dtype)
        region = "num_rdma_bytes" if use_rdma_buffer else "num_nvl_bytes"
        shape = validate.check_buffer_view(getattr(self, region), itemsize, size, offset, region)
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        return interop.view_bytes(self._buffer_bytes(offset, nbytes, bool(use_rdma_buffer)), dtype, shape)

    def _buffer_bytes(self, offset: int, nbytes: int, rdma: bool):
        """``nbytes`` bytes at ``offset`` of this rank's NVLink (or RDMA) buffer as a 1-D uint8 array."""
        raise NotImplementedError

    def check_usable(self) -> None:
        """Raise ``BufferUnusableError`` if this buffer was destroyed or a failed wait stopped it."""
        if self._destroyed:
            raise BufferUnusableError("this Buffer was destroyed; create a new one")
        if self._unusable_reason:
            raise BufferUnusableError(f"this Buffer is unusable: {self._unusable_reason}")

    def destroy(self) -> None:
        self._destroyed = True

    def _resolve_config(self, config, kind: str, hidden_bytes: int, num_channels: int | None = None
                        ) -> _config.Config:
        """``config`` checked, or the default for ``kind``. ``num_channels``: a channel count the call must
        use (an internode combine takes its dispatch handle's); an intranode combine has its own."""
        if config is None:
            getter = _config.get_dispatch_config if kind == "dispatch" else _config.get_combine_config
            cfg = getter(self.num_ranks, _config.default_num_sms(), hidden_bytes)
            if num_channels is not None and cfg.num_channels != num_channels:
                cfg = dataclasses.replace(cfg, num_sms=2 * num_channels)
            return cfg
        if not isinstance(config, _config.Config):
            raise TypeError(f"config: must be a cupy_ep.Config, got {type(config).__name__}")
        return config
