"""The GPU low-latency (decode) path: ``LowLatencyState`` owns the transport (an NVSHMEM world and its symmetric
buffer, or a CUDA-IPC buffer), the alternating buffer index and the launches of ``cuda_src/low_latency.cu``.
``CudaBackend`` (low_latency_mode=True) creates one and delegates ``low_latency_*`` to it.

Decisions (DeepEP V1's low-latency path is the model):

* rows of a local expert are ordered (source rank, token, k), bit for bit as :mod:`cupy_ep.reference`: the
  kernels compute each message's slot from a histogram of ``topk_idx`` instead of DeepEP's atomics, so the
  output is deterministic (no sorting needed to compare, reproducible across runs);
* dispatch sends each token once per destination rank (to ``[source rank][token]`` of its recv region) plus one
  8-byte index entry per (token, k) at ``[local expert][source rank][slot]``; the receiver gathers the expert's
  rows through the index (``LowLatencyLayout`` in cuda_src/common/layout.cuh,
  :func:`cupy_ep.config.low_latency_layout`). The per-expert counts go out right after the histograms; each row is
  ready once its index entry, written after the row under a system-scope release, carries the call's epoch (the
  buffer's dispatches so far + 1, counted on the device), so no signal waits for the slowest sender block;
* combine pre-reduces on the expert side: the owner first sends every rank its top-k experts and weights
  (a few KB), each expert rank returns ONE partial sum per (token, rank) (its experts' weighted rows, k
  ascending, in fp32, rounded to 24 bits on the wire: :func:`cupy_ep.reference.low_latency_partial_wire`) instead
  of one bf16 row per (token, k), and the owner adds the partials in rank order: under 40 % of the bytes across
  NVLink at top-8 of 256 on 2 ranks, deterministic (:func:`cupy_ep.reference.low_latency_combine` defines the
  order and the roundings). ``bf16_partials=True`` makes this rank's partials cross as bf16 (a second rounding,
  a third fewer bytes), ``use_logfmt=True`` as LogFMT-10 (:mod:`cupy_ep.logfmt`: 10 bits per value, 1.3125
  bytes with the per-128 meta, 44 % of the 24-bit bytes); the owner says so in its meta flag, so each rank may
  choose for its own tokens;
* one launch per call (send and receive phases in one kernel, no grid barrier: every block is resident, grid
  = SM count); ``return_recv_hook=True`` launches the send phase only and the hook launches the receive phase;
* two buffers alternate per call (dispatch and combine alike); each signal is zeroed by the waiter that reads it,
  so a call leaves its buffer clean and repeated calls and CUDA-graph replays need no host work. A receive hook
  runs once and before the next low-latency call (``event.RecvHooks`` raises otherwise: the call after next
  reuses the hook's buffer, and peers may write it as soon as this rank's next call signalled them); do not
  change ``num_experts`` without
  :meth:`clean_low_latency_buffer`;
* transport (``Buffer(low_latency_transport=)`` or env ``CUPY_EP_LL_TRANSPORT``): ``"nvshmem"`` (default; the
  path to many nodes) or ``"ipc"``: the buffer is a ``cudaMalloc`` that every rank of the node opens over CUDA IPC
  (:class:`cupy_ep.bootstrap.IpcBuffer`), and the kernels are built without NVSHMEM (not relocatable, no device
  library: ``cuda_src/transport/ll.cuh``). Every peer is then reached by stores, so the same kernels run, without
  the NVSHMEM wheel or its start-up, and also where ranks share a GPU (NVSHMEM allows one PE per GPU only). The
  low-latency path is intranode-only either way (``CudaBackend`` refuses it across nodes);
* peers reachable over NVLink (``nvshmem_ptr`` != 0, or every peer with ``"ipc"``) get direct stores, others
  NVSHMEM puts. ``CUPY_EP_LL_FORCE_PUT=1`` (or ``state.force_put = True``) sends everything through puts (tests
  use it to cover both paths on one NVLink box; NVSHMEM transport only: IPC has no puts);
* outputs are fresh arrays allocated on the caller's stream (capturable: CuPy's pool is stream-ordered); a
  dispatch's come from two allocations (:func:`carve`): recv_x with its scales, and the count with the handle's
  arrays, each kept alive by any of its arrays; the combine's ``zero_copy`` buffer is the send region of the buffer
  the next call uses;
* ``dispatch_wait_recv_cost_stats`` / ``combine_wait_recv_cost_stats`` (``[R]`` int64) gain, per source rank,
  the SM clock cycles the receive phase waited for that rank's data (as DeepEP: the dispatch once per (local
  expert, source) count, the combine per token's partials; a rank's own partials in a one-launch combine need no
  wait and add nothing); a token naming one expert more than M times
  in total (only possible with duplicate top-k entries) loses the rows past M;
* shrink mode (``Buffer(enable_shrink=True)``, as DeepEP's): ``shrink_mask`` ``[R]`` int32 on the GPU is this
  rank's view of the failed ranks (1 = masked). The kernels read it at every launch (a CUDA-graph replay too) and
  neither send to nor wait for a masked rank; a low-latency wait that times out masks its peer instead of stopping
  the buffer (cuda_src/low_latency.cu says how, and what a masked peer may still write). A call's result is then the
  reference's on inputs where every top-k entry of a masked rank's experts is -1 and a masked rank has no tokens.
  :meth:`LowLatencyState.clean` meets only the unmasked ranks (a timed point-to-point barrier that masks a rank
  that does not come) and also restarts the buffers' alternation and epochs, so that ranks unmasked again after
  missing calls agree with the others: a rank takes part again after it is unmasked everywhere and every rank
  taking part cleaned.
"""
from __future__ import annotations

import contextlib
import math
import os

import numpy as np

