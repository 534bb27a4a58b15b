"""``Runtime``: what every CUDA path of one Buffer launches with: its device, the communication stream and the
bracketing of a call on it (:meth:`Runtime.begin` / :meth:`Runtime.finish`), the DeviceCtx every kernel takes
(timeout, the host-mapped timeout record, the abort flag, the shrink mask), the health check that reads the record,
and whether the caller is capturing a CUDA graph. The backend builds one and hands it to the paths
(intranode in the backend, :mod:`.internode`, :mod:`.low_latency`).
"""
from __future__ import annotations

import functools
import sys
import time

import numpy as np

from .. import bootstrap, ids, interop, jit
from .. import config as _config
from ..errors import CallMismatchError, CommError, CommTimeoutError
from ..event import EventOverlap, HostEvent

KERNEL_NAMES, ROLE_NAMES = ids.KERNEL_NAMES, ids.ROLE_NAMES
# The CallWords a notify kernel compares (intranode/handshake.cuh, kCallWords of them): index -> name.
CALL_WORDS = ("op", "num_channels", "num_max_nvl_chunked_recv_tokens", "hidden_int4", "num_topk",
              "num_scales", "num_experts", "zero_copy_capacity")
CALL_OPS = ids.CALL_OP_NAMES
# cuda_src/common/wait.cuh TimeoutRecord (int flag, rank, kernel, role, channel, peer; 4 x int64; test_mirrors.py).
RECORD_DTYPE = np.dtype([("flag", "<i4"), ("rank", "<i4"), ("kernel", "<i4"), ("role", "<i4"),
                         ("channel", "<i4"), ("peer", "<i4"), ("head", "<i8"), ("tail", "<i8"),
                         ("expected", "<i8"), ("elapsed_ns", "<i8")])
# DeviceCtx (u64 timeout_ns, TimeoutRecord*, int* abort_flag, int rank, int num_ranks, int* shrink_mask; compared
# in tests/multirank/test_cuda_low_latency_shrink.py).
CTX_DTYPE = np.dtype([("timeout_ns", "<u8"), ("record", "<u8"), ("abort_flag", "<u8"),
                      ("rank", "<i4"), ("num_ranks", "<i4"), ("shrink_mask", "<u8")])


