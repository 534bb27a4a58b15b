"""The tools' timing harness: inputs and routings, timers (CUDA events, CUDA graphs, steady pipelines, host
clocks), the P2P copy ceiling, the NCCL baseline, ranks that share a GPU, reports (JSON + markdown + plot files),
progress bars and the array plumbing the benchmarks and soaks share.

Everything here runs after MPI started (the command lines are in :mod:`cupy_ep.tools.cli`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .. import config as cfgmod
from .. import reference


class Tool:
    """What every benchmark shares: its arguments, its communicator, its rank and rank count, a log on rank 0."""

    def __init__(self, args, comm):
        self.args, self.comm = args, comm
        self.rank, self.R = comm.Get_rank(), comm.Get_size()

    def log(self, *a):
        if self.rank == 0:
            print(*a, flush=True)


# ------------------------------------------------------------------------------------------------------
# arrays: numpy on the host, CuPy on the GPU (bf16 crosses as its 16-bit words: CuPy has no bf16 type of its own)
# ------------------------------------------------------------------------------------------------------
def to_device(a):
    """A CuPy copy of numpy ``a`` (tuples element by element, None as None), bf16 kept as bf16."""
    if a is None:
        return None
    if isinstance(a, tuple):
        return tuple(to_device(v) for v in a)
    import cupy
    if a.dtype == reference.bfloat16:
        return cupy.asarray(a.view(np.uint16)).view(a.dtype)
    return cupy.asarray(a)


def to_host(a):
    """A numpy copy of ``a`` (a CuPy or numpy array of any dtype; tuples element by element, None as None). CuPy
    arrays cross as raw words, so that bf16 and fp8 keep their bits."""
    if a is None:
        return None
    if isinstance(a, tuple):
        return tuple(to_host(v) for v in a)
    if not hasattr(a, "get"):
        return np.asarray(a)
    import cupy
    return cupy.ascontiguousarray(raw_words(a)).get().view(a.dtype)


def raw_words(a):
    """``a`` (numpy or CuPy) viewed as unsigned words of its item size: bf16 as uint16, for copies any array
    library can do."""
    return a.view({1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}[a.dtype.itemsize])


# ------------------------------------------------------------------------------------------------------
# inputs and routings
# ------------------------------------------------------------------------------------------------------
ROUTINGS = ("uniform", "zipf:S", "hot-expert:F")
HOT_EXPERT = 0  # the expert hot-expert:F routes to (on rank 0)


def make_routing(rng, tokens: int, topk: int, experts: int, num_ranks: int, skew: float, routing: str = "uniform",
                 seed: int = 0) -> np.ndarray:
    """``[T, K] int64`` distinct experts per token, drawn from ``rng`` (this rank's) by ``routing``:

    * ``uniform``: every expert alike;
    * ``zipf:S``: expert popularity ~ 1 / k^S, k the expert's place in an order shuffled by ``seed`` (the same on
      every rank), K distinct experts drawn in proportion to it (Gumbel top-k);
    * ``hot-expert:F``: uniform, but a fraction F of the tokens pick expert ``HOT_EXPERT`` among their K.

    With probability ``skew`` a token's experts come from rank 0's range only."""
    kind, _, value = routing.partition(":")
    if kind == "zipf":
        order = np.random.default_rng(seed).permutation(experts)
        popularity = np.empty(experts)
        popularity[order] = -float(value) * np.log(np.arange(1, experts + 1))
        scores = popularity[None, :] + rng.gumbel(size=(tokens, experts))
        outside = 1e4  # well past any Gumbel spread: a skewed token stays on rank 0
    else:
        scores = rng.random((tokens, experts), dtype=np.float32)
        outside = 2.0  # the scores are in [0, 1)
    if skew > 0:
        hot = rng.random(tokens) < skew
        scores[hot, experts // num_ranks:] -= outside
    if kind == "hot-expert":
        scores[rng.random(tokens) < float(value), HOT_EXPERT] = 2.0
    return np.argsort(-scores, axis=1)[:, :topk].astype(np.int64)


def make_inputs(rank: int, num_ranks: int, tokens: int, hidden: int, topk: int, experts: int, skew: float,
                seed: int = 1234, routing: str = "uniform"):
    """This rank's inputs, drawn from ``seed + rank``: ``x [T, H] bf16``, ``(x8 [T, H] uint8 (positive finite
    e4m3 bytes), scales [T, ceil(H / 128)] float32)``, ``topk_idx [T, K] int64`` (:func:`make_routing`, its
    shared order from ``seed``) and ``topk_weights [T, K] float32``."""
    rng = np.random.default_rng(seed + rank)
    x = (rng.standard_normal((tokens, hidden), dtype=np.float32)).astype(reference.bfloat16)
    x8 = rng.integers(0, 0x7f, size=(tokens, hidden), dtype=np.uint8)  # positive finite e4m3 bytes
    scales = rng.random((tokens, -(-hidden // 128)), dtype=np.float32)
    idx = make_routing(rng, tokens, topk, experts, num_ranks, skew, routing, seed)
    w = rng.random((tokens, topk), dtype=np.float32)
    return x, (x8, scales), idx, w


def rank_loads(idx_per_rank, experts: int, num_ranks: int) -> np.ndarray:
    """``[R] int64``: tokens each rank receives in a dispatch of every rank's ``topk_idx`` (``idx_per_rank[r]``:
    ``[T_r, K]``), a token counted once per destination rank."""
    return sum(reference.token_rank_matrix(idx, experts, num_ranks).sum(axis=0).astype(np.int64)
               for idx in idx_per_rank)


def busiest_load(loads) -> float | None:
    """The busiest rank's load over the mean (1.0: balanced), or None when nothing is received."""
    loads = np.asarray(loads, dtype=np.float64)
    return float(loads.max() / loads.mean()) if loads.size and loads.mean() > 0 else None