from .. import config as _config
from .. import bootstrap, handles, interop, jit, validate
from ..event import EventOverlap, RecvHooks
from ..handles import LowLatencyHandle
from ..reference import LOW_LATENCY_MAX_TOPK
from . import kernels_low_latency as kll
from .kernels_low_latency import combine_stage_bytes, kernel_name
# the launchers' block and shared-memory constants, readable from here too (the CPU tests read them here)
from .kernels_low_latency import COMBINE_CHUNKS as _COMBINE_CHUNKS  # noqa: F401
from .kernels_low_latency import COMBINE_STAGE_ENTRIES  # noqa: F401
from .kernels_low_latency import COMBINE_THREADS as _COMBINE_THREADS  # noqa: F401
from .kernels_low_latency import DISPATCH_THREADS as _THREADS  # noqa: F401
from .runtime import capturing

TRANSPORTS = ("nvshmem", "ipc")
_TRANSPORT_ENV = "CUPY_EP_LL_TRANSPORT"
_FORCE_PUT_ENV = "CUPY_EP_LL_FORCE_PUT"


_UINT8, _UINT16, _INT32, _INT64, _FLOAT32 = map(np.dtype, (np.uint8, np.uint16, np.int32, np.int64, np.float32))
CARVE_ALIGN = 256  # bytes; the kernels need 16 (int4 accesses)


def carve(specs):
    """Fresh CuPy arrays of the given ``(shape, dtype)`` pairs (C-contiguous, uninitialised) over ONE allocation
    (``cupy.cuda.alloc``, the allocator ``cupy.empty`` uses, on the current stream), each at a
    ``CARVE_ALIGN``-aligned offset. Why: host time per call. Each ``cupy.empty`` takes a block from CuPy's memory
    pool (locks, the stream's free lists, two objects) and gives it back when its array dies; an array over a
    ``MemoryPointer`` into a block it is given (``ndarray.__init__`` with ``memptr``) only sets its shape, strides
    and bounds. The arrays keep the whole allocation alive while any of them lives."""
    import cupy
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        total += _config.align_up(math.prod(shape) * dtype.itemsize, CARVE_ALIGN)
    block = cupy.cuda.alloc(total)
    return [cupy.ndarray(shape, dtype, block + offset) for (shape, dtype), offset in zip(specs, offsets)]


_ALREADY_CURRENT = contextlib.nullcontext()


def allocating_on(compute, kind: interop.Kind):
    """The context in which a call allocates its outputs on the caller's stream ``compute``
    (``interop.current_stream(kind)``): that stream for torch callers; nothing for CuPy callers, whose current
    stream it already is (entering and leaving a CuPy stream costs host time, about a us, for nothing)."""
    return _ALREADY_CURRENT if kind.lib == "cupy" else compute


_WORKSPACE_INTS = 32 + _config.LL_MAX_RANKS  # kWsMetaReaders + meta readers (below: buffer index, epochs)
WS_EPOCH = 4                    # kWsEpoch: per buffer, the dispatches whose receive phase finished
# the partials' wire formats (cuda_src/low_latency/combine.cuh's Wire): 24 bits, bf16, LogFMT-10
WIRE_24, WIRE_BF16, WIRE_LOGFMT = 0, 1, 2
_SEND, _RECV = 1, 2             # kPhaseSend, kPhaseRecv
# The int32 kernel arguments that take a few values (a flag, a buffer index, the phases), made once: a numpy scalar
# costs ~0.15 us of host time to create, and a call passes about ten.
_INT32_ARGS = tuple(np.int32(i) for i in range((_SEND | _RECV) + 1))


# The build option that compiles the phase stamps into low_latency.cu's kernels (without it they have none: the
# stamps' branches and barriers take registers from the kernels' common paths).
STAMPS_OPTION = "-DCUPY_EP_LL_STAMPS=1"

# low_latency/common.cuh LLStamp, in order
STAMP_NAMES = ("send_start", "send_prepared", "send_routed", "send_encoded", "send_written", "send_end",
               "recv_start", "recv_prepared", "recv_first_data", "recv_end", "send_first_stored", "recv_copy_start",
               "recv_row_seen")


def phase_breakdown(stamps, stat=np.median) -> dict:
    """Per phase of one launch, ``stat`` (the median by default; ``np.max``: the slowest block) over blocks of
    (stamp - t0) in us, and ``last_end``: the latest stamp of any block (the launch's span as its blocks see it:
    the slowest block decides when the kernel ends, the medians do not show it), all relative to the earliest
    send_start.

    ``stamps``: numpy int64 ``[blocks][STAMP_NAMES]`` of one call (0 = not stamped: a block without work in that
    phase, or a phase that did not run). Phases no block stamped are left out."""
    stamps = np.asarray(stamps, dtype=np.int64)
    starts = stamps[:, 0][stamps[:, 0] > 0]
    if starts.size == 0:
        return {}
    t0 = int(starts.min())
    out = {}
    for i, name in enumerate(STAMP_NAMES):
        column = stamps[:, i]
        column = column[column > 0]
        if column.size:
            out[name] = float(stat(column - t0)) / 1e3
    out["last_end"] = float(stamps.max() - t0) / 1e3
    return out


check_num_rdma_bytes = validate.check_num_rdma_bytes  # (shared with the host backend)


def resolve_transport(transport: str | None) -> str:
    """``transport`` or env ``CUPY_EP_LL_TRANSPORT`` or ``"nvshmem"``; checked (the message names the argument)."""
    value = transport if transport is not None else os.environ.get(_TRANSPORT_ENV) or "nvshmem"
    if value not in TRANSPORTS:
        where = "low_latency_transport" if transport is not None else _TRANSPORT_ENV
        raise ValueError(f"{where}: must be one of {TRANSPORTS}, got {value!r}")
    return value


_NUM_BLOCKS_ENV = "CUPY_EP_LL_NUM_BLOCKS"


def resolve_num_blocks(per_rank: int) -> int:
    """The low-latency kernels' grid: ``per_rank`` (one block per SM the rank may hold), or fewer where
    ``CUPY_EP_LL_NUM_BLOCKS`` asks (testing: the kernels' paths where a block serves several tokens and experts)."""
    value = os.environ.get(_NUM_BLOCKS_ENV, "")
    if not value:
        return per_rank
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= per_rank:
        raise ValueError(f"{_NUM_BLOCKS_ENV}: must be an integer in [1, {per_rank}] (the SMs this rank may hold), "
                         f"got {value!r}")
    return n