def capturing() -> bool:
    """True while the caller's current stream is being captured into a CUDA graph (no host syncs allowed): CuPy's,
    or torch's once torch has initialized CUDA (``torch.cuda.graph`` captures torch's current stream)."""
    import cupy
    try:
        if cupy.cuda.get_current_stream().is_capturing():
            return True
        torch = sys.modules.get("torch")
        return bool(torch is not None and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


class Runtime:
    """One Buffer's device-side plumbing (see the module docstring); made under ``device``, collective-free.

    Args:
        device_id: the GPU.
        rank, num_ranks: this rank and the group's size (the DeviceCtx's, and the error messages').
        timeout_s: every device wait's timeout.
        shrink: allocate the shrink mask (``[num_ranks]`` int32, 1 = masked; low-latency shrink mode).
    """

    def __init__(self, device_id: int, rank: int, num_ranks: int, timeout_s: float, shrink: bool):
        import cupy
        self.device_id, self.rank, self.num_ranks, self.timeout_s = device_id, rank, num_ranks, timeout_s
        self.device = cupy.cuda.Device(device_id)
        self.unusable_reason: str | None = None  # set when a wait failed: the buffer refuses every later call
        with self.device:
            self.abort = cupy.zeros(4, dtype=cupy.int32)
            # shrink mode (low-latency only): this rank's view of the failed ranks, [R] int32, 1 = masked, read and
            # written by the low-latency kernels (low_latency.LowLatencyState.update_mask and clean_mask)
            self.shrink_mask = cupy.zeros(num_ranks, dtype=cupy.int32) if shrink else None
            # host-mapped: [0] receive counter, [4..] per-expert counters, then the timeout record
            counters_bytes = 4 * (1 + _config.MAX_LOCAL_EXPERTS)
            self.host = bootstrap.HostMapped(counters_bytes + 64 + RECORD_DTYPE.itemsize)
            self.recv_counter = self.host.view(np.int32, 0, 1)
            self.expert_counters = self.host.view(np.int32, 4, _config.MAX_LOCAL_EXPERTS)
            record_offset = counters_bytes + 64 - counters_bytes % 64
            self.record = self.host.view(RECORD_DTYPE, record_offset, 1)
            ctx = np.zeros(1, dtype=CTX_DTYPE)
            ctx["timeout_ns"] = int(timeout_s * 1e9)
            ctx["record"] = self.host.ptr + record_offset
            ctx["abort_flag"] = self.abort.data.ptr
            ctx["rank"], ctx["num_ranks"] = rank, num_ranks
            ctx["shrink_mask"] = self.shrink_mask.data.ptr if self.shrink_mask is not None else 0
            #: the DeviceCtx every kernel takes (its last argument)
            self.ctx = cupy.array(ctx.view(np.uint8))
            try:
                _, high = cupy.cuda.runtime.deviceGetStreamPriorityRange()
            except AttributeError:
                high = None
            self.comm_stream = cupy.cuda.Stream(non_blocking=True, priority=high)
            self._fork_event = cupy.cuda.Event(disable_timing=True)
            self._join_event = cupy.cuda.Event(disable_timing=True)
            self.kernels: dict = {}

    def free(self) -> None:
        """Release the host-mapped memory and the device arrays (the device is idle)."""
        self.host.free()
        self.ctx = self.abort = self.shrink_mask = None

    def device_failed(self) -> bool:
        """A kernel wrote the timeout record (a host wait polls it: :meth:`check_health` then says what)."""
        return bool(int(self.record["flag"][0]))

    def check_health(self) -> None:
        """Raise ``CommTimeoutError`` if a device wait of this buffer timed out, or ``CallMismatchError`` if the
        ranks disagreed about a call (the buffer is then unusable)."""
        if self.host.ptr and int(self.record["flag"][0]):
            rec = {name: int(self.record[name][0]) for name in RECORD_DTYPE.names if name != "flag"}
            rec["kernel"] = KERNEL_NAMES.get(rec["kernel"], rec["kernel"])
            rec["role"] = ROLE_NAMES.get(rec["role"], rec["role"])
            if rec["role"] == "call_check":
                word = CALL_WORDS[rec["expected"]] if 0 <= rec["expected"] < len(CALL_WORDS) else rec["expected"]
                mine, theirs = rec["head"], rec["tail"]
                if word == "op":
                    mine, theirs = CALL_OPS.get(mine, mine), CALL_OPS.get(theirs, theirs)
                info = {"rank": rec["rank"], "kernel": rec["kernel"], "peer": rec["peer"], "word": word,
                        "mine": mine, "theirs": theirs}
                self.unusable_reason = f"the ranks disagreed about a call: {info}"
                raise CallMismatchError(f"rank {self.rank}: rank {rec['peer']} made a different call ({word}: "
                                        f"{mine} here, {theirs} there); every rank must call with the same "
                                        "config, hidden size and top-k", info)
            if rec["role"] == "buffer_reuse":  # low-latency: two send phases in a row on one buffer
                self.unusable_reason = f"low-latency buffers did not alternate: {rec}"
                raise CommError(f"rank {self.rank}: {rec['kernel']} ran on low-latency buffer {rec['head']} twice in "
                                "a row: a CUDA graph replaying an odd number of low-latency calls (the buffer index "
                                "is fixed at capture; capture dispatch + combine pairs, as in DeepEP)", rec)
            if rec["role"] == "zero_copy_capacity":  # zero-copy rows past a receiver's capacity
                what = "combine" if rec["kernel"] == "combine_direct" else "dispatch"
                self.unusable_reason = f"zero-copy {what} too large: {rec}"
                raise CommError(f"rank {self.rank}: a zero-copy {what} would put {rec['head']} rows into rank "
                                f"{rec['peer']}'s buffer, which holds {rec['tail']} (num_nvl_bytes); every rank "
                                "stopped before writing. Give Buffer more num_nvl_bytes "
                                "(Buffer.get_zero_copy_nvl_size_hint) or call without zero_copy", rec)
            if rec["role"] == "capacity":  # internode notify: num_worst_tokens smaller than what arrives
                what = "rows received over RDMA" if rec["expected"] == 1 else "received rows"
                self.unusable_reason = f"num_worst_tokens too small: {rec}"
                raise CommTimeoutError(f"rank {self.rank}: num_worst_tokens={rec['tail']} is smaller than the "
                                       f"{rec['head']} {what} of this dispatch; the buffer stopped before writing "
                                       "out of bounds (T * num_ranks is always enough)", rec)
            self.unusable_reason = f"a device wait timed out: {rec}"
            if rec["role"] == "entry":  # a zero-copy kernel's handshake: the peer never entered this call
                raise CommTimeoutError(f"rank {self.rank}: {rec['kernel']} waited {self.timeout_s} s for rank "
                                       f"{rec['peer']} to enter the same zero-copy call (it made another call, "
                                       "or did not call); every rank must make the same calls in the same order",
                                       rec)
            raise CommTimeoutError(f"rank {self.rank}: device wait timed out after {self.timeout_s} s", rec)

    def launch(self, filename: str, name: str, grid: int, block: int, args, shared_mem: int = 0) -> None:
        kernel = self.kernels.get(name)
        if kernel is None:
            kernel = self.kernels[name] = jit.get_kernel(filename, name)
        kernel((grid,), (block,), args, shared_mem=shared_mem, stream=self.comm_stream)

    def begin(self, kind: interop.Kind, previous_event):
        """Make the communication stream wait for the caller; returns the caller's stream."""
        compute = interop.current_stream(kind, self.device_id)
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event: must be an EventOverlap, got {type(previous_event).__name__}")
        event = None if previous_event is None else previous_event.event
        if event is not None and not isinstance(event, HostEvent):
            self.comm_stream.wait_event(event)
        else:  # no event to wait for (as DeepEP, which passes ``previous_event.event``): follow the caller's stream
            self._fork_event.record(compute)  # reused: the wait is enqueued before the next record
            self.comm_stream.wait_event(self._fork_event)
        return compute

    def finish(self, compute, async_finish: bool, keep_alive, kind: interop.Kind) -> EventOverlap:
        """End a call on the comm stream: the caller's stream ``compute`` waits for it, or (``async_finish``) an
        event whose ``current_stream_wait`` makes the current stream of ``kind``'s framework wait."""
        if async_finish:  # the caller holds this event: a fresh one
            return EventOverlap(self.comm_stream.record(), keep_alive, on_wait=self.check_health,
                                current_stream=functools.partial(interop.current_stream, kind, self.device_id))
        self._join_event.record(self.comm_stream)
        compute.wait_event(self._join_event)
        return EventOverlap(None)

    def wait_recv_counter(self) -> int:
        """Host wait for notify_dispatch's receive count (the only CPU sync of a non-cached dispatch)."""
        deadline = time.monotonic() + self.timeout_s + 5.0
        while True:
            value = int(self.recv_counter[0])
            if value >= 0:
                return value
            if int(self.record["flag"][0]):
                self.check_health()
            if time.monotonic() > deadline:
                self.unusable_reason = "host wait for notify_dispatch timed out"
                raise CommTimeoutError(f"rank {self.rank}: host wait for the receive count timed out after "
                                       f"{self.timeout_s} s", {"rank": self.rank, "kernel": "notify_dispatch",
                                                               "role": "host"})