def load_summary(loads, routing: str) -> tuple[dict, str]:
    """``({"routing", "recv_tokens_per_rank", "busiest_rank_load"}, the log line's text)`` of the tokens each rank
    receives (``loads``)."""
    loads = [int(v) for v in loads]
    load = busiest_load(loads)
    text = (f"routing {routing}: tokens received per rank {loads}, busiest rank / mean = "
            + ("-" if load is None else f"{load:.3f}"))
    return {"routing": routing, "recv_tokens_per_rank": loads, "busiest_rank_load": load}, text


# ------------------------------------------------------------------------------------------------------
# timing helpers
# ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Timing:
    median_us: float
    min_us: float


STEADY_FLOOR_US = 1e-3  # a steady per-op time is clamped here (1 ns): noise can push (ops - flush) / n <= 0


def resolved(t: Timing | None) -> Timing | None:
    """``t``, or None where it is a steady timing at the floor: the ops' graph took no longer than the flush-only
    graph (the op hides inside the flush's noise, as on a GPU shared by MPS clients), so no per-op time, and no
    GB/s from one, can be told; the reports print "-" there rather than a GB/s figure from 1 ns."""
    return None if t is None or t.median_us <= STEADY_FLOOR_US else t


class GpuTimer:
    """CUDA-event timing of ``fn`` on the current stream, L2 flushed before each iteration, ranks
    aligned by an MPI barrier; per iteration the slowest rank counts.

    ``__call__`` and ``graph`` time ONE op per iteration, started right after the barrier: for an op that
    waits for its peers the time includes the host-side skew between the ranks leaving the barrier and
    launching (tens of us). ``steady`` times ops back to back, as DeepEP does, where that skew is paid once
    per n ops."""

    def __init__(self, comm, iters: int, warmup: int):
        import cupy
        self.comm, self.iters, self.warmup = comm, iters, warmup
        self.flush = cupy.empty(256 << 20, dtype=cupy.uint8)

    def __call__(self, fn) -> Timing:
        """The call as the user makes it, on CuPy's current stream (host overhead included)."""
        import cupy
        return self._time(cupy.cuda.get_current_stream(), fn)

    def graph(self, fn, per_replay: int = 1) -> Timing:
        """Device-only time: ``fn`` captured ``per_replay`` times in one CUDA graph, replays timed right after an
        MPI barrier (no host overhead), per op. ``per_replay=2`` for low-latency calls: their two buffers
        alternate per call and the index is fixed at capture, so a graph must hold an even number of them."""
        return self._replays(fn, per_replay)

    def aligned(self, fn, align, per_replay: int = 1, spin_us: float = 30.0) -> Timing:
        """Device time from a common start: ``fn`` captured ``per_replay`` times in one CUDA graph, as ``graph``,
        but each replay is queued behind ``align(stream)`` (a device-side barrier of the ranks: NcclAllToAll.align,
        a one-int all-reduce) and a ``spin_us`` spin kernel (cuda_src/probes/timing.cu), with the start event recorded
        between the spin and the replay. Per op.

        Why: ``graph`` records its start event on an idle stream and then launches, so its span holds the host's
        submission latency and the ranks' launch skew after the MPI barrier (an op that waits for its peers waits
        that out). Here the all-reduce ends on every rank within an NVLink round trip of the last rank's arrival,
        and during the spin every host queues its replay, so the span is the op's latency when its ranks start
        together and nothing waits for a host: as inside a decode step's CUDA graph, where the step's earlier
        collectives line the ranks up. The L2 is flushed before each iteration, as in the other timings."""
        from .. import jit
        spin = jit.get_kernel("probes/timing.cu", "ep::spin_ns")

        def before(stream):
            align(stream)
            spin((1,), (1,), (np.int64(spin_us * 1e3),), stream=stream)
        return self._replays(fn, per_replay, before)

    def _replays(self, fn, per_replay: int, before=None) -> Timing:
        """``fn`` captured ``per_replay`` times in one CUDA graph (after one warm-up call), replays timed by
        ``_time`` (``before(stream)`` queued ahead of each start event), per op."""
        def ops():
            for _ in range(per_replay):
                fn()
        stream = warm_stream(self.comm, ops)
        with stream:
            graph = capture_graph(stream, ops)
        queue_first = (lambda: before(stream)) if before is not None else None
        t = self._time(stream, lambda: graph.launch(stream), before=queue_first)
        if per_replay == 1:
            return t
        self.last = self.last / per_replay
        return Timing(t.median_us / per_replay, t.min_us / per_replay)

    def steady(self, fn, n: int = 10) -> Timing:
        """Device time per op in a pipeline: ``n`` ops back to back, as DeepEP measures.

        Two CUDA graphs are captured on a non-blocking stream (``fn`` is called once first, as in ``graph``):
        *ops* = n x (L2 flush; ``fn()``) and *flush* = n x (L2 flush). Each is timed by ``_time`` (barrier,
        events around one replay, slowest rank per iteration). Per op::

            median = (median(ops) - median(flush)) / n
            min    = (min(ops)    - median(flush)) / n      (both clamped at STEADY_FLOOR_US)

        and ``self.last`` = (ops - median(flush)) / n per iteration (so percentiles still work).

        Why: ``graph`` starts one op right after the barrier, so an op that waits for its peers also waits
        out the host-side skew between the ranks' launches (tens of us), which the P2P copy ceiling (no
        waiting) never pays. Back to back, the ranks align on the first op and the later ones run in step:
        the skew is paid once per n ops. The flush keeps every op's L2 cold, as in the other timings; its
        own time is what the flush-only graph subtracts."""
        if n < 1:
            raise ValueError(f"steady: n must be >= 1, got {n}")
        stream, ops, flush = self._capture_steady(fn, n)
        self._time(stream, lambda: ops.launch(stream))
        ops_us = self.last
        self._time(stream, lambda: flush.launch(stream))
        return self._per_op(ops_us, self.last, n)

    def _capture_steady(self, fn, n: int):
        """(stream, graph of n x (flush; fn()), graph of n x flush), fn warmed up once before capturing."""
        stream = warm_stream(self.comm, fn)
        with stream:
            def ops():
                for j in range(n):
                    self.flush.fill(j & 0xff)
                    fn()

            def flushes():
                for j in range(n):
                    self.flush.fill(j & 0xff)
            return stream, capture_graph(stream, ops), capture_graph(stream, flushes)

    def _per_op(self, ops_us, flush_us, n: int) -> Timing:
        """Per-op times from the per-iteration times of the two steady graphs (see ``steady``)."""
        per_op = (np.asarray(ops_us, dtype=np.float64) - float(np.median(flush_us))) / n
        self.last = np.maximum(per_op, STEADY_FLOOR_US)
        return Timing(max(float(np.median(per_op)), STEADY_FLOOR_US), max(float(np.min(per_op)), STEADY_FLOOR_US))

    def _time(self, stream, launch, before=None) -> Timing:
        """``launch()`` timed by events on ``stream`` after an L2 flush, a device sync and an MPI barrier, per
        iteration the slowest rank; ``before()`` (``aligned``) queues work ahead of the start event."""
        import cupy
        times = []
        for i in range(self.warmup + self.iters):
            self.flush.fill(i & 0xff)
            cupy.cuda.runtime.deviceSynchronize()
            self.comm.Barrier()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            if before is not None:
                before()
            start.record(stream)
            launch()
            end.record(stream)
            end.synchronize()
            if i >= self.warmup:
                times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
        self.last = np.max(np.array(self.comm.allgather(times)), axis=0)  # slowest rank, per iteration
        return Timing(float(np.median(self.last)), float(np.min(self.last)))