def resolve_force_put(transport: str) -> bool:
    """Env ``CUPY_EP_LL_FORCE_PUT``: anything but unset, empty or ``"0"`` sends every peer's data through NVSHMEM
    puts; refused with the IPC transport, which has no puts (asking for them is a mistake, not a no-op)."""
    force = os.environ.get(_FORCE_PUT_ENV, "0") not in ("", "0")
    if force and transport != "nvshmem":
        raise ValueError(f"{_FORCE_PUT_ENV}: forces NVSHMEM puts, but low_latency_transport is {transport!r} "
                         "(CUDA-IPC stores only); unset it or use the 'nvshmem' transport")
    return force


def set_nvshmem_env(single_node: bool) -> None:
    """NVSHMEM settings we rely on : never NVLink multicast; on one node only P2P (no
    NIC transport), UID bootstrap over loopback. User-set values win, except NVLS which is always off."""
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    if single_node:
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
        os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")
    os.environ.setdefault("NVSHMEM_DISABLE_NCCL", "1")


_SHRINK_TAG = 1  # the shrink barrier's tokens (its communicator carries nothing else)


class LowLatencyState:
    """The low-latency transport and buffer of one ``CudaBackend``: an NVSHMEM world and its symmetric buffer, or
    a CUDA-IPC buffer opened by every rank of the node.

    Args:
        buf: the owning ``CudaBackend`` (its comm, rank, device id, health); its ``runtime`` (device, comm stream,
            DeviceCtx, launch bracketing, shrink mask) is the one the launches use.
        num_rdma_bytes: size of the buffer (:func:`cupy_ep.config.low_latency_rdma_size_hint`).
        single_node: all ranks share one host (sets the NVLink-only NVSHMEM transport by default).
        transport: ``"nvshmem"`` or ``"ipc"`` (already resolved: :func:`resolve_transport`).
    """

    # class defaults, for states the unit tests make without __init__
    transport = "nvshmem"
    _force_put = False
    nv = None      # the NVSHMEM world (transport "nvshmem")
    ipc = None     # the bootstrap.IpcBuffer (transport "ipc")
    shrink_mask = None   # shrink mode: CudaBackend's [R] int32 mask (the kernels' shrink_mask); None: off
    _shrink_comm = None  # shrink mode: clean's barrier communicator (a duplicate of the buffer's)
    _shrink_sends = ()   # shrink mode: that barrier's sends not known complete yet
    handle_epoch = 0     # dispatches made so far: the epoch of the next handle, less one (cupy_ep.handles)

    def __init__(self, buf, num_rdma_bytes: int, single_node: bool, transport: str = "nvshmem"):
        import cupy
        check_num_rdma_bytes(num_rdma_bytes)
        validate.check_low_latency_ranks(buf.num_ranks)
        self.transport = transport
        self._force_put = resolve_force_put(transport)
        # One resident block per SM this rank may hold (blocks wait for each other): the whole GPU, or under
        # CUDA MPS this rank's share of it (the ranks sharing the GPU then run at the same time).
        self.num_blocks = resolve_num_blocks(buf.sm_share.per_rank)  # before anything collective
        self.buf = buf
        self.rt = buf.runtime
        self.shrink_mask = self.rt.shrink_mask
        if self.shrink_mask is not None:
            self._shrink_comm = buf.comm.Dup()  # collective: every rank is here
        self.num_bytes = num_rdma_bytes
        if transport == "nvshmem":
            self.base, peers = self._open_nvshmem(single_node)
        else:
            self.ipc = bootstrap.IpcBuffer(buf.comm, num_rdma_bytes)  # zeroed: signals start at 0 ("not arrived")
            self.base, peers = self.ipc.ptr, self.ipc.ptrs
        mem = cupy.cuda.UnownedMemory(self.base, num_rdma_bytes, self, buf.device_id)
        self.memory = cupy.cuda.MemoryPointer(mem, 0)
        self.nvlink_peers = cupy.asarray(np.array(peers, dtype=np.uint64))
        self.no_peers = cupy.zeros(buf.num_ranks, dtype=cupy.uint64)
        # Calls with both phases and no async_finish launch on the caller's stream: without the comm stream's
        # event pair a call costs 4-9 us less host time (the benchmark; the device time did not move
        # measurably, though the pair cost 1.1 us between two bare kernels).
        # CUPY_EP_LL_COMM_STREAM=1 puts every call on the comm stream, as before (for A/B timing).
        self.direct = direct_launch_enabled()
        self.last_stream = None  # where the previous low-latency kernel was launched (ordering across streams)
        self.workspace = cupy.zeros(_WORKSPACE_INTS, dtype=cupy.int32)
        self.index = 0                             # the buffer the next call uses
        self.hooks = RecvHooks()                   # a hook runs once, before the next low-latency call
        self.signal_shape = None                   # (M, H, E) the signal regions were last cleaned for
        self.leaked: str | None = None             # why destroy() skipped the NVSHMEM teardown, if it did
        # Optional phase stamps (profiling): [dispatch, combine][block][STAMP_NAMES] int64 %globaltimer ns, written
        # when enabled (CUPY_EP_LL_STAMPS=1 or enable_stamps()) by kernels built with STAMPS_OPTION; None: the
        # kernels built without it, which have no stamping code at all.
        self.stamps = None
        if os.environ.get("CUPY_EP_LL_STAMPS", "0") not in ("", "0"):
            self.enable_stamps()
        self._kernels: dict = {}
        cupy.cuda.runtime.deviceSynchronize()
        if self.nv is not None:
            self.nv.barrier_all()
        # (IpcBuffer zeroed its memory and synchronised before its closing MPI barrier)

    def _open_nvshmem(self, single_node: bool):
        """NVSHMEM world over the buffer's comm and the symmetric buffer, zeroed: ``(base, peer addresses)``."""
        import cupy
        from ..nvshmem import Nvshmem
        set_nvshmem_env(single_node)
        # the symmetric heap must hold the buffer (NVSHMEM's default is 1 GiB); a user setting wins
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(1 << 30, _config.align_up(self.num_bytes, 1 << 21)
                                                               + (64 << 20))))
        self.nv = Nvshmem(self.buf.comm, self.buf.device_id)
        base = self.nv.align(self.num_bytes)
        cupy.cuda.runtime.memset(base, 0, self.num_bytes)  # signals start at 0 ("not arrived")
        return base, [self.nv.peer_ptr(base, r) for r in range(self.buf.num_ranks)]

    # ---- plumbing -----------------------------------------------------------------------------------
    @property
    def force_put(self) -> bool:
        """Every peer through NVSHMEM puts (read at every launch); settable, NVSHMEM transport only."""
        return self._force_put

    @force_put.setter
    def force_put(self, value: bool) -> None:
        if value and self.transport != "nvshmem":
            raise ValueError(f"force_put: the {self.transport!r} low-latency transport has no puts")
        self._force_put = bool(value)

    def enable_stamps(self) -> None:
        """Have the kernels stamp their phases (see :func:`phase_breakdown`); costs a few block barriers."""
        import cupy
        with self.rt.device:
            self.stamps = cupy.zeros((2, self.num_blocks, len(STAMP_NAMES)), dtype=cupy.int64)

    def stamps_of(self, kind: str):
        """The ``[block][STAMP_NAMES]`` stamps of the last ``"dispatch"`` or ``"combine"`` (None when off)."""
        return None if self.stamps is None else self.stamps[0 if kind == "dispatch" else 1]

    @property
    def peer_bases(self):
        """Per rank the NVLink-mapped address of its buffer, or 0 (NVSHMEM puts); all 0 with force_put."""
        return self.no_peers if self.force_put else self.nvlink_peers

    def kernel(self, name: str):
        """A low-latency kernel of this transport's build (NVSHMEM: its module initialised for this world, once);
        the stamping build while stamps are enabled."""
        key = (name, self.stamps is not None)
        k = self._kernels.get(key)
        if k is None:
            nvshmem = self.transport == "nvshmem"
            options = ((jit.NVSHMEM_DEFINE,) if nvshmem else ()) + ((STAMPS_OPTION,) if key[1] else ())
            k = jit.get_kernel(kll.LOW_LATENCY, name, extra_options=options)
            if nvshmem:
                self.nv.init_module(k._module.ptr)
            self._kernels[key] = k
        return k

    def launch(self, name: str, args, stream, shared_mem: int = 0) -> None:
        """Launch the kernel ``name`` through its launcher (:mod:`.kernels_low_latency`) with this rank's grid
        on ``stream``; ``shared_mem``: the combine's (the dispatch has none)."""
        if name.startswith(kll.COMBINE_PREFIX):
            kll.combine(self.kernel(name), args, self.num_blocks, stream, shared_mem)
        else:
            kll.dispatch(self.kernel(name), args, self.num_blocks, stream)
        self.last_stream = stream

    def prepare(self, max_tokens: int, hidden: int, num_experts: int) -> dict:
        """The layout of a call; cleans the signal regions first when the shape changed (or on first use).

        As in DeepEP the regions' offsets depend on E, so after a change of (M, H, E) the new signal regions
        may hold stale bytes of the old layout's data regions (and freshly allocated symmetric memory holds
        anything): read as counts, those would send the receivers out of bounds. Every rank makes the same
        sequence of calls, so all ranks clean here together (a collective, not capturable in a CUDA graph:
        warm up each shape before capturing it)."""
        lay = self.layout(max_tokens, hidden, num_experts)
        if self.signal_shape != (max_tokens, hidden, num_experts):
            if capturing():
                raise RuntimeError("low-latency shape (num_max_dispatch_tokens_per_rank, hidden, num_experts) = "
                                   f"{(max_tokens, hidden, num_experts)} used for the first time inside a CUDA-graph "
                                   "capture: call it once before capturing (its buffers must be cleaned first)")
            self.clean(max_tokens, hidden, num_experts)
        return lay

    # Every call needs the layout and the shape's kernel arguments of its (M, H, E); computing them costs a few us of
    # host time, so the last shape's are kept: (key, value), class defaults for states made without __init__.
    _last_layout: tuple | None = None
    _last_shape_args: tuple | None = None

    def layout(self, max_tokens: int, hidden: int, num_experts: int) -> dict:
        """The (M, H, E) layout (:func:`cupy_ep.config.low_latency_layout`), checked against the buffer's size. The
        last shape's dict is kept and returned again: read it, do not change it."""
        key = (max_tokens, hidden, num_experts)
        last = self._last_layout
        if last is not None and last[0] == key:
            return last[1]
        lay = validate.check_low_latency_rdma_bytes(self.num_bytes, max_tokens, hidden, self.buf.num_ranks, num_experts)
        self._last_layout = (key, lay)
        return lay

    def next_index(self) -> int:
        index, self.index = self.index, self.index ^ 1
        return index

    def common_args(self, index: int, max_tokens: int, hidden: int, num_experts: int):
        """The kernel arguments every low-latency kernel takes (buffer, peers, buffer index, M, H, E, rank,
        num_ranks, workspace, shrink_mask or None); the numpy scalars of the last (M, H, E) are kept. rank, num_ranks
        and shrink_mask are arguments, not read from the DeviceCtx: that load sat on the kernels' prologue
        (~0.25 us)."""
        key = (max_tokens, hidden, num_experts)
        last = self._last_shape_args
        if last is None or last[0] != key:
            last = self._last_shape_args = (key, (np.uint64(self.base), np.int32(max_tokens), np.int32(hidden),
                                                  np.int32(num_experts), np.int32(self.buf.rank),
                                                  np.int32(self.buf.num_ranks)))
        base, m, h, e, rank, num_ranks = last[1]
        return (base, self.peer_bases, _INT32_ARGS[index], m, h, e, rank, num_ranks, self.workspace,
                self.shrink_mask)

    def run(self, kind, name: str, args_for_phases, phases: int, async_finish: bool, keep, shared_mem: int = 0):
        """Launch; returns the EventOverlap.

        A call with both phases and no async_finish runs on the caller's stream itself: it is ordered after the
        caller's kernels by the stream, and the event pair to the comm stream and back costs host time (4-9 us
        a call).
        Async calls and a hook's two phases run on the communication stream bracketed by the caller's stream,
        as the normal-mode calls do (the hook's receive phase may run under another current stream than its
        send phase; the comm stream keeps them in order). Either way the kernel waits for the previous
        low-latency kernel when that was launched on another stream (:meth:`follow_last`): two low-latency
        kernels must never run at once (they share the signal regions and each needs every SM)."""
        if self.direct and not async_finish and phases == _SEND | _RECV:
            compute = interop.current_stream(kind, self.buf.device_id)
            self.follow_last(compute)
            self.launch(name, args_for_phases(phases), compute, shared_mem)
            return EventOverlap(None)
        compute = self.rt.begin(kind, None)
        self.follow_last(self.buf.comm_stream, also_skip=compute)
        self.launch(name, args_for_phases(phases), self.buf.comm_stream, shared_mem)
        return self.rt.finish(compute, async_finish, keep, kind)

    def follow_last(self, stream, also_skip=None) -> None:
        """Make ``stream`` wait for the previous low-latency kernel when it was launched on another stream
        (not needed when it was on ``also_skip``, which ``stream`` already waits for). Skipped for a stream
        that is being captured while the other is not (a graph cannot wait for work outside it, nor a stream for
        a capture's node): a replay is ordered by the stream it is launched on, like any kernel of the caller's."""
        last = self.last_stream
        if last is None or last.ptr == stream.ptr or (also_skip is not None and last.ptr == also_skip.ptr):
            return
        capturing = bool(stream.is_capturing())
        if capturing and last.ptr in _LEGACY_STREAMS:
            return  # never in a capture, and querying it during a global-mode capture is an error
        if capturing != bool(last.is_capturing()):
            return
        stream.wait_event(last.record())

    def make_hook(self, kind, name: str, args_for_phases, keep, what: str, shared_mem: int = 0):
        def run():
            with self.rt.device:
                self.buf.check_usable()
                self.run(kind, name, args_for_phases, _RECV, False, keep, shared_mem)
        return self.hooks.make(run, what)

    # ---- argument checks (same order and messages as host.backend.HostBackend) -------------------------
    # The checks are a large part of a call's host time (a profile: 40 of 176 us of a dispatch, 95 of 207 us of
    # a combine under cProfile; 4 and 8 us without it on a development CPU, where the fast path takes 1 and 3). So
    # each call kind remembers the signature of the last arguments that passed (every array's
    # interop.array_signature, every scalar's type and value: all the non-value checks read) with what the checks
    # returned, and a call with the same signature and check_values=False skips them. Any difference runs every
    # check as before (same errors, same order); value checks (check_values=True) run on every call.
    _dispatch_passed: tuple | None = None   # (signature, check_dispatch's result) of the last dispatch that passed
    _combine_passed: tuple | None = None    # (signature, check_combine's result less the raw arrays)

    def check_dispatch(self, x, topk_idx, max_tokens, num_experts, stats, wait_stats, use_fp8, round_scale,
                       use_ue8m0, async_finish, return_recv_hook, check_values: bool):
        """``(M, T, H, flags, routing)`` of a dispatch after checking its arguments (see above for when it skips
        them; ``routing``: the digest of ``topk_idx`` with ``check_values``, else None)."""
        signature = None
        if not check_values:
            sig = interop.array_signature
            # each scalar's type before its value: a value is only compared with one of the same type
            signature = (sig(x), sig(topk_idx), sig(stats), sig(wait_stats), type(max_tokens), max_tokens,
                         type(num_experts), num_experts, type(use_fp8), use_fp8, type(round_scale), round_scale,
                         type(use_ue8m0), use_ue8m0, type(async_finish), async_finish, type(return_recv_hook),
                         return_recv_hook)
            passed = self._dispatch_passed
            if passed is not None and passed[0] == signature:
                return passed[1]
        result = self._check_dispatch(x, topk_idx, max_tokens, num_experts, stats, wait_stats, use_fp8, round_scale,
                                      use_ue8m0, async_finish, return_recv_hook, check_values)
        if signature is not None:
            self._dispatch_passed = (signature, result)
        return result

    def _check_dispatch(self, x, topk_idx, max_tokens, num_experts, stats, wait_stats, use_fp8, round_scale,
                        use_ue8m0, async_finish, return_recv_hook, check_values: bool):
        return validate.check_low_latency_dispatch_args(
            x, topk_idx, max_tokens, num_experts, stats, wait_stats, use_fp8, round_scale, use_ue8m0, async_finish,
            return_recv_hook, self.buf.num_ranks, check_values, self.buf.device_id)

    def check_combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                      return_recv_hook, out, wait_stats, bf16_partials, check_values: bool):
        """``(layout_range raw, topk_slots raw, M, H, E, T, K, flags)`` of a combine after checking its arguments
        (see above for when it skips them)."""
        signature = None
        if not check_values:
            sig = interop.array_signature
            signature = (sig(x), sig(topk_idx), sig(topk_weights), handle_signature(handle), sig(out),
                         sig(wait_stats), type(use_logfmt), use_logfmt, type(zero_copy), zero_copy,
                         type(async_finish), async_finish, type(return_recv_hook), return_recv_hook,
                         type(bf16_partials), bf16_partials)
            passed = self._combine_passed
            if passed is not None and passed[0] == signature:
                # the raw views are this call's own (the same unwrap as check_low_latency_handle / _slots)
                return (interop.unwrap(handle[1]), interop.unwrap(handle.topk_slots)) + passed[1]
        result = self._check_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                     return_recv_hook, out, wait_stats, bf16_partials, check_values)
        if signature is not None:
            self._combine_passed = (signature, result[2:])
        return result

    def _check_combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                       return_recv_hook, out, wait_stats, bf16_partials, check_values: bool):
        try:
            checked = validate.check_low_latency_combine_args(
                x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook, out,
                wait_stats, bf16_partials, self.buf.num_ranks, check_values, self.buf.device_id,
                getattr(self.buf, "buffer_id", None), shrink=self.shrink_mask is not None)
        except ValueError as e:
            # The values were read back (a sync): if the dispatch that wrote them stopped at a device wait's
            # timeout they are garbage, and the timeout is what to report (a ValueError about them would hide it).
            if check_values and str(e).startswith("handle"):
                self.buf.check_health()
            raise
        _, layout_range, slots, max_tokens, hidden, num_experts, num_tokens, num_topk, flags = checked
        return layout_range, slots, max_tokens, hidden, num_experts, num_tokens, num_topk, flags

    def check_handle(self, handle, check_values: bool):
        """``(src_info raw, layout_range raw, M, H, E)`` of a low-latency dispatch handle (validate.py)."""
        try:
            return validate.check_low_latency_handle(handle, self.buf.num_ranks, check_values, self.buf.device_id)
        except ValueError:
            # The values were read back (a sync): if the dispatch that wrote them stopped at a device wait's
            # timeout they are garbage, and the timeout is what to report (a ValueError about layout_range would
            # hide it).
            if check_values:
                self.buf.check_health()
            raise

    # ---- the API ------------------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, stats, wait_stats, use_fp8,
                 round_scale, use_ue8m0, async_finish, return_recv_hook, check_values: bool):
        import cupy
        # plan
        # routing: the digest of topk_idx (check_values: from the host copy its value checks read, before launch)
        max_tokens, num_tokens, hidden, flags, routing = self.check_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, stats, wait_stats, use_fp8, round_scale,
            use_ue8m0, async_finish, return_recv_hook, check_values)
        use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook = flags
        self.hooks.check_next_call("low_latency_dispatch")
        self.prepare(max_tokens, hidden, num_experts)
        R = self.buf.num_ranks
        L, rows = num_experts // R, R * max_tokens
        kind = interop.kind_of(x)
        raw_x, raw_idx = interop.unwrap(x), interop.unwrap(topk_idx)
        raw_stats, raw_wait = interop.unwrap(stats), interop.unwrap(wait_stats)
        compute = interop.current_stream(kind, self.buf.device_id)
        # allocate
        with allocating_on(compute, kind):
            # recv_x and its scales share one allocation, the count and the handle's arrays another (small: the
            # handle, which may be kept longer, does not keep recv_x's memory alive)
            if use_fp8:
                columns = hidden // 512 if use_ue8m0 else hidden // 128
                recv_x, scales = carve((((L, rows, hidden), _UINT8),
                                        ((L, columns, rows), _INT32 if use_ue8m0 else _FLOAT32)))
            else:
                recv_x, scales = cupy.empty((L, rows, hidden), dtype=_UINT16), None
            count, src_info, layout_range, slots = carve((
                ((L,), _INT32), ((L, rows), _INT32), ((L, R), _INT64),
                (raw_idx.shape, _INT32)))  # slots: written by the send phase
        # launch (a receive hook launches the same arguments again with its own phases)
        index = self.next_index()
        ctype = "long long" if raw_idx.dtype == np.int64 else "int"
        name = kernel_name("dispatch", use_fp8, ctype, raw_idx.shape[1])
        common = self.common_args(index, max_tokens, hidden, num_experts)

        def args(phases):
            return kll.Dispatch(recv_x, scales, count, src_info, layout_range, raw_stats, raw_wait, raw_x, raw_idx,
                                slots, np.int32(num_tokens), np.int32(raw_idx.shape[1]), _INT32_ARGS[round_scale],
                                _INT32_ARGS[use_ue8m0], *common, _INT32_ARGS[phases], self.stamps_of("dispatch"),
                                self.rt.ctx)
        keep = (raw_x, raw_idx, raw_stats, raw_wait, recv_x, scales, count, src_info, layout_range, slots)
        phases = _SEND if return_recv_hook else _SEND | _RECV
        event = self.run(kind, name, args, phases, async_finish, keep)
        hook = self.make_hook(kind, name, args, keep, "low_latency_dispatch") if return_recv_hook else None
        # wrap
        out_x = interop.wrap(recv_x, kind, "float8_e4m3fn" if use_fp8 else "bfloat16")
        if scales is not None:
            out_x = (out_x, validate.last_two_transposed(
                interop.wrap(scales, kind, "int32" if use_ue8m0 else "float32"), kind))
        self.handle_epoch += 1
        handle = LowLatencyHandle((interop.wrap(src_info, kind, "int32"), interop.wrap(layout_range, kind, "int64"),
                                   max_tokens, hidden, num_experts), interop.wrap(slots, kind, "int32"),
                                  getattr(self.buf, "buffer_id", None), self.handle_epoch,
                                  routing)
        return out_x, interop.wrap(count, kind, "int32"), handle, event, hook

    def combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook,
                out, wait_stats, bf16_partials, check_values: bool):
        import cupy
        # plan
        layout_range, slots, max_tokens, hidden, num_experts, num_tokens, num_topk, flags = self.check_combine(
            x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook, out,
            wait_stats, bf16_partials, check_values)
        use_logfmt, zero_copy, async_finish, return_recv_hook, bf16_partials = flags
        wire = WIRE_LOGFMT if use_logfmt else WIRE_BF16 if bf16_partials else WIRE_24
        self.hooks.check_next_call("low_latency_combine")
        self.prepare(max_tokens, hidden, num_experts)
        kind = interop.kind_of(topk_idx)
        raw_x = interop.unwrap(x) if (x is not None and not zero_copy) else None
        raw_idx, raw_w = interop.unwrap(topk_idx), interop.unwrap(topk_weights)
        raw_wait = interop.unwrap(wait_stats)
        compute = interop.current_stream(kind, self.buf.device_id)
        # allocate
        if out is not None:
            raw_out = interop.unwrap(out)
        else:
            with allocating_on(compute, kind):
                raw_out = cupy.empty((num_tokens, hidden), dtype=cupy.uint16)
        # launch (a receive hook launches the same arguments again with its own phases)
        index = self.next_index()
        ctype = "long long" if raw_idx.dtype == np.int64 else "int"
        name = kernel_name("combine", False, ctype, num_topk)
        common = self.common_args(index, max_tokens, hidden, num_experts)

        def args(phases):
            return kll.Combine(raw_out, raw_x, layout_range, raw_idx, slots, raw_w, raw_wait, np.int32(num_tokens),
                               np.int32(num_topk), _INT32_ARGS[zero_copy], _INT32_ARGS[wire], *common,
                               _INT32_ARGS[phases], self.stamps_of("combine"), self.rt.ctx)
        keep = (raw_x, raw_idx, slots, raw_w, raw_wait, raw_out, layout_range)
        phases = _SEND if return_recv_hook else _SEND | _RECV
        smem = combine_stage_bytes(num_topk)
        event = self.run(kind, name, args, phases, async_finish, keep, smem)
        hook = self.make_hook(kind, name, args, keep, "low_latency_combine", smem) if return_recv_hook else None
        # wrap
        result = out if out is not None else interop.wrap(raw_out, kind, "bfloat16")
        return result, event, hook

    def next_combine_buffer(self, handle, kind):
        """bf16 ``[L, R*M, H]`` view of the send region of the buffer the next call uses."""
        import cupy
        _, _, max_tokens, hidden, num_experts = self.check_handle(handle, False)
        handles.check_origin(handle, getattr(self.buf, "buffer_id", None))
        lay = self.layout(max_tokens, hidden, num_experts)
        R = self.buf.num_ranks
        shape = (num_experts // R, R * max_tokens, hidden)
        offset = lay["send_offset_0"] + self.index * lay["send_bytes"]
        raw = cupy.ndarray(shape, dtype=cupy.uint16, memptr=self.memory + offset)
        return interop.wrap(raw, kind, "bfloat16")

    def clean(self, max_tokens, hidden, num_experts) -> None:
        """Collective: zero both signal and recv regions of the (M, H, E) layout on every rank (synchronous).

        Host-side, with a timeout: each rank drains its device (its low-latency kernels, their NVSHMEM puts
        included, are done), a timed MPI barrier (no rank still writes signals), zero the own regions, a
        second timed barrier (no rank signals before every rank has zeroed). A rank that never comes makes
        the others raise CommTimeoutError instead of hanging (NVSHMEM's device barrier has no timeout).
        Shrink mode: the barriers meet the unmasked ranks only and mask a rank that does not come in time
        (:meth:`shrink_barrier`); the workspace (epochs, the previous send's buffer, the meta readers' counts) is
        zeroed too and the next call uses buffer 0, on every rank that takes part."""
        max_tokens, hidden, num_experts = validate.check_low_latency_shape(max_tokens, hidden, num_experts,
                                                                           self.buf.num_ranks)
        self.hooks.check_next_call("clean_low_latency_buffer")
        lay = self.layout(max_tokens, hidden, num_experts)
        if self.last_stream is not None:
            self.last_stream.synchronize()  # this rank's last low-latency kernel (the earlier ones before it)
        self.buf.comm_stream.synchronize()
        self.timed_barrier("before zeroing")
        self.memory.memset_async(0, 2 * lay["signal_bytes"], self.buf.comm_stream)
        # and both recv regions: under a new layout their bytes could read as this call's index entries or flags
        (self.memory + lay["recv_offset_0"]).memset_async(0, 2 * lay["recv_bytes"], self.buf.comm_stream)
        if self.shrink_mask is not None:  # ranks unmasked after missing calls start where the others do
            self.workspace.data.memset_async(0, self.workspace.nbytes, self.buf.comm_stream)
            self.index = 0
        self.buf.comm_stream.synchronize()
        self.last_stream = self.buf.comm_stream  # the zeroing (done: the next kernel's wait costs nothing)
        self.timed_barrier("after zeroing")
        self.signal_shape = (max_tokens, hidden, num_experts)

    def timed_barrier(self, what: str) -> None:
        """MPI barrier over the buffer's communicator that gives up after the buffer's timeout (shrink mode:
        :meth:`shrink_barrier`)."""
        import time
        from ..errors import CommTimeoutError
        if self.shrink_mask is not None:
            return self.shrink_barrier()
        request = self.buf.comm.Ibarrier()
        deadline = time.monotonic() + self.buf.timeout_s
        while not request.Test():
            if time.monotonic() > deadline:
                record = {"rank": self.buf.rank, "kernel": "clean_low_latency_buffer", "role": f"host barrier {what}"}
                self.rt.unusable_reason = f"a peer never reached clean_low_latency_buffer: {record}"
                raise CommTimeoutError(f"rank {self.buf.rank}: peers did not reach the low-latency buffer clean "
                                       f"({what}) within {self.buf.timeout_s} s", record)
            time.sleep(20e-6)

    # ---- shrink mode (CudaBackend.low_latency_*_mask_buffer; clean's barrier) -------------------------
    def mask_stream(self):
        """The caller's current stream (no array names its framework: ``interop.caller_kind``), after the previous
        low-latency kernel; the next one follows it (follow_last): the mask's readers and writers are ordered with
        the kernels, also inside a CUDA-graph capture."""
        stream = interop.current_stream(interop.caller_kind(), self.buf.device_id)
        self.follow_last(stream)
        self.last_stream = stream
        return stream

    def update_mask(self, rank: int, masked: bool) -> None:
        with self.mask_stream():
            self.shrink_mask[rank:rank + 1].fill(1 if masked else 0)

    def clean_mask(self) -> None:
        with self.mask_stream():
            self.shrink_mask.fill(0)

    def query_mask(self, mask_status) -> None:
        kind = interop.kind_of(mask_status)
        stream = interop.current_stream(kind, self.buf.device_id)
        self.follow_last(stream)
        self.last_stream = stream
        with allocating_on(stream, kind):
            interop.unwrap(mask_status)[...] = self.shrink_mask

    def shrink_barrier(self) -> None:
        """Shrink mode's barrier of :meth:`clean` (the device is drained): a token to and from every rank unmasked
        here, over a private duplicate of the buffer's communicator; a rank whose token does not come within the
        buffer's timeout is masked (as a device wait's timeout masks its peer) and the barrier ends without it.
        A late token of a rank masked so may complete a later barrier with that rank early, once it is unmasked."""
        import time
        masked = self.shrink_mask.get()
        me, comm = self.buf.rank, self._shrink_comm
        peers = [r for r in range(self.buf.num_ranks) if r != me and not masked[r]]
        token = np.zeros(1, dtype=np.int32)
        sends = [comm.Isend(token, dest=r, tag=_SHRINK_TAG) for r in peers]
        inbox = np.zeros(max(len(peers), 1), dtype=np.int32)
        waiting = {r: comm.Irecv(inbox[i:i + 1], source=r, tag=_SHRINK_TAG) for i, r in enumerate(peers)}
        deadline = time.monotonic() + self.buf.timeout_s
        while waiting:
            for r in [r for r, request in waiting.items() if request.Test()]:
                del waiting[r]
            if waiting and time.monotonic() > deadline:
                for r, request in waiting.items():
                    request.Cancel()
                    request.Wait()
                    with self.buf.comm_stream:
                        self.shrink_mask[r:r + 1].fill(1)
                self.buf.comm_stream.synchronize()
                break
            time.sleep(20e-6)
        # (sends to a rank that never receives stay pending: kept, with their buffer, until they complete)
        self._shrink_sends = [request for request in (*self._shrink_sends, *sends) if not request.Test()]

    def free_shrink_comm(self) -> None:
        """Collective (destroy): free the shrink barrier's communicator, after every rank received the tokens sent
        to it that no barrier took (a rank that did not come, or had masked the sender): a later communicator may
        reuse its context, and must not find them."""
        if self._shrink_comm is None:
            return
        comm, self._shrink_comm = self._shrink_comm, None
        comm.Barrier()  # every rank's sends were posted before it came here
        bootstrap.drain(comm, _SHRINK_TAG)
        for request in self._shrink_sends:  # (eager: complete already; else MPI completes them in the background)
            if not request.Test():
                request.Free()
        self._shrink_sends = ()
        comm.Free()

    def destroy(self) -> None:
        """Collective: free the buffer (IPC: close the peers' mappings, then free; NVSHMEM: as follows).

        NVSHMEM: free the symmetric buffer and finalize NVSHMEM (after the device is idle).

        NVSHMEM's barrier, free and finalize are device collectives with no timeout: a rank that enters them
        while a peer cannot take part (its GPU hit a sticky error, so its NVSHMEM calls fail) waits forever.
        So each rank first drains its device, and the ranks agree over MPI (host only, no GPU involved) that
        every device is healthy; then every rank runs the NVSHMEM teardown, or none does (the symmetric heap
        is then left to process exit, a ``RuntimeWarning`` names the ranks, ``leaked`` keeps the reason). A
        buffer that is merely unusable after a device-wait timeout is torn down normally: the waiting kernel
        returned, the device and NVSHMEM are fine, and every rank is here. (A rank that never calls destroy
        cannot be told apart from a slow one, so the MPI exchange waits for it: giving up on a timer would
        let the late rank see "all healthy" and enter the NVSHMEM barrier alone.)"""
        import cupy
        self.free_shrink_comm()
        if self.ipc is not None:
            ipc, self.ipc = self.ipc, None
            self.memory = self.nvlink_peers = self.no_peers = self.workspace = None
            ipc.close()  # its MPI barrier has every rank's mappings closed before any rank frees
            return
        if self.nv is None:
            return
        reason = None
        try:
            cupy.cuda.runtime.deviceSynchronize()
        except Exception as e:  # CUDARuntimeError: a sticky device error
            reason = f"{type(e).__name__}: {e}"
        reasons = self.buf.comm.allgather(reason)
        nv, self.nv = self.nv, None
        self.memory = self.nvlink_peers = self.no_peers = self.workspace = None
        bad = {r: m for r, m in enumerate(reasons) if m}
        if bad:
            import warnings
            self.leaked = f"NVSHMEM not finalized (a device failed on rank(s) {sorted(bad)}: {bad})"
            warnings.warn(f"rank {self.buf.rank}: {self.leaked}; the symmetric heap is released at process exit",
                          RuntimeWarning, stacklevel=2)
            return
        nv.barrier_all()
        nv.free(self.base)
        nv.finalize()


def handle_signature(handle):
    """What the combine's checks read of a low-latency handle (see :func:`cupy_ep.interop.array_signature`): its
    arrays' signatures and its ints' types and values. Only a :class:`LowLatencyHandle` of five items has one;
    anything else gets a fresh object, equal to nothing, so its combine always runs the checks."""
    if type(handle) is not LowLatencyHandle or len(handle) != 5:
        return object()
    src_info, layout_range, max_tokens, hidden, num_experts = handle
    sig = interop.array_signature
    return (sig(src_info), sig(layout_range), type(max_tokens), max_tokens, type(hidden), hidden,
            type(num_experts), num_experts, sig(getattr(handle, "topk_slots", None)))


def direct_launch_enabled() -> bool:
    """False when ``CUPY_EP_LL_COMM_STREAM`` is set (not 0): every low-latency call on the comm stream."""
    return os.environ.get("CUPY_EP_LL_COMM_STREAM", "0") in ("", "0")


_LEGACY_STREAMS = (0, 1)  # the legacy default stream's handles (0, cudaStreamLegacy)


__all__ = ["LowLatencyState", "STAMP_NAMES", "phase_breakdown", "check_num_rdma_bytes", "TRANSPORTS",
           "resolve_transport", "resolve_force_put", "set_nvshmem_env", "LOW_LATENCY_MAX_TOPK", "EventOverlap"]
