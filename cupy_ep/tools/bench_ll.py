"""``python -m cupy_ep.bench --mode low-latency``: low-latency (decode) dispatch and combine latency.

Defaults: 128 tokens per rank, hidden 7168, top-8 of 256 experts, FP8 dispatch, BF16 combine.
Per op: median and p99 over ``--iters`` (>= 200) iterations, timed three ways (field ``timing``):

* ``call``: CUDA events around the Python call (host overhead included);
* ``graph``: two ops per CUDA-graph replay (the two buffers alternate per call and the index is fixed at
  capture: a graph must hold an even number of low-latency calls, and the kernels refuse two sends in a row on
  one buffer), started right after an MPI barrier, per op; the ranks' launch skew is paid once per 2 ops;
* ``steady``: ``--steady-n`` ops (rounded up to even) back to back per replay, alternating the two buffers as in
  real use (each call's receive completes before the call after next), L2 flushed before each, minus a
  flush-only graph, divided by n (:meth:`cupy_ep.tools.harness.GpuTimer.steady`): device latency per op in a pipeline,
  the ranks' launch skew paid once per n ops.

NCCL grouped send/recv of the same per-peer bytes is measured in the same run: as graph replays for the call and
graph rows, steady for the steady rows. Further records: a steady token sweep (``--ll-token-sweep``: T tokens per
rank at the same max M, ``--ll-max-tokens`` (default ``--tokens``); T = 0 is the fixed cost) and the host time per call
(timing ``host``: 200 plain calls back to back, with ``check_values`` False and True), and with ``--ll-stamps`` where a
call's time goes (timing ``stamps``: the kernels' %globaltimer phase stamps, ``phases_us``). Results are verified
against :mod:`cupy_ep.reference` before any timing (a mismatch aborts). Records are written to
``<out>/bench_ll_gpu_ep<R>.json`` and ``.md``, and a plot of each model shape's ops to ``.png`` (where matplotlib
is installed: :func:`plot`). One run covers each ``--model`` shape the kernels take (a top-k above
``LOW_LATENCY_MAX_TOPK`` is reported as skipped). On the host backend (``--backend host``) the calls are verified and
timed by the host clock only (``bench_ll_host_ep<R>``).

Where ranks share a GPU (CUDA MPS clients) NCCL refuses to run: the benchmark then runs without the NCCL baseline
and without the aligned timing (which lines the ranks up by an NCCL all-reduce), says so in its log and report
(``nccl``, ``aligned``, ``shared_gpu_ranks``), and names the files ``..._shared_gpu``.
"""
from __future__ import annotations

import time

import numpy as np

from cupy_ep import Buffer, bootstrap, reference
from cupy_ep import config as cfgmod
from . import harness
from .harness import (GpuTimer, HostTimer, capture_graph, make_routing, nccl_baseline, op_label, raw_words,
                      results_stem, shared_gpu_markdown, shared_gpu_warning, shared_gpus, shared_text, to_device,
                      to_host, warm_stream, write_report)

HOST_CALLS = 200  # plain calls per host-overhead measurement
# why a run without NCCL has no aligned timing (its log and report say so)
ALIGNED_WHY = ("it lines the ranks up by a one-int NCCL all-reduce, and the NCCL baseline is skipped (Buffer.barrier "
               "is no substitute: it waits on the host, so the ranks' device starts would not line up)")


class LatencyTimer(GpuTimer):
    """GpuTimer; its ``last`` holds the per-iteration times (slowest rank per iteration) for percentiles."""

    def p99(self) -> float:
        return float(np.percentile(self.last, 99))


class HostLatencyTimer(HostTimer):
    """HostTimer (the host backend) with the percentile of :class:`LatencyTimer`."""
    p99 = LatencyTimer.p99