def warm_stream(comm, fn):
    """A non-blocking stream on which ``fn`` ran once (compiles and allocates outside any capture), after which
    all ranks of ``comm`` met."""
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.synchronize()
    comm.Barrier()
    return stream


def capture_graph(stream, body):
    """``body()`` captured into a CUDA graph on ``stream`` (current); a failed capture is ended before raising,
    so the stream is not left capturing."""
    stream.begin_capture()
    try:
        body()
    except BaseException:
        try:
            stream.end_capture()
        except Exception:
            pass
        raise
    return stream.end_capture()


class HostTimer:
    """Host-clock timing of ``fn`` (the host backend: no device), ranks aligned by an MPI barrier; per iteration
    the slowest rank counts, ``last`` holds those times."""

    def __init__(self, comm, iters: int, warmup: int):
        self.comm, self.iters, self.warmup = comm, iters, warmup

    def __call__(self, fn) -> Timing:
        times = []
        for i in range(self.warmup + self.iters):
            self.comm.Barrier()
            t0 = time.perf_counter()
            fn()
            if i >= self.warmup:
                times.append((time.perf_counter() - t0) * 1e6)
        self.last = np.max(np.array(self.comm.allgather(times)), axis=0)  # slowest rank, per iteration
        return Timing(float(np.median(self.last)), float(np.min(self.last)))