def _selections_per_rank(idx: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """Top-k slots of this rank's tokens per destination rank (one message each)."""
    valid = idx[idx >= 0]
    return np.bincount(valid // (num_experts // num_ranks), minlength=num_ranks)


def op_bytes(per_rank: np.ndarray, rank: int, hidden: int) -> dict:
    """``{op: (logical bytes, NVLink bytes)}`` of this rank's low-latency calls, as DeepEP's low-latency test
    counts them: each top-k selection of this rank's tokens is one message (``per_rank[r]``: selections bound
    for rank r), FP8 dispatch messages of ``hidden + hidden / 128 * 4 + 16`` bytes, BF16 rows of ``2 * hidden``
    bytes back in the combine; logical counts every selection, the own rank's included, NVLink only those of
    other ranks. The round trip moves a BF16 dispatch and a combine."""
    total, other = int(per_rank.sum()), int(per_rank.sum() - per_rank[rank])
    fp8, bf16 = hidden + hidden // 128 * 4 + 16, 2 * hidden
    combine = (total * bf16, other * bf16)
    return {"ll_dispatch": (total * fp8, other * fp8), "ll_combine": combine, "ll_combine_bf16p": combine,
            "ll_combine_logfmt": combine, "ll_round_trip": (2 * total * bf16, 2 * other * bf16)}


def even_steady_n(n: int) -> int:
    """``--steady-n`` rounded up to even: a graph of an odd number of low-latency calls would start every other
    replay on the buffer whose signals the previous call did not clear."""
    return n + (n & 1)


def host_us_per_call(comm, fn, calls: int, sync) -> tuple[float, float]:
    """Host time of ``fn``: ``calls`` plain calls back to back (no sync inside the loop) after one device sync
    (``sync()``) and an MPI barrier. Returns ``(host, wall)`` us per call, the slowest rank's: ``host`` = the loop
    alone (the Python and launch cost of a call), ``wall`` = until the device has finished them too."""
    sync()
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    comm.Barrier()
    host, wall = np.max(np.array(comm.allgather(((t1 - t0) * 1e6 / calls, (t2 - t0) * 1e6 / calls))), axis=0)
    return float(host), float(wall)


class LowLatencyBench(harness.Tool):
    """The low-latency benchmark of one model shape (``args.hidden``, ``args.topk``, ``args.experts``; ``args.shape``
    names it): :func:`main` runs one per ``--model`` shape."""

    def __init__(self, args, comm):
        super().__init__(args, comm)
        a = args
        self.M = max_tokens(a)
        self.steady_n = even_steady_n(a.steady_n)
        rdma = cfgmod.low_latency_rdma_size_hint(self.M, a.hidden, self.R, a.experts)
        self.buf = Buffer(comm, num_rdma_bytes=rdma, low_latency_mode=True, check_values=False,
                          backend="host" if getattr(a, "backend", None) == "host" else "cuda",
                          low_latency_transport=getattr(a, "ll_transport", None))
        self.gpu = self.buf.backend == "cuda"
        self.transport = self.buf.impl.low_latency_transport if self.gpu else "host"
        self.records: list[dict] = []
        # run() opens the NCCL baseline (GPU)
        self.nccl, self.nccl_status, self.shared = None, None if self.gpu else "not measured: the host backend", []

    def sync(self) -> None:
        """Wait for the device (nothing to wait for on the host backend)."""
        if self.gpu:
            import cupy
            cupy.cuda.runtime.deviceSynchronize()

    def dev(self, a):
        return to_device(a) if self.gpu else a

    def inputs(self, tokens: int):
        """This rank's ``tokens`` tokens: bf16 x, distinct top-k experts by ``--routing``, weights (numpy)."""
        a = self.args
        rng = np.random.default_rng(a.seed + self.rank)
        x = rng.standard_normal((tokens, a.hidden), dtype=np.float32).astype(reference.bfloat16)
        idx = make_routing(rng, tokens, a.topk, a.experts, self.R, 0.0, a.routing, a.seed)
        w = rng.random((tokens, a.topk), dtype=np.float32)
        return x, idx, w

    def verify(self, x, idx, w, dispatch_out, combined, y, combined_bf16p, combined_logfmt=None):
        """Abort the job unless dispatch and the combines (24-bit, bf16 and, when given, LogFMT-10 partials) equal
        the reference bit for bit."""
        a = self.args
        (data, scales), count, handle = dispatch_out
        gathered = self.comm.allgather((x, idx, w, y))
        want = reference.low_latency_dispatch([g[0] for g in gathered], [g[1] for g in gathered], self.M,
                                              a.experts, self.rank, use_fp8=True)
        ok = np.array_equal(to_host(count), want.recv_count)
        data, scales, src = to_host(data), to_host(scales), to_host(handle[0])
        for e, n in enumerate(want.recv_count):
            ok &= np.array_equal(data[e, :n].view(np.uint8), want.recv_x[e, :n])
            ok &= np.array_equal(scales[e, :n], want.recv_x_scales[e, :n])
            ok &= np.array_equal(src[e, :n], want.src_info[e, :n])
        for got, wire in ((combined, {}), (combined_bf16p, {"bf16_partials": True}),
                          (combined_logfmt, {"use_logfmt": True})):
            if got is None:
                continue
            want_c = reference.low_latency_combine([g[3] for g in gathered], [g[1] for g in gathered],
                                                   [g[2] for g in gathered], self.M, a.experts, self.rank, **wire)
            ok &= np.array_equal(to_host(got).view(np.uint16), want_c.view(np.uint16))
        if not bootstrap.allreduce(self.comm, bool(ok), "land"):
            self.log("cupy_ep.bench_ll: VERIFICATION FAILED against cupy_ep.reference")
            self.comm.Abort(2)
        self.log("  verified against cupy_ep.reference: low-latency dispatch (fp8) and combine (24-bit, bf16"
                 + (" and LogFMT-10" if combined_logfmt is not None else "") + " partials): OK")

    def ops(self, x, idx, w, y, handle, idx_np) -> dict:
        """``{label: (fn, nccl_fn, dtype)}``: the FP8 dispatch of ``x`` and the combine of ``y`` with the fixed
        ``handle`` (24-bit partials; ``ll_combine_bf16p``: ``bf16_partials=True``; ``ll_combine_logfmt``:
        ``use_logfmt=True``), each with NCCL grouped send/recv of its per-peer bytes (collective: every rank calls
        it; ``nccl_fn`` None without the NCCL baseline, ``self.nccl`` None). Records name the op and the partials
        (:func:`_op_fields`). ``ll_round_trip``: a BF16 dispatch, a stand-in expert step (the received rows copied
        into the expert output) and the combine of it, back to back with no host sync (NCCL: the same bytes there,
        the same copy, and back). Sets ``self.op_bytes`` (:func:`op_bytes`)."""
        a, R, buf = self.args, self.R, self.buf
        per_rank = _selections_per_rank(idx_np, a.experts, R)
        self.op_bytes = op_bytes(per_rank, self.rank, a.hidden)
        dispatch_bytes = combine_bytes = round_trip_bytes = (None, None)
        if self.nccl is not None:
            recv_per_rank = np.array(self.comm.alltoall([int(v) for v in per_rank]))
            msg_fp8 = a.hidden + a.hidden // 128 * 4 + 16
            dispatch_bytes = (per_rank * msg_fp8, recv_per_rank * msg_fp8)
            combine_bytes = (recv_per_rank * 2 * a.hidden, per_rank * 2 * a.hidden)
            round_trip_bytes = (per_rank * 2 * a.hidden, recv_per_rank * 2 * a.hidden)

        def nccl(sizes):
            return self.nccl.make(*sizes) if self.nccl is not None else None
        expert_out = {}  # the round trip's expert output, made by its first (uncaptured) call

        def round_trip():
            recv_x, _, h, _, _ = buf.low_latency_dispatch(x, idx, self.M, a.experts, use_fp8=False)
            if "y" not in expert_out:
                expert_out["y"] = raw_words(recv_x).copy()
            if self.gpu:
                import cupy
                cupy.copyto(expert_out["y"], raw_words(recv_x))
            else:
                np.copyto(expert_out["y"], raw_words(recv_x))
            return buf.low_latency_combine(expert_out["y"].view(recv_x.dtype), idx, w, h)
        return {
            "ll_dispatch": (lambda: buf.low_latency_dispatch(x, idx, self.M, a.experts, use_fp8=True),
                            nccl(dispatch_bytes), "fp8"),
            "ll_combine": (lambda: buf.low_latency_combine(y, idx, w, handle), nccl(combine_bytes), "bf16"),
            "ll_combine_bf16p": (lambda: buf.low_latency_combine(y, idx, w, handle, bf16_partials=True),
                                 nccl(combine_bytes), "bf16"),
            "ll_combine_logfmt": (lambda: buf.low_latency_combine(y, idx, w, handle, use_logfmt=True),
                                  nccl(combine_bytes), "bf16"),
            "ll_round_trip": (round_trip, self.nccl.make_round_trip(*round_trip_bytes) if self.nccl is not None
                              else None, "bf16"),
        }

    def timed(self, timer, fn, how: str):
        """``(Timing, p99 us)`` of ``fn`` timed ``how`` ("call", "graph", "aligned" or "steady")."""
        if how == "call":
            t = timer(fn)
        elif how == "graph":
            t = timer.graph(fn, per_replay=2)
        elif how == "aligned":
            t = timer.aligned(fn, self.nccl.align, per_replay=2)
        else:
            t = timer.steady(fn, self.steady_n)
        return t, timer.p99()

    def time_nccl(self, timer, nccl_fn, how: str):
        """NCCL's ``(Timing, p99)`` timed ``how``, or ``(None, None)`` where its graph capture fails (logged)."""
        try:
            return self.timed(timer, nccl_fn, how)
        except Exception as e:
            self.log(f"  (NCCL {how} capture failed: {e})")
            return None, None

    def time_ops(self, timer, runs: dict, tokens: int, hows, with_nccl: bool = True) -> None:
        """Time each op of ``runs`` (``ops``) each way in ``hows``; NCCL as graph replays for the call and
        graph rows, the same way as ours for the aligned and steady rows."""
        for op, (fn, nccl_fn, dtype) in runs.items():
            nccl = {}
            for how in hows:
                base = "graph" if how == "call" else how
                if with_nccl and nccl_fn is not None and base not in nccl:
                    nccl[base] = self.time_nccl(timer, nccl_fn, base)
                t, p99 = self.timed(timer, fn, how)
                if harness.resolved(t) is None:  # a steady time at the floor: no per-op time to report
                    self.log(f"  {op:17s} {how:6s} T={tokens:4d} not resolved: the ops' graph took no longer than "
                             "the flush-only graph")
                    continue
                nt, np99 = nccl.get(base, (None, None))
                self.add(op, dtype, how, tokens, t, p99, nt, np99, base)

    def add(self, op, dtype, how, tokens, t, p99, nccl_t, nccl_p99, nccl_how) -> None:
        a = self.args
        rec = {**_op_fields(op), "graph": how != "call", "timing": how, "time_us_median": t.median_us,
               "time_us_p99": p99, "time_us_min": t.min_us, "nccl_time_us": nccl_t.median_us if nccl_t else None,
               "nccl_time_us_p99": nccl_p99, "nccl_timing": nccl_how if nccl_t else None,
               "ratio_to_nccl": t.median_us / nccl_t.median_us if nccl_t else None,
               "steady_n": self.steady_n if how == "steady" else None,
               "dtype": dtype, "tokens": tokens, "max_tokens": self.M, "model": getattr(a, "model_name", None),
               "hidden": a.hidden, "topk": a.topk, "experts": a.experts, "num_ranks": self.R}
        rec.update(getattr(self, "load", {}))
        logical, nvlink = getattr(self, "op_bytes", {}).get(op, (None, None))
        rec.update(logical_bytes=logical, nvlink_bytes=nvlink,
                   logical_gbps=logical / (t.median_us * 1e3) if logical is not None and t.median_us else None,
                   nvlink_gbps=nvlink / (t.median_us * 1e3) if nvlink is not None and t.median_us else None)
        self.records.append(rec)
        self.log(f"  {op:17s} {how:6s} T={tokens:4d} median {t.median_us:7.1f} us  p99 {p99:7.1f} us"
                 + (f"  (NCCL same bytes, {nccl_how} {nccl_t.median_us:7.1f} us)" if nccl_t else ""))

    def host_overhead(self, runs: dict, tokens: int) -> None:
        """Records of timing "host": ``host_us_per_call`` (and ``host_wall_us_per_call``) of each op, with the
        benchmark's ``check_values=False`` and again with the Buffer's default ``check_values=True`` (field
        ``check_values``): the value checks copy the top-k (and a combine's handle) to the host, a sync per call,
        which is what a decode loop with the defaults pays."""
        a, buf, sync = self.args, self.buf, self.sync
        try:
            for checked in (False, True):
                buf.check_values = checked
                for op, (fn, _, dtype) in runs.items():
                    host, wall = host_us_per_call(self.comm, fn, HOST_CALLS, sync)
                    self.records.append({**_op_fields(op), "graph": False, "timing": "host",
                                         "host_us_per_call": host, "host_wall_us_per_call": wall,
                                         "check_values": checked, "calls": HOST_CALLS, "time_us_median": None,
                                         "time_us_p99": None, "time_us_min": None, "nccl_time_us": None,
                                         "dtype": dtype, "tokens": tokens, "max_tokens": self.M,
                                         "model": getattr(a, "model_name", None), "hidden": a.hidden,
                                         "topk": a.topk, "experts": a.experts, "num_ranks": self.R})
                    self.log(f"  {op:17s} host   T={tokens:4d} {host:7.1f} us per call on the host "
                             f"({wall:7.1f} us per call until the device is done; {HOST_CALLS} calls back to back"
                             f"{'; check_values=True' if checked else ''})")
        finally:
            buf.check_values = False

    def phases(self, runs: dict, tokens: int, flush=None, rounds: int = 30, calls: int = 4) -> None:
        """Records of timing "stamps" (``--ll-stamps``): per op, where a call's time goes, from the kernels'
        %globaltimer phase stamps (``cuda.low_latency.phase_breakdown``, us after the earliest block started),
        median over ``rounds``. A round replays one CUDA graph of ``calls`` calls (captured once; even, as the
        buffers alternate), launched right after an MPI barrier: the calls run back to back on the device
        whatever the host's speed, the ranks align on the first and the last one (its stamps zeroed just before
        it, inside the graph) is read. (Plain calls back to back only queue up when the host outpaces the
        device; when it does not, each call waits for the peer's launch and the receive stamps measure that.)
        Stamping adds a few block barriers, so it is measured after the timings. ``flush`` (the timer's L2 flush
        buffer, or None): fill it before each call inside the graph, as the steady timing does, so the calls start
        with a cold L2 (records say ``l2_flushed``)."""
        import cupy

        from ..cuda.low_latency import STAMP_NAMES, phase_breakdown
        a, ll = self.args, self.buf.impl.low_latency_state()
        ll.enable_stamps()
        try:
            for op, (fn, _, dtype) in runs.items():
                if op == "ll_round_trip":  # two kernels, each stamped as its own op
                    continue
                stamps = ll.stamps_of("dispatch" if op == "ll_dispatch" else "combine")

                def one_round():
                    for i in range(calls):
                        if flush is not None:
                            flush.fill(i & 0xff)
                        if i == calls - 1:
                            stamps.fill(0)  # ordered before the last call on the capturing stream
                        fn()
                stream = warm_stream(self.comm, one_round)
                with stream:
                    graph = capture_graph(stream, one_round)
                per_round, slowest, by_rank = [], [], []
                for _ in range(rounds):
                    cupy.cuda.runtime.deviceSynchronize()
                    self.comm.Barrier()
                    graph.launch(stream)
                    stream.synchronize()
                    mine = stamps.get()
                    per_round.append(phase_breakdown(mine))
                    slowest.append(phase_breakdown(mine, stat=np.max))
                    # every rank's stamps, each from its own earliest block: the GPUs' %globaltimer clocks
                    # differ by tens of us (measured), so the ranks cannot be put on one clock
                    by_rank.append([phase_breakdown(a) for a in self.comm.allgather(mine)])

                def medians(rounds_):
                    return {name: float(np.median([r[name] for r in rounds_ if name in r]))
                            for name in STAMP_NAMES + ("last_end",) if any(name in r for r in rounds_)}
                phases_us = medians(per_round)
                phases_max_us = medians(slowest)
                phases_by_rank_us = [medians([r[i] for r in by_rank]) for i in range(self.R)]
                self.records.append({**_op_fields(op), "graph": True, "timing": "stamps", "phases_us": phases_us,
                                     "phases_max_us": phases_max_us, "phases_by_rank_us": phases_by_rank_us,
                                     "l2_flushed": flush is not None,
                                     "rounds": rounds, "calls_per_round": calls, "time_us_median": None,
                                     "time_us_p99": None, "time_us_min": None, "nccl_time_us": None,
                                     "dtype": dtype, "tokens": tokens, "max_tokens": self.M,
                                     "model": getattr(a, "model_name", None), "hidden": a.hidden,
                                     "topk": a.topk, "experts": a.experts, "num_ranks": self.R})
                flushed = ' (L2 flushed)' if flush is not None else ''
                self.log(f"  {op:17s} phases{flushed} (us after the first block started): " +
                         ", ".join(f"{k} {v:.1f}" for k, v in phases_us.items()))
                self.log(f"  {op:17s} slowest block{flushed}: " +
                         ", ".join(f"{k} {v:.1f}" for k, v in phases_max_us.items()))
                for r, ph in enumerate(phases_by_rank_us[1:], start=1):  # (rank 0's is the median line)
                    self.log(f"  {op:17s} rank {r}{flushed}: " +
                             ", ".join(f"{k} {v:.1f}" for k, v in ph.items()))
        finally:
            ll.stamps = None

    def token_sweep(self, timer, y) -> None:
        """Steady records at T tokens per rank (``--ll-token-sweep``), same max M; T = --tokens is the main run's."""
        a, buf = self.args, self.buf
        for T in a.ll_token_sweep:
            if T == a.tokens:  # the main run's
                continue
            if not 0 <= T <= self.M:
                self.log(f"  (token sweep: T={T} skipped: needs 0 <= T <= max tokens {self.M})")
                continue
            started = time.perf_counter()
            x_np, idx_np, w_np = self.inputs(T)
            x, idx, w = to_device(x_np), to_device(idx_np), to_device(w_np)
            handle = buf.low_latency_dispatch(x, idx, self.M, a.experts, use_fp8=True)[2]
            runs = self.ops(x, idx, w, y, handle, idx_np)
            self.time_ops(timer, runs, T, ("steady",), with_nccl=T > 0)
            if getattr(a, "ll_stamps", False):  # where a call's time goes at this T too (T = 0: the fixed cost)
                self.phases(runs, T, flush=timer.flush)
            # (what each size costs in wall time)
            self.log(f"  (token sweep T={T}: {time.perf_counter() - started:.1f} s)")

    def note_load(self, idx_np) -> None:
        """Collective: the tokens each rank receives in a dispatch of every rank's ``idx_np`` (a token counted once
        per destination rank) and the busiest rank's over the mean, logged and put in every record."""
        a = self.args
        loads = harness.rank_loads(self.comm.allgather(idx_np), a.experts, self.R)
        self.load, text = harness.load_summary(loads, getattr(a, "routing", "uniform"))
        self.log("  " + text)

    def device_ctx(self):
        import contextlib
        if not self.gpu:
            return contextlib.nullcontext()
        import cupy
        return cupy.cuda.Device(self.buf.device_id)

    def run(self):
        a, R, buf = self.args, self.R, self.buf
        self.log(f"cupy_ep.bench --mode low-latency: backend={buf.backend} ranks={R} tokens={a.tokens} "
                 f"hidden={a.hidden} topk={a.topk} experts={a.experts} iters={a.iters} steady_n={self.steady_n} "
                 f"token_sweep={a.ll_token_sweep}")
        L = a.experts // R
        with self.device_ctx():
            x_np, idx_np, w_np = self.inputs(a.tokens)
            self.note_load(idx_np)
            x, idx, w = self.dev(x_np), self.dev(idx_np), self.dev(w_np)
            rng = np.random.default_rng(99 + self.rank)
            y_np = rng.integers(-8, 9, size=(L, R * self.M, a.hidden)).astype(np.float32).astype(reference.bfloat16)
            y = self.dev(y_np)
            out = buf.low_latency_dispatch(x, idx, self.M, a.experts, use_fp8=True)
            combined, _, _ = buf.low_latency_combine(y, idx, w, out[2])
            combined_bf16p, _, _ = buf.low_latency_combine(y, idx, w, out[2], bf16_partials=True)
            combined_logfmt, _, _ = buf.low_latency_combine(y, idx, w, out[2], use_logfmt=True)
            self.sync()
            self.verify(x_np, idx_np, w_np, out[:3], combined, y_np, combined_bf16p, combined_logfmt)
            handle = out[2]
            if not self.gpu:  # the calls timed by the host clock: no graphs, no NCCL, no device overhead to split
                runs = self.ops(x, idx, w, y, handle, idx_np)
                self.time_ops(HostLatencyTimer(self.comm, a.iters, a.warmup), runs, a.tokens, ("call",))
                self.log("  (host backend: call timings only; no graph, aligned or steady timing, no token sweep)")
                buf.destroy()
                return

            timer = LatencyTimer(self.comm, a.iters, a.warmup)
            self.shared = shared_gpus(self.comm)
            self.nccl, self.nccl_status = nccl_baseline(self.comm, self.shared)
            if self.shared:
                self.log(shared_gpu_warning("cupy_ep.bench --mode low-latency", self.shared, self.nccl_status))
            if self.nccl is None:
                self.log(f"  (no aligned timing: {ALIGNED_WHY})")
            runs = self.ops(x, idx, w, y, handle, idx_np)
            self.time_ops(timer, runs, a.tokens, self.main_timings())
            self.host_overhead(runs, a.tokens)
            if getattr(a, "ll_stamps", False):
                self.phases(runs, a.tokens)
                self.phases(runs, a.tokens, flush=timer.flush)
            if self.steady_n:
                self.token_sweep(timer, y)
            else:
                self.log("  (--steady-n 0: no steady timing, no token sweep)")
        buf.destroy()

    def main_timings(self) -> tuple:
        """How the main run (--tokens) times each op: call, graph, aligned (only with the NCCL baseline, whose
        all-reduce lines the ranks up), steady (unless --steady-n 0)."""
        return (("call", "graph") + (("aligned",) if self.nccl is not None else ())
                + (("steady",) if self.steady_n else ()))

    def write(self, records: list | None = None, skipped: list | None = None, shape_runs: list | None = None) -> None:
        """The report of ``records`` (default: this bench's; :func:`main` passes every model shape's), of the
        shapes ``skipped`` and of each shape's run (``shape_runs``: wall time and kernel counters)."""
        records = self.records if records is None else records
        if not self.gpu:
            stem = f"bench_ll_host_ep{self.R}"
        else:
            stem = results_stem(f"bench_ll_gpu_ep{self.R}" + ("" if self.transport == "nvshmem" else
                                                              f"_{self.transport}"), self.shared)
        about = dict(backend="cuda" if self.gpu else "host", transport=self.transport, nccl=self.nccl_status,
                     shared_gpu_ranks=self.shared or None,
                     aligned="measured" if self.nccl is not None else f"skipped: {ALIGNED_WHY}")
        write_report(self.args.out, stem, records,
                     dict(num_ranks=self.R, **about, skipped=skipped or [], shape_runs=shape_runs or [],
                          args=harness.args_doc(self.args)),
                     lambda common: markdown_lines(records, self.args, self.R,
                                                   dict(common, **about, skipped=skipped or []))
                     + harness.shape_runs_markdown(shape_runs),
                     "low-latency", gpu=self.gpu, plot=plot)


def _op_fields(label: str) -> dict:
    """A record's ``op`` (``ll_dispatch`` / ``ll_combine``) and, for a combine, its ``partials`` ("24-bit";
    "bf16" for the ``ll_combine_bf16p`` run: ``bf16_partials=True``; "logfmt" for ``ll_combine_logfmt``:
    ``use_logfmt=True``)."""
    if label in ("ll_dispatch", "ll_round_trip"):
        return {"op": label}
    return {"op": "ll_combine", "partials": {"ll_combine_bf16p": "bf16", "ll_combine_logfmt": "logfmt"}.get(label,
                                                                                                       "24-bit")}


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown_lines(records: list, args, num_ranks: int, common: dict) -> list:
    """The markdown report: the main table (call / graph / steady at --tokens), the token sweep (steady) and
    the host time per call; the header says how each is timed."""
    steady = [r for r in records if r.get("timing") == "steady"]
    n = steady[0]["steady_n"] if steady else None
    shared = common.get("shared_gpu_ranks")
    if common.get("backend") == "host":
        out = [f"# cupy_ep low-latency benchmark: host-backend results (numpy + MPI on the CPU, no GPU), EP{num_ranks}",
               "", "Host backend (backend=host): the CPU reference path, run to check the pipeline; its times are "
               "host-clock call times, not GPU numbers, and say nothing about NVLink.", ""]
    else:
        out = [f"# cupy_ep low-latency benchmark (EP{num_ranks}, {common['gpu']}"
               + (", ranks sharing a GPU)" if shared else ")"), ""]
    out += shared_gpu_markdown(shared, common.get("nccl"),
                               "" if str(common.get("aligned", "measured")) == "measured" else
                               f"The *aligned* rows are left out: {ALIGNED_WHY}.")
    out += [f"commit `{common['commit']}`; transport {common.get('transport', 'nvshmem')}; {args.tokens} tokens/rank "
           f"(max tokens M = {max_tokens(args)}); routing {getattr(args, 'routing', 'uniform')}; {args.iters} "
           "iterations, median and p99 of the slowest rank per iteration.", "",
           "Timings: *call* = CUDA events around the Python call (host overhead included); *graph* = two ops per "
           "CUDA-graph replay (the two buffers alternate per call: a graph must hold an even number of "
           "low-latency calls), right after an MPI barrier, per op, the ranks' launch skew included once per 2 "
           "ops; *aligned* = the same replays, each queued behind a device-side barrier of the ranks (a one-int "
           "NCCL all-reduce) and a 30 us spin, the start event between the spin and the replay: the ops' latency "
           "when the ranks start together and no host is waited for (as inside a decode step's graph); "
           f"*steady* = {n or 'n'} ops back to back per replay (buffers alternating as in real use), L2 flushed "
           "before each, minus a flush-only graph, / n: device latency per op in a pipeline, the ranks' launch "
           "skew paid once per n ops. NCCL (grouped send/recv of the same per-peer bytes) is timed as graph "
           "replays for the call and graph rows, aligned and steady as ours. *ll_combine (bf16 partials)*: "
           "`bf16_partials=True`, the expert ranks' partial sums cross NVLink as bf16 instead of 24 bits (a third "
           "fewer bytes, one more rounding); *ll_combine (LogFMT-10 partials)*: `use_logfmt=True`, as LogFMT-10 "
           "(cupy_ep/logfmt.py: 1.3125 bytes per value, 44 % of the 24-bit bytes, a relative error of at most "
           "2.2 % per partial value). *ll_round_trip*: a BF16 dispatch, a stand-in expert step (the received rows "
           "copied into the expert output) and the combine of it, back to back with no host sync (NCCL: the same "
           "bytes there, the same copy, and back). Logical GB/s counts every top-k selection's message, the own "
           "rank's included (DeepEP's figure: FP8 messages of H + H/128*4 + 16 bytes, BF16 rows of 2H), NVLink "
           "GB/s only those to other ranks; both at the median time of the row's timing.", ""]
    for model in dict.fromkeys(r.get("model") for r in records):
        group = [r for r in records if r.get("model") == model]
        if model is not None:  # one set of tables per model shape
            g0 = group[0]
            out += ["", f"## {model}: {g0['experts']} experts, top-{g0['topk']}, hidden {g0['hidden']}", ""]
        out += _tables(group, args)
    for sk in common.get("skipped") or []:
        out += ["", f"**Skipped** {sk['model']} ({sk['experts']} experts, top-{sk['topk']}, hidden {sk['hidden']}) in "
                f"{sk['mode']} mode: {sk['reason']}."]
    return out


def _tables(records: list, args) -> list:
    """The tables of one model shape's records: main (call / graph / aligned / steady at --tokens), token sweep,
    phases, host time per call."""
    steady = [r for r in records if r.get("timing") == "steady"]
    out = []
    out += ["| op | dtype | timing | median us | p99 us | NCCL us (same bytes) | NCCL timing | ours/NCCL "
            "| logical GB/s | NVLink GB/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["timing"] in ("call", "graph", "aligned", "steady") and r["tokens"] == args.tokens:
            out.append(f"| {op_label(r)} | {r['dtype']} | {r['timing']} | {r['time_us_median']:.1f} | "
                       f"{r['time_us_p99']:.1f} | {_f(r['nccl_time_us'], '.1f')} | {r.get('nccl_timing') or '-'} | "
                       f"{_f(r.get('ratio_to_nccl'), '.2f')} | {_f(r.get('logical_gbps'), '.1f')} | "
                       f"{_f(r.get('nvlink_gbps'), '.1f')} |")
    if steady:
        out += ["", f"Token sweep (steady): T tokens per rank, max tokens M = {max_tokens(args)}. T = 0 is the fixed "
                "cost of a call: the launch, the signals and their round trip, "
                "no payload.", "",
                "| op | dtype | T | median us | p99 us | NCCL us (steady, same bytes) | ours/NCCL |",
                "|---|---|---|---|---|---|---|"]
        for r in sorted(steady, key=lambda r: (op_label(r), r["tokens"])):
            out.append(f"| {op_label(r)} | {r['dtype']} | {r['tokens']} | {r['time_us_median']:.1f} | "
                       f"{r['time_us_p99']:.1f} | {_f(r['nccl_time_us'], '.1f')} | "
                       f"{_f(r.get('ratio_to_nccl'), '.2f')} |")
    stamped = [r for r in records if r.get("timing") == "stamps"]
    if stamped:
        from ..cuda.low_latency import STAMP_NAMES
        names = [n for n in STAMP_NAMES + ("last_end",) if any(n in r["phases_us"] for r in stamped)]
        out += ["", f"Phases (`--ll-stamps`): the kernels' %globaltimer stamps in us, median over "
                f"{stamped[0]['rounds']} calls (each the last of {stamped[0].get('calls_per_round', 4)} replayed back "
                "to back as one CUDA graph). *stat* = over the blocks of one call: *median* block or *slowest* block, "
                "on rank 0; *rank r* = rank r's median block (r > 0). "
                "Each rank's stamps are relative to its own earliest "
                "block's start (the GPUs' %globaltimer clocks differ by tens of us, so the ranks cannot be put on "
                "one clock). Dispatch: routed = the last token's destinations known; prepared = histograms built; "
                "encoded = its bytes stored and slots known; written = thread 0 past its index entry (released: "
                "the row's signal); recv_prepared = the counts read and prefixed; recv_first_data = the block's "
                "first row in; send_first_stored = thread 0's part of the first message stored (before the "
                "histograms); recv_copy_start / recv_row_seen = the first unit's warp starts waiting for its row / "
                "has its index entry. Combine (one launch: expert-side blocks stamp send_*, owner-side blocks recv_*): "
                "prepared = the own partials flagged (hook mode only); routed = the remote owner's meta in; "
                "encoded = the last partial row stored; written = its flag sent; recv_prepared = the block's "
                "own partials computed; recv_first_data = the first token's partials in. "
                "recv_end: the block's outputs written; last_end: the latest stamp of any block (when the launch "
                "ends). L2 *warm*: the calls back to back; *flushed*: the L2 flushed before each call, as in the "
                "steady timing.", "",
                "| op | T | L2 | stat | " + " | ".join(names) + " |", "|---|---|---|---|" + "---|" * len(names)]
        for r in stamped:
            l2 = "flushed" if r.get("l2_flushed") else "warm"
            rows = [("median", r["phases_us"])]
            if r.get("phases_max_us"):
                rows.append(("slowest", r["phases_max_us"]))
            # (rank 0's own row is the median row above)
            rows += [(f"rank {i}", ph) for i, ph in enumerate(r.get("phases_by_rank_us") or []) if i > 0]
            for stat, ph in rows:
                out.append(f"| {op_label(r)} | {r['tokens']} | {l2} | {stat} | " +
                           " | ".join(_f(ph.get(n), ".1f") for n in names) + " |")
    host = [r for r in records if r.get("timing") == "host"]
    if host:
        out += ["", f"Host time per call: {host[0]['calls']} plain calls back to back (no sync inside the loop; "
                "a device sync and a barrier before and after), slowest rank; *host* = the loop alone, *wall* = "
                "until the device has finished them too; *check_values*: the Buffer's flag (the benchmark runs "
                "False; True, the default, copies the call's top-k to the host to check it: a sync per call).", "",
                "| op | dtype | tokens | host us per call | wall us per call | check_values |",
                "|---|---|---|---|---|---|"]
        for r in host:
            out.append(f"| {op_label(r)} | {r['dtype']} | {r['tokens']} | {r['host_us_per_call']:.1f} | "
                       f"{r['host_wall_us_per_call']:.1f} | {r.get('check_values', False)} |")
    return out


# the plot's ops, in its order: (op, partials) of a record, and the bar's label
PLOT_OPS = ((("ll_dispatch", None), "ll_dispatch (FP8)"), (("ll_combine", "24-bit"), "ll_combine (24-bit)"),
            (("ll_combine", "bf16"), "ll_combine (bf16 partials)"),
            (("ll_combine", "logfmt"), "ll_combine (LogFMT-10)"), (("ll_round_trip", None), "ll_round_trip"))


def plot_rows(doc: dict) -> dict:
    """``{model: {(op, partials): record}}`` of the plot: per model shape and op the record at --tokens timed
    ``graph`` where the run measured it, else ``call`` (the host backend times calls only)."""
    tokens = doc["args"]["tokens"]
    out: dict = {}
    for how in ("call", "graph"):  # graph last: it replaces the call record where both exist
        for r in doc["results"]:
            if r.get("timing") == how and r["tokens"] == tokens:
                out.setdefault(r.get("model"), {})[(r["op"], r.get("partials"))] = r
    return out


def plot_notes(doc: dict) -> list[str]:
    """What the plot's title says of the run beside its shapes (as the normal benchmark's plot): a host-backend run
    is no GPU figure; ranks sharing a GPU copy through its HBM, not over NVLink, and may have no NCCL baseline."""
    notes = []
    if doc.get("backend") == "host":
        notes.append("host backend (numpy + MPI on the CPU): not GPU numbers")
    if doc.get("shared_gpu_ranks"):
        notes.append(f"{shared_text(doc['shared_gpu_ranks'])}: HBM copies through the shared GPU, not NVLink figures"
                     + ("; no NCCL baseline" if str(doc.get("nccl", "")).startswith("skipped") else ""))
    return notes


def plot(doc: dict, path) -> None:
    """One panel: per model shape a group of bars, the median us of each op of ``PLOT_OPS`` at --tokens (graph
    timing where measured, else the call; :func:`plot_rows`), each with NCCL's median on the same bytes beside it
    (hatched) where the run measured NCCL. A host-backend run, or ranks sharing a GPU, say so in the title; the
    shapes the kernels cannot run are named under the axis as skipped. Needs matplotlib (the bench extra):
    without it this raises ImportError and :func:`cupy_ep.tools.harness.write_files` writes no plot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    args, rows = doc["args"], plot_rows(doc)
    skipped = doc.get("skipped") or []
    names = list(rows) + [sk["model"] for sk in skipped]
    with_nccl = any(r.get("nccl_time_us") for by_op in rows.values() for r in by_op.values())
    slots = len(PLOT_OPS) * (2 if with_nccl else 1)
    width = 0.8 / slots
    fig, ax = plt.subplots(figsize=(max(8.0, 2.0 * len(names) + 3.0), 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    hows = set()
    for k, (key, label) in enumerate(PLOT_OPS):
        color = colors[k % len(colors)]
        ours, nccl = [], []
        for i, name in enumerate(rows):
            r = rows[name].get(key)
            if r is None or r.get("time_us_median") is None:
                continue
            hows.add(r["timing"])
            slot = k * (2 if with_nccl else 1)
            ours.append((i + slot * width, r["time_us_median"]))
            if r.get("nccl_time_us"):
                nccl.append((i + (slot + 1) * width, r["nccl_time_us"]))
        if ours:
            ax.bar(*zip(*ours), width, color=color, label=label)
        if nccl:
            ax.bar(*zip(*nccl), width, color=color, alpha=0.45, hatch="//", edgecolor="k", linewidth=0.5)
    if with_nccl:  # one legend entry for every op's NCCL bar
        ax.bar([0], [0], 0, color="w", hatch="//", edgecolor="k", linewidth=0.5,
               label="NCCL send/recv, same bytes (hatched, beside each op)")
    labels = []
    for name, by_op in rows.items():
        r = next(iter(by_op.values()))
        labels.append(f"{name or 'custom'}\n{r['experts']}/{r['topk']}/{r['hidden']}")
    labels += [f"{sk['model']}\n{sk['experts']}/{sk['topk']}/{sk['hidden']}\nskipped" for sk in skipped]
    ax.set_xticks([i + width * (slots - 1) / 2 for i in range(len(names))], labels, fontsize=8)
    ax.set_xlim(-0.5, len(names) - 0.1)  # room for the skipped shapes' labels, which have no bars
    timing = "/".join(sorted(hows)) or "-"
    ax.set(ylabel=f"median us per op ({timing} timing)",
           title=f"low-latency, EP{doc['num_ranks']}, {args['tokens']} tokens/rank (M = "
                 f"{args.get('ll_max_tokens') or args['tokens']}), per model shape (experts/top-k/hidden)")
    notes = plot_notes(doc)
    if notes:
        fig.suptitle("; ".join(notes), fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def max_tokens(args) -> int:
    """M, the buffer's ``num_max_dispatch_tokens_per_rank``: ``--ll-max-tokens``, or ``--tokens`` when not given."""
    return getattr(args, "ll_max_tokens", None) or args.tokens


def main(args, comm) -> None:
    """Entry from :func:`cupy_ep.tools.bench.main` (``--mode low-latency``; its ``check_world`` made sure of a GPU):
    one :class:`LowLatencyBench` per ``--model`` shape the low-latency kernels can run (the others are logged as
    skipped, with the reason, and listed in the report), one report of them all."""
    from .bench import run_each_shape
    if args.backend != "host":  # percentiles want iterations (a host run checks the pipeline)
        args.iters = max(args.iters, 200)
    run_each_shape(args, comm, "low-latency", LowLatencyBench)