# ------------------------------------------------------------------------------------------------------
# the ceiling and the NCCL baseline (GPU only)
# ------------------------------------------------------------------------------------------------------
def measure_ceiling(buf, timer, bytes_per_peer: int, sms_list, steady_n: int = 0) -> tuple[dict, dict]:
    """GB/s (bytes leaving this GPU / time) of the plain P2P copy kernel at several SM counts:
    ``({sms: GB/s as graph replays, one copy per replay}, {sms: GB/s by timer.steady(steady_n)})``, the second
    empty when ``steady_n`` is 0. The copy does not wait for its peers, so the two should agree; each op's
    fraction of the ceiling divides by the ceiling timed the same way as the op."""
    import cupy
    from .. import jit
    R = buf.num_ranks
    n_int4 = max(1, bytes_per_peer // 16)
    room = (buf.num_nvl_bytes - cfgmod.NOTIFY_BYTES) // (16 * R)
    n_int4 = min(n_int4, room)
    src = cupy.random.randint(0, 1 << 30, size=4 * n_int4, dtype=cupy.int32).view(cupy.int32)
    kernel = jit.get_kernel("probes/copy.cu", "ep::p2p_copy")
    graph, steady = {}, {}
    for sms in sms_list:
        def run():
            kernel((sms,), (768,), (src, buf.impl.nvl_peer_table, np.int64(cfgmod.SIGNAL_BYTES + cfgmod.NOTIFY_BYTES),
                                    np.int64(n_int4), np.int32(buf.rank), np.int32(R)))
        t = timer.graph(run)  # device time: the kernel alone, like the graph-timed ops
        graph[sms] = n_int4 * 16 * (R - 1) / (t.median_us * 1e-6) / 1e9
        t = resolved(timer.steady(run, steady_n)) if steady_n else None
        if t is not None:
            steady[sms] = n_int4 * 16 * (R - 1) / (t.median_us * 1e-6) / 1e9
    return graph, steady


def shared_gpu_ranks(gpus) -> list[list[int]]:
    """Groups of ranks (ascending) whose ``gpus[r]`` (any hashable: host and PCI bus id) is the same."""
    by_gpu: dict = {}
    for r, g in enumerate(gpus):
        by_gpu.setdefault(g, []).append(r)
    return [ranks for ranks in by_gpu.values() if len(ranks) > 1]


def shared_gpus(comm) -> list[list[int]]:
    """Collective (GPU): the groups of ranks of ``comm`` that share a GPU (CUDA MPS clients, say), by the current
    device's host and PCI bus id; empty with one GPU per rank."""
    import cupy

    from ..bootstrap import gpu_of_each_rank
    return shared_gpu_ranks(gpu_of_each_rank(comm, cupy.cuda.runtime))


SHARED_GPU_SUFFIX = "_shared_gpu"  # results of ranks sharing a GPU never take the one-GPU-per-rank files' names


def results_stem(stem: str, shared: list | None) -> str:
    """A report's file stem: ``stem``, with ``SHARED_GPU_SUFFIX`` when ranks share a GPU."""
    return stem + (SHARED_GPU_SUFFIX if shared else "")


def shared_text(shared: list) -> str:
    """``[[0, 1], [2, 3]]`` -> "ranks 0, 1 share a GPU; ranks 2, 3 share a GPU"."""
    return "; ".join(f"ranks {', '.join(map(str, g))} share a GPU" for g in shared)


def nccl_baseline(comm, shared: list) -> tuple[NcclAllToAll | None, str]:
    """Collective (GPU): the NCCL baseline and what the results say of it (their ``nccl`` field):
    ``(NcclAllToAll, "measured")``, or, where ranks share a GPU (``shared``: :func:`shared_gpus`), ``(None,
    "skipped: ranks 0, 1 share a GPU (NCCL refuses two ranks on one GPU)")``: NCCL fails such a communicator with
    NCCL_ERROR_INVALID_USAGE in its first call, so the benchmark runs without it and says so. Where a rank's CuPy
    has no NCCL (:func:`nccl_unavailable`), every rank skips it alike: ``(None, "skipped: ... (rank r)")``.

    The baseline is a communicator of its own (``cupy.cuda.nccl``, the unique id sent over ``comm``), under mpirun
    and torchrun alike: the timings launch it on CuPy streams and capture it in CuPy graphs, which takes raw NCCL
    calls, whatever backend torch.distributed's default group has."""
    if shared:
        return None, f"skipped: {shared_text(shared)} (NCCL refuses two ranks on one GPU)"
    # collective: a rank that skipped while the others waited in NcclAllToAll's bcast would hang them
    why = comm.allgather(nccl_unavailable())
    first = next(((r, w) for r, w in enumerate(why) if w), None)
    if first is not None:
        return None, f"skipped: CuPy has no usable NCCL ({first[1]}; rank {first[0]})"
    return NcclAllToAll(comm), "measured"


def nccl_unavailable() -> str | None:
    """Why this process cannot use ``cupy.cuda.nccl`` (CuPy built or installed without NCCL), or None."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        return f"cupy.cuda.nccl: {e}"
    if not getattr(nccl, "available", True):  # CuPy's module imports without libnccl and says so here
        return "cupy.cuda.nccl.available is False (install nvidia-nccl-cu12 or a CuPy with NCCL)"
    return None


def shared_gpu_warning(prog: str, shared: list, nccl: str | None) -> str:
    """The log line of a run whose ranks share a GPU (printed once, by rank 0)."""
    return (f"{prog}: RANKS SHARE A GPU ({shared_text(shared)}): the timings are HBM copies through the shared GPU, "
            "not NVLink figures" + (f"; NCCL baseline {nccl}" if nccl and nccl.startswith("skipped") else "")
            + f"; the results' file names end in {SHARED_GPU_SUFFIX}")


def shared_gpu_markdown(shared: list, nccl: str | None, extra: str = "") -> list[str]:
    """The markdown paragraph of a report whose ranks share a GPU (none without ``shared``): what its timings
    are and that NCCL was skipped (``nccl``: the ``nccl`` field), then ``extra``."""
    if not shared:
        return []
    text = (f"**Ranks share a GPU** ({shared_text(shared)}; e.g. as CUDA MPS clients): the timings are HBM copies "
            "through the shared GPU, not NVLink figures, and the copy ceiling is that of the shared GPU.")
    if nccl and nccl.startswith("skipped"):
        text += f" NCCL baseline {nccl}: no NCCL times, no ratios to NCCL (\"-\")."
    return [text + (" " + extra if extra else ""), ""]


class NcclAllToAll:
    """Grouped send/recv (cupy.cuda.nccl) of given per-peer byte counts (self-send included). Needs one GPU per
    rank (:func:`nccl_baseline` checks)."""

    def __init__(self, comm):
        from cupy.cuda import nccl
        self.nccl = nccl
        uid = comm.bcast(nccl.get_unique_id() if comm.Get_rank() == 0 else None)
        self.nc = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
        self.R, self.rank = comm.Get_size(), comm.Get_rank()
        self._one = None  # align's int (made on first use)

    def align(self, stream) -> None:
        """A device-side barrier of the ranks on ``stream``: a one-int all-reduce, which ends on every rank once
        the last rank's contribution is in (GpuTimer.aligned)."""
        import cupy
        if self._one is None:
            self._one = cupy.ones(1, dtype=cupy.int32)
        self.nc.allReduce(self._one.data.ptr, self._one.data.ptr, 1, self.nccl.NCCL_INT32, self.nccl.NCCL_MAX,
                          stream.ptr)

    def make(self, send_bytes, recv_bytes):
        import cupy
        send = [cupy.empty(max(1, int(b)), dtype=cupy.uint8) for b in send_bytes]
        recv = [cupy.empty(max(1, int(b)), dtype=cupy.uint8) for b in recv_bytes]
        nccl = self.nccl

        def run():
            stream = cupy.cuda.get_current_stream().ptr
            nccl.groupStart()
            for r in range(self.R):
                if send_bytes[r]:
                    self.nc.send(send[r].data.ptr, int(send_bytes[r]), nccl.NCCL_INT8, r, stream)
                if recv_bytes[r]:
                    self.nc.recv(recv[r].data.ptr, int(recv_bytes[r]), nccl.NCCL_INT8, r, stream)
            nccl.groupEnd()
        return run

    def make_round_trip(self, send_bytes, recv_bytes):
        """The NCCL round trip of ours: send/recv ``send_bytes`` / ``recv_bytes`` per peer, a stand-in expert step
        (a copy of every received byte, as ours copies its received rows), then the same bytes back."""
        import cupy
        there, back = self.make(send_bytes, recv_bytes), self.make(recv_bytes, send_bytes)
        received = int(np.sum(recv_bytes))
        src, dst = cupy.empty(max(1, received), dtype=cupy.uint8), cupy.empty(max(1, received), dtype=cupy.uint8)

        def run():
            there()
            cupy.copyto(dst, src)
            back()
        return run


# ------------------------------------------------------------------------------------------------------
# reports
# ------------------------------------------------------------------------------------------------------
def gpu_name() -> str:
    """The name of device 0 (CuPy's runtime)."""
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else name


def args_doc(args) -> dict:
    """The arguments as a report stores them (the shapes as dicts)."""
    return {k: ([dataclasses.asdict(s) for s in v] if k == "shapes" else v) for k, v in vars(args).items()}


def op_label(r: dict) -> str:
    """How reports name a record's op: ``op``, then " zero-copy" (normal mode, ``zero_copy``) or
    " (bf16 partials)" / " (LogFMT-10 partials)" (low-latency combine, ``partials`` "bf16" / "logfmt")."""
    return (r["op"] + (" zero-copy" if r.get("zero_copy") else "")
            + {"bf16": " (bf16 partials)", "logfmt": " (LogFMT-10 partials)"}.get(r.get("partials"), ""))


def write_files(out_dir, stem: str, doc: dict, md: str, prog: str, plot=None) -> None:
    """Write ``<out_dir>/<stem>.json`` (``doc``) and ``<stem>.md`` (``md``, also printed) and, given ``plot``
    (``plot(doc, path)``), ``<stem>.png``: a plot that fails (matplotlib missing) is said, the numbers kept."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / f"{stem}.md").write_text(md)
    print(md)
    kinds = "json/.md"
    if plot is not None:
        try:
            plot(doc, out / f"{stem}.png")
            kinds += "/.png"
        except Exception as e:
            print(f"{prog}: no plot ({e})", file=sys.stderr)
    print(f"{prog}: wrote {out}/{stem}.{kinds}")


def jit_text(c: dict) -> str:
    """Kernel counters in words: compiled and the seconds it took, from the disk cache, already loaded."""
    return (f"{c['compiled']} compiled in {c['compile_s']:.2f} s, {c['disk_cache_hits']} from the disk cache, "
            f"{c['memory_cache_hits']} already loaded")


def shape_runs_markdown(runs: list | None) -> list:
    """The report's lines on each model shape's run (``{"model", "wall_s", "jit"}`` per shape, rank 0): its wall
    time (its Buffer, the kernels the shape needs, the timings) and the kernels it compiled or loaded."""
    if not runs:
        return []
    out = ["", "Per model shape (rank 0): the wall time of its run (its Buffer, the kernels it needs, the timings) "
           "and its kernels (compiled: not in the disk cache, cold; from the disk cache: warm).", "",
           "| model | wall s | kernels |", "|---|---|---|"]
    return out + [f"| {r['model']} | {r['wall_s']:.1f} | {jit_text(r['jit'])} |" for r in runs]


def write_report(out_dir, stem: str, records: list, doc: dict, make_lines, mode: str, gpu: bool = True,
                 plot=None) -> None:
    """Stamp ``records`` with the commit and GPU (None for a host-backend run: ``gpu`` False), write
    ``<out_dir>/<stem>.json`` (those two fields, ``doc``, then ``results``) and ``<stem>.md``
    (``make_lines(common)``: the markdown lines, given the stamp) and, given ``plot`` (``plot(doc, path)`` of the
    written document), ``<stem>.png`` (:func:`write_files`); print the table. The writer of the low-latency
    and internode benchmarks."""
    common = {"commit": git_commit(), "gpu": gpu_name() if gpu else None}
    for r in records:
        r.update(common)
    write_files(out_dir, stem, dict(common, **doc, results=records), "\n".join(make_lines(common)) + "\n",
                f"cupy_ep.bench --mode {mode}", plot=plot)


def git_commit(repo: Path | None = None) -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it (``CUPY_EP_COMMIT`` wins: a copy of
    the tree on another machine may carry a stale ``.git``, whose HEAD alone would name the wrong code)."""
    if os.environ.get("CUPY_EP_COMMIT"):
        return os.environ["CUPY_EP_COMMIT"]
    here = str(repo or Path(__file__).resolve().parent.parent)
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        if not out:
            return "unknown"
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def progress(items, rank: int, desc: str, unit: str = "it"):
    """``items`` with a tqdm bar on rank 0; ``items`` itself where tqdm is not installed (an optional package: the
    bench extra). Callers check ``hasattr(bar, "set_postfix")``."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, disable=rank != 0, desc=desc, unit=unit, mininterval=5.0)
