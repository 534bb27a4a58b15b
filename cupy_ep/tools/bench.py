"""``python -m cupy_ep.bench``: the main job. Run under mpirun (``scripts/bench.sh``) or ``torchrun
--nproc-per-node N -m cupy_ep.bench``, one rank per GPU.

In ONE run it measures, for each ``--model`` shape (GPU backend):
  * the ceiling: an SM-driven copy where every GPU writes to all its peers at once (cuda_src/probes/copy.cu);
  * the baseline: NCCL grouped send/recv moving exactly the per-peer bytes our dispatch (combine) moves (a
    communicator of its own, ``cupy.cuda.nccl``, its unique id sent over the job's communicator; under torchrun
    too: torch.distributed's default group is gloo there unless ``CUPY_EP_TORCH_BACKEND`` says otherwise, and the
    baseline is launched on CuPy streams inside CuPy-captured CUDA graphs, which takes raw NCCL calls);
  * ours: layout, dispatch, cached dispatch (BF16 and FP8), combine (BF16) and the round trip (cached dispatch, a
    stand-in expert step, combine, back to back with no host sync) over several SM counts and token counts, CUDA
    events, warm-up, median/min of --iters iterations, L2 flushed before each.
Each op is timed as a call (end to end, host included), as a CUDA-graph replay (one op per replay) and, where it
can be captured, steady (--steady-n ops back to back per replay, GpuTimer.steady: the ranks' launch skew paid
once per n ops); the ceiling and NCCL are timed the same ways, and each comparison uses the same timing on both
sides. Per op the bytes are counted twice: logical (every received row, the own rank's included: DeepEP's GB/s)
and NVLink (rows that leave the GPU). The routing (``--routing``, ``--seed``) sets how skewed the ranks' loads
are; the report gives the busiest rank's load. The kernels compiled and loaded (``cupy_ep.jit.counters``) are
reported, up to the first dispatch and for the whole run.
Every result is checked against ``cupy_ep.reference`` before timing; a mismatch aborts the run.
Writes JSON, a markdown table and a PNG plot into --out (default ``benchmarks/results``). Without a GPU (or with
``--backend host``) it runs the host backend (verification and a small table; no ceiling, no NCCL), written to
``out/bench_host`` (ignored by git) unless --out says otherwise, the files labelled as host results. Where ranks
share a GPU (CUDA MPS clients) NCCL refuses to run: the benchmark runs every op without the NCCL baseline, says so
in its log and files (``nccl``, ``shared_gpu_ranks``) and names them ``..._shared_gpu``.

The command line (``--help``, :mod:`cupy_ep.tools.cli`) is parsed before MPI starts, by every rank alike; rank 0
alone prints help and errors.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import numpy as np

import cupy_ep
from cupy_ep import Buffer, reference
from cupy_ep import config as cfgmod

from . import harness, models
from .cli import check_world, parse_args, resolve_defaults
from .harness import (GpuTimer, HostTimer, git_commit, gpu_name, jit_text, make_inputs, measure_ceiling,
                      nccl_baseline, op_label, raw_words, results_stem, shared_gpu_markdown, shared_gpu_warning,
                      shared_gpus, shared_text, to_device, to_host)

# ------------------------------------------------------------------------------------------------------
# the benchmark
# ------------------------------------------------------------------------------------------------------
class Bench(harness.Tool):
    """The normal-mode benchmark of ``args.shapes`` (the ``--model`` presets, or the shape given by --experts /
    --topk / --hidden) on one Buffer sized for the largest of them; a shape the mode cannot run
    (:func:`models.skip_reason`) is logged and kept in ``skipped`` (the report says why)."""

    def __init__(self, args, comm):
        super().__init__(args, comm)
        self.jit_at_start = jit_counters()
        t_enter = time.perf_counter()
        self.shapes, self.skipped = runnable_shapes(args.shapes, "normal", self.R)
        for s in self.skipped:
            self.log(f"cupy_ep.bench: SKIPPED {s['model']}: {s['reason']}")
        self.shape = self.shapes[0] if self.shapes else None
        max_tokens = max([args.tokens] + args.token_sweep)
        nvl = max(self.nvl_bytes(s, max_tokens) for s in self.shapes or [models.Shape("none", self.R, 1, 16)])
        t0 = time.perf_counter()
        self.t_sizes = t0 - t_enter  # the configs and size hints (Python only)
        self.buf = Buffer(comm, num_nvl_bytes=int(cfgmod.align_up(nvl)), check_values=False,
                          backend=args.backend)
        self.t_buffer = time.perf_counter() - t0
        self.gpu = self.buf.backend == "cuda"
        self.records: list[dict] = []
        self.routing: list[dict] = []  # per shape and batch: the tokens each rank receives, the busiest's load
        self.ceiling: dict = {}
        # the NCCL baseline (GPU: run() opens it) and what the results say of it; the groups of ranks sharing a GPU
        self.nccl, self.nccl_status, self.shared = None, "not measured: the host backend has no NCCL", None
        self.startup = self.first_dispatch() if self.shape else {}
        self.jit_startup = jit_delta(self.jit_at_start)

    def nvl_bytes(self, shape: models.Shape, max_tokens: int) -> int:
        """The NVLink buffer ``shape`` needs: its configs' rings at every swept SM count, zero-copy calls of the
        largest batch (their rows stay in the buffer) and the ceiling copy of the largest batch."""
        a, hidden_bytes = self.args, 2 * shape.hidden
        hints = [dataclasses.replace(get(self.R, hidden_bytes=hidden_bytes), num_sms=sms).get_nvl_buffer_size_hint(
                     hidden_bytes, self.R)
                 for sms in a.sms + [a.default_sms]
                 for get in (Buffer.get_dispatch_config, Buffer.get_combine_config)]
        return max(max(hints), Buffer.get_zero_copy_nvl_size_hint(max_tokens, hidden_bytes, self.R, shape.topk),
                   cfgmod.NOTIFY_BYTES + 16 * self.R * (max_tokens * hidden_bytes // 16) + (1 << 20))

    @property
    def hidden_bytes(self) -> int:
        return 2 * self.shape.hidden

    def first_dispatch(self) -> dict:
        """Warm start: process start -> Buffer -> first layout + dispatch done (a small batch, before any
        other measurement), minus MPI's own start-up. Kernels come from the disk cache when it is warm."""
        a, R, s = self.args, self.R, self.shape
        t0 = time.perf_counter()
        x_np, _, idx_np, w_np = make_inputs(self.rank, R, 128, s.hidden, s.topk, s.experts, 0.0, seed=7)
        with self.device_ctx():
            x, idx, w = self.dev(x_np), self.dev(idx_np), self.dev(w_np)
            t1 = time.perf_counter()
            layout = self.buf.get_dispatch_layout(idx, s.experts)
            t2 = time.perf_counter()
            self.buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                              num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w)
            if self.gpu:
                import cupy
                cupy.cuda.get_current_stream().synchronize()
        t3 = time.perf_counter()
        age = process_age_s()
        # Where a warm start goes: the interpreter and the imports before MPI starts, then MPI_Init (the imports
        # and CuPy's runtime start run beside it: gpu_probe_s is what was left of them once MPI was up, mpi_start
        # says whether they overlapped); buffer_s holds the IPC exchange and the allocations; the first calls
        # load their kernels (disk cache).
        out = {"process_to_first_dispatch_s": age, "process_age_at_main_s": a.process_age_at_main_s,
               "process_age_at_mpi_start_s": a.process_age_at_mpi_start_s, "mpi_start": a.mpi_start,
               "mpi_init_s": a.mpi_init_s, "gpu_probe_s": a.gpu_probe_s, "buffer_sizes_s": self.t_sizes,
               "buffer_s": self.t_buffer, "first_inputs_s": t1 - t0, "first_layout_s": t2 - t1,
               "first_dispatch_s": t3 - t2, "first_layout_dispatch_s": t3 - t0}
        out["warm_start_s"] = None if age is None else age - a.mpi_init_s
        parts = STARTUP_PARTS
        # the rest: the imports after start_mpi, argument parsing, Bench set-up, the process-age clock's 10 ms ticks
        out["unaccounted_s"] = None if age is None else age - sum(out[k] for k in parts)
        return out

    # -- array plumbing --
    def dev(self, a):
        return to_device(a) if self.gpu else a

    host = staticmethod(to_host)

    def device_ctx(self):
        import contextlib
        if not self.gpu:
            return contextlib.nullcontext()
        import cupy
        return cupy.cuda.Device(self.buf.device_id)

    # -- one workload --
    def run_workload(self, tokens: int, sms_list, verify: bool, with_baselines: bool):
        a, R, rank, s = self.args, self.R, self.rank, self.shape
        experts = s.experts
        x_np, x8_np, idx_np, w_np = make_inputs(rank, R, tokens, s.hidden, s.topk, experts, a.skew, a.seed,
                                                a.routing)
        x, x8, idx, w = self.dev(x_np), self.dev(x8_np), self.dev(idx_np), self.dev(w_np)
        timer = (GpuTimer if self.gpu else HostTimer)(self.comm, a.iters, a.warmup)
        buf = self.buf

        layout = buf.get_dispatch_layout(idx, experts)
        num_per_rank_np = np.asarray(self.host(layout[0]))

        def dispatch(xx, cfg, handle=None, zero_copy=False):
            if handle is not None:
                return buf.dispatch(xx, handle=handle, config=cfg, zero_copy=zero_copy)
            return buf.dispatch(xx, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w, config=cfg,
                                zero_copy=zero_copy)

        dcfg0 = dataclasses.replace(Buffer.get_dispatch_config(R, hidden_bytes=self.hidden_bytes),
                                    num_sms=a.default_sms)
        out = dispatch(x, dcfg0)
        if verify:
            self.verify(x_np, x8_np, idx_np, w_np, layout, dispatch, dcfg0)

        # bytes: rows this rank sends to each peer (self included), and what it receives
        row_bf16, row_fp8 = s.hidden * 2, s.hidden + 4 * (-(-s.hidden // 128))
        recv_rows = np.array(self.comm.allgather(num_per_rank_np))[:, rank]  # rows from each source
        sent_rows = num_per_rank_np
        nvl_sent = int(sent_rows.sum() - sent_rows[rank])
        nvl_back = int(recv_rows.sum() - recv_rows[rank])
        num_recv = int(recv_rows.sum())
        load = self.note_load(tokens, num_recv)

        nccl = self.nccl_baselines(timer, sent_rows, recv_rows, row_bf16, row_fp8) \
            if self.nccl is not None and with_baselines else {}
        ceiling = {"graph": self.ceiling.get("gbps"), "steady": self.ceiling.get("gbps_steady")}

        def add(op, dtype, sms, fn, row_bytes, logical_rows, nvl_rows, graph: bool, zero_copy: bool = False):
            """Time ``fn`` (``time_op``) and append its record."""
            t = self.time_op(timer, fn, graph)
            key = (op.replace("cached_", ""), dtype)
            rec = make_record(dict(op=op, dtype=dtype, num_sms=sms, tokens=tokens, model=s.name, hidden=s.hidden,
                                   topk=s.topk, experts=experts, zero_copy=zero_copy, routing=a.routing,
                                   busiest_rank_load=load), t, row_bytes, logical_rows, nvl_rows,
                              ceiling, {how: us.get(key) for how, us in nccl.items()})
            rec["steady_n"] = a.steady_n if t["steady"] else None
            self.records.append(rec)
            self.log(log_line(rec))

        if with_baselines:
            add("layout", "-", 0, lambda: buf.get_dispatch_layout(idx, experts), 0, 0, 0, graph=True)
        for sms in sms_list:
            dcfg = dataclasses.replace(Buffer.get_dispatch_config(R, hidden_bytes=self.hidden_bytes), num_sms=sms)
            ccfg = dataclasses.replace(Buffer.get_combine_config(R, hidden_bytes=self.hidden_bytes), num_sms=sms)
            for name, xx, rb in (("bf16", x, row_bf16), ("fp8", x8, row_fp8)):
                res = dispatch(xx, dcfg)
                handle = res[4]
                add("dispatch", name, sms, lambda: dispatch(xx, dcfg), rb, num_recv, nvl_sent, graph=False)
                add("cached_dispatch", name, sms, lambda: dispatch(xx, dcfg, handle), rb, num_recv, nvl_sent,
                    graph=True)
                if name == "bf16":
                    recv_x, handle_bf16 = res[0], handle
                # zero-copy: rows stored straight into the receiver's buffer (recv_x is a view of it)
                add("dispatch", name, sms, lambda: dispatch(xx, dcfg, zero_copy=True), rb, num_recv, nvl_sent,
                    graph=False, zero_copy=True)
                add("cached_dispatch", name, sms, lambda: dispatch(xx, dcfg, handle, zero_copy=True), rb, num_recv,
                    nvl_sent, graph=True, zero_copy=True)
            # DeepEP counts combine's logical bytes as recv_x's bytes
            add("combine", "bf16", sms, lambda: buf.combine(recv_x, handle_bf16, config=ccfg), row_bf16, num_recv,
                nvl_back, graph=True)
            add("combine", "bf16", sms, lambda: buf.combine(recv_x, handle_bf16, config=ccfg, zero_copy=True),
                row_bf16, num_recv, nvl_back, graph=True, zero_copy=True)
            # dispatch, the stand-in expert step and combine back to back, no host sync in between: each half's
            # bytes counted (logical: received rows there and back; NVLink: the rows that leave the GPU)
            add("round_trip", "bf16", sms, self.round_trip(x, handle_bf16, recv_x, dcfg, ccfg), row_bf16,
                2 * num_recv, nvl_sent + nvl_back, graph=True)
        del out

    def round_trip(self, x, handle, recv_x, dcfg, ccfg):
        """One MoE layer's communication as a function: the cached dispatch of ``x`` (``handle``: no host sync),
        a stand-in expert step (the received rows copied into the expert output, a memory-bound pass over them)
        and the combine of that output."""
        buf = self.buf
        y_words = raw_words(recv_x).copy()
        y = y_words.view(recv_x.dtype)
        if self.gpu:
            import cupy
            copyto = cupy.copyto
        else:
            copyto = np.copyto

        def run():
            rows = buf.dispatch(x, handle=handle, config=dcfg)[0]
            copyto(y_words, raw_words(rows))
            return buf.combine(y, handle, config=ccfg)
        return run

    def note_load(self, tokens: int, num_recv: int) -> float | None:
        """Collective: the tokens each rank receives in this workload's dispatch, and the busiest rank's over the
        mean (kept in ``self.routing``, logged); returns that load."""
        summary, text = harness.load_summary(self.comm.allgather(num_recv), self.args.routing)
        s = self.shape
        self.routing.append(dict(summary, model=s.name, tokens=tokens, seed=self.args.seed))
        self.log(f"  {s.describe()}, {tokens} tokens/rank, {text}")
        return summary["busiest_rank_load"]

    def time_op(self, timer, fn, graph: bool) -> dict:
        """``fn`` timed as a call (events around the Python call: host overhead included) and, when ``graph``
        (it can be captured) on a GPU, as graph replays (one op per replay) and steady (``--steady-n`` ops back
        to back; none with --steady-n 0): ``{"call": Timing, "graph": Timing | None, "steady": Timing | None}``."""
        device, n = graph and self.gpu, self.args.steady_n
        return {"call": timer(fn), "graph": timer.graph(fn) if device else None,
                "steady": harness.resolved(timer.steady(fn, n)) if device and n else None}

    def nccl_baselines(self, timer, sent_rows, recv_rows, row_bf16: int, row_fp8: int) -> dict:
        """NCCL grouped send/recv of exactly the per-peer bytes of dispatch (bf16, fp8) and combine (bf16), and
        the round trip of them (:meth:`NcclAllToAll.make_round_trip`), timed as our ops are: ``{"call" | "graph" |
        "steady": {(op, dtype): median us}}``. A timing whose graph capture fails is left out (logged): NCCL
        inside a graph is not essential."""
        nc, n = self.nccl, self.args.steady_n
        runs = {("dispatch", name): nc.make(sent_rows * rb, recv_rows * rb)
                for name, rb in (("bf16", row_bf16), ("fp8", row_fp8))}
        runs[("combine", "bf16")] = nc.make(recv_rows * row_bf16, sent_rows * row_bf16)
        runs[("round_trip", "bf16")] = nc.make_round_trip(sent_rows * row_bf16, recv_rows * row_bf16)
        hows = {"graph": timer.graph}
        if n:
            hows["steady"] = lambda fn: harness.resolved(timer.steady(fn, n))
        out = {"call": {}, "graph": {}, "steady": {}}
        for key, run in runs.items():
            out["call"][key] = timer(run).median_us
            for how, time_it in hows.items():
                try:
                    t = time_it(run)
                    if t is not None:
                        out[how][key] = t.median_us
                except Exception as e:
                    self.log(f"  (NCCL {how} capture failed: {e})")
        return out

    def verify(self, x_np, x8_np, idx_np, w_np, layout, dispatch, cfg):
        """Dispatch (BF16, FP8), cached dispatch and combine against the reference; abort on mismatch."""
        comm, rank = self.comm, self.rank
        gathered = comm.allgather((x_np, x8_np, idx_np, w_np))
        errors = []
        for name, xx_np, pick in (("bf16", x_np, 0), ("fp8", x8_np, 1)):
            xx = self.dev(xx_np)
            recv_x, recv_idx, recv_w, counts, handle, _ = dispatch(xx, cfg)
            ref = reference.dispatch([g[pick][0] if pick else g[0] for g in gathered], [g[2] for g in gathered],
                                     [g[3] for g in gathered], self.shape.experts, rank, 1,
                                     [g[1][1] for g in gathered] if pick else None,
                                     cfg.intranode_dispatch_channels(len(gathered)))
            got = self.host(recv_x)
            got_x = got[0] if pick else got
            checks = [("recv_x", got_x, ref.recv_x), ("recv_topk_idx", self.host(recv_idx), ref.recv_topk_idx),
                      ("recv_topk_weights", self.host(recv_w), ref.recv_topk_weights)]
            if pick:
                checks.append(("recv_x_scales", got[1], ref.recv_x_scales))
            cached = self.host(dispatch(xx, cfg, handle)[0])
            checks.append(("cached recv_x", cached[0] if pick else cached, ref.recv_x))
            zx, zidx, zw, zcounts, zhandle, _ = dispatch(xx, cfg, zero_copy=True)
            zx = self.host(zx)  # a view of the buffer: read it before the next call
            checks += [("zero-copy recv_x", zx[0] if pick else zx, ref.recv_x),
                       ("zero-copy recv_topk_idx", self.host(zidx), ref.recv_topk_idx),
                       ("zero-copy recv_topk_weights", self.host(zw), ref.recv_topk_weights),
                       ("zero-copy send_head", self.host(zhandle[5]), self.host(handle[5]))]
            if zcounts != ref.num_recv_tokens_per_expert_list:
                errors.append(f"{name} zero-copy per-expert counts")
            zc = self.host(dispatch(xx, cfg, zhandle, zero_copy=True)[0])
            checks.append(("zero-copy cached recv_x", zc[0] if pick else zc, ref.recv_x))
            for label, g, r in checks:
                if g.shape != r.shape or np.ascontiguousarray(g).tobytes() != np.ascontiguousarray(r).tobytes():
                    errors.append(f"{name} {label}")
            if counts != ref.num_recv_tokens_per_expert_list:
                errors.append(f"{name} per-expert counts")
            if pick == 0:
                all_recv = comm.allgather(ref.recv_x)
                all_in_rank = comm.allgather(ref.is_token_in_rank)
                ref_c, _ = reference.combine(all_recv, all_in_rank, rank)
                for zc in (False, True):
                    combined, _, _ = self.buf.combine(recv_x, handle, zero_copy=zc)
                    if self.host(combined).tobytes() != ref_c.tobytes():
                        errors.append(f"combine{' zero-copy' if zc else ''}")
        bad = comm.allgather(errors)
        if any(bad):
            self.log(f"VERIFICATION FAILED: {bad}")
            comm.Abort(2)
        self.log("  verified against cupy_ep.reference: dispatch bf16/fp8, cached dispatch, combine (ring and "
                 "zero-copy each): OK")

    def run(self):
        a = self.args
        self.log(f"cupy_ep.bench: backend={self.buf.backend} ranks={self.R} tokens={a.tokens} models="
                 + ", ".join(s.describe() for s in self.shapes) + f" routing={a.routing} seed={a.seed} skew={a.skew} "
                 f"iters={a.iters} steady_n={a.steady_n}")
        if self.startup:
            # mpi_start names how the world started: MPI (overlapped, mpi4py, already) or torch.distributed
            # (torchrun, torchrun-already), whose init_process_group mpi_init_s then counts
            self.log(f"  warm start (s; world start {self.startup['mpi_start']}): "
                     + ", ".join(f"{k[:-2]} {v:.3f}" for k, v in self.startup.items() if isinstance(v, float)))
        with self.device_ctx():
            if self.gpu and self.shapes:
                self.shared = shared_gpus(self.comm)
                self.nccl, self.nccl_status = nccl_baseline(self.comm, self.shared)
                if self.shared:
                    self.log(shared_gpu_warning("cupy_ep.bench", self.shared, self.nccl_status))
                elif self.nccl is None:
                    self.log(f"cupy_ep.bench: NCCL baseline {self.nccl_status}: no NCCL times or ratios")
                self.measure_ceiling(GpuTimer(self.comm, a.iters, a.warmup))
            for shape in self.shapes:
                self.shape = shape
                self.log(f"cupy_ep.bench: {shape.describe()}")
                self.run_workload(a.tokens, a.sms, verify=True, with_baselines=True)
                for tokens in a.token_sweep:
                    if tokens != a.tokens:
                        self.run_workload(tokens, [a.default_sms], verify=False, with_baselines=True)
        self.buf.destroy()
        self.jit_run = jit_delta(self.jit_at_start)
        self.log("  " + jit_line(self.jit_startup, self.jit_run))
        if self.rank == 0:
            self.write()

    def measure_ceiling(self, timer) -> None:
        """``self.ceiling``: the P2P copy's GB/s by SM count and at best, as graph replays (``by_sms``, ``gbps``:
        the headline ``ceiling_gbps``) and steady (``by_sms_steady``, ``gbps_steady``; None with --steady-n 0)."""
        per_peer = self.args.tokens * self.hidden_bytes
        graph, steady = measure_ceiling(self.buf, timer, per_peer, [8, 16, 24, 32, 64, 132], self.args.steady_n)
        self.ceiling = {"by_sms": graph, "gbps": max(graph.values()),
                        "by_sms_steady": steady or None, "gbps_steady": max(steady.values()) if steady else None}
        for label, by_sms in (("graph", graph), ("steady", steady)):
            if by_sms:
                self.log(f"  ceiling (P2P copy, all GPUs writing to all peers, {label}): "
                         + ", ".join(f"{s} SMs {g:.1f}" for s, g in by_sms.items())
                         + f" GB/s -> {max(by_sms.values()):.1f} GB/s")

    # -- outputs --
    def meta(self) -> dict:
        meta = {"commit": git_commit(), "backend": self.buf.backend, "num_ranks": self.R,
                "ceiling_gbps": self.ceiling.get("gbps"), "ceiling_by_sms": self.ceiling.get("by_sms"),
                "ceiling_gbps_steady": self.ceiling.get("gbps_steady"),
                "ceiling_by_sms_steady": self.ceiling.get("by_sms_steady"),
                "nccl": self.nccl_status, "shared_gpu_ranks": self.shared,
                "models": [dataclasses.asdict(s) for s in self.shapes], "skipped": self.skipped,
                "routing": self.routing, "jit": {"startup": self.jit_startup, "run": getattr(self, "jit_run", None)},
                "startup": self.startup, "args": harness.args_doc(self.args)}
        if self.gpu:
            meta["gpu"], meta["driver"] = gpu_name(), driver_version()
        else:
            meta["gpu"], meta["driver"] = None, None
        return meta

    def write(self):
        stem = results_stem(f"bench_{'gpu' if self.gpu else 'host'}_ep{self.R}", self.shared)
        doc = dict(self.meta(), results=self.records)
        harness.write_files(self.args.out, stem, doc, markdown_table(doc), "cupy_ep.bench", plot=plot)


def runnable_shapes(shapes, mode: str, num_ranks: int) -> tuple[list, list]:
    """``(shapes mode can run over num_ranks ranks, [{"model", "experts", "topk", "hidden", "reason"}] of the
    others)`` (:func:`models.skip_reason`)."""
    run, skipped = [], []
    for s in shapes:
        why = models.skip_reason(s, mode, num_ranks)
        if why is None:
            run.append(s)
        else:
            skipped.append({"model": s.name, "experts": s.experts, "topk": s.topk, "hidden": s.hidden,
                            "mode": mode, "reason": why})
    return run, skipped


def run_each_shape(args, comm, mode: str, bench_class) -> None:
    """``--mode`` low-latency / internode: one ``bench_class(args of the shape, comm)`` run per ``--model`` shape the
    mode can run (the others logged as skipped, with the reason, and listed in the report), then one report of
    them all (``bench.write(records, skipped, runs)``, rank 0; ``runs``: each shape's wall time and kernel
    counters)."""
    prog = f"cupy_ep.bench --mode {mode}"
    shapes, skipped = runnable_shapes(args.shapes, mode, comm.Get_size())
    rank0 = comm.Get_rank() == 0
    for s in skipped:
        if rank0:
            print(f"{prog}: SKIPPED {s['model']}: {s['reason']}", flush=True)
    records, runs, bench = [], [], None
    for shape in shapes:
        started, jit_before = time.perf_counter(), jit_counters()
        bench = bench_class(shape_args(args, shape), comm)
        bench.run()
        records += bench.records
        # where a multi-shape run's wall time goes: its Buffer, the kernels a new shape needs, the timings
        runs.append({"model": shape.name, "wall_s": time.perf_counter() - started, "jit": jit_delta(jit_before)})
        if rank0:
            print(f"{prog}: {shape.name} took {runs[-1]['wall_s']:.1f} s (kernels (rank 0): "
                  f"{jit_text(runs[-1]['jit'])})", flush=True)
    if bench is None:
        if rank0:
            print(f"{prog}: no model shape to run (all skipped, above)", flush=True)
    elif rank0:
        bench.write(records, skipped, runs)


def shape_args(args, shape: models.Shape) -> argparse.Namespace:
    """A copy of ``args`` for one model shape: its experts, top-k and hidden size, ``model_name`` its name."""
    return argparse.Namespace(**dict(vars(args), experts=shape.experts, topk=shape.topk, hidden=shape.hidden,
                                     model_name=shape.name))


def jit_counters() -> dict:
    """This process's kernel counters (:func:`cupy_ep.jit.counters`)."""
    from cupy_ep import jit
    return jit.counters()


def jit_delta(since: dict) -> dict:
    """What this process's kernel counters gained since the snapshot ``since`` (each rank compiles and loads its
    own kernels; the report gives rank 0's)."""
    now = jit_counters()
    return {k: now[k] - since.get(k, 0) for k in now}


def jit_line(startup: dict, run: dict) -> str:
    """The log line of the kernel counters: compiled (cold), loaded from the disk cache (warm), seconds."""
    return f"kernels (rank 0): up to the first dispatch {jit_text(startup)}; whole run {jit_text(run)}"


def driver_version() -> str | int:
    """The NVIDIA driver's version (nvidia-smi), else CUDA's driver API version number."""
    import subprocess

    import cupy
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.split()[0]
    except Exception:
        return cupy.cuda.runtime.driverGetVersion()


def make_record(base: dict, t: dict, row_bytes: int, logical_rows: int, nvl_rows: int, ceiling: dict,
                nccl: dict) -> dict:
    """One result: ``base`` (op, dtype, num_sms, tokens, ...) and, from the timings ``t`` (``time_op``), per timing:
    time, NVLink GB/s (``nvl_rows`` x ``row_bytes`` / time), the fraction of the ceiling and the ratio to NCCL.
    Bytes: ``logical_bytes`` = ``logical_rows`` x ``row_bytes`` (every received row, the own rank's included),
    ``nvlink_bytes`` = ``nvl_rows`` x ``row_bytes`` (the rows that cross NVLink); ``kernel_time_us`` is the
    device time (steady, else graph; None where not measured), ``time_us_median`` the call's (end to end).
    The fraction divides by the ceiling timed the same way (``ceiling["graph"]``, the headline ``ceiling_gbps``,
    for the call and graph timings, ``ceiling["steady"]`` for steady), the ratio by NCCL timed the same way
    (``nccl[how]`` us). Logical GB/s (``logical_rows``: all received rows, DeepEP's figure) is the call's."""
    def gbps(rows, us):
        return rows * row_bytes / (us * 1e-6) / 1e9 if rows and us else 0.0
    call = t["call"]
    rec = dict(base, time_us_median=call.median_us, time_us_min=call.min_us,
               logical_gbps=gbps(logical_rows, call.median_us), nvlink_gbps=gbps(nvl_rows, call.median_us),
               logical_bytes=logical_rows * row_bytes, nvlink_bytes=nvl_rows * row_bytes)
    kernel = t.get("steady") or t.get("graph")  # device time: the kernels alone (None on the host backend)
    rec["kernel_time_us"] = kernel.median_us if kernel else None
    rec["kernel_timing"] = ("steady" if t.get("steady") else "graph") if kernel else None
    rec["fraction_of_ceiling"] = rec["nvlink_gbps"] / ceiling["graph"] if ceiling.get("graph") else None
    rec["nccl_time_us"] = nccl.get("call")
    rec["ratio_to_nccl"] = call.median_us / rec["nccl_time_us"] if rec["nccl_time_us"] else None
    for how in ("graph", "steady"):
        tm, ceil, nc = t.get(how), ceiling.get(how), nccl.get(how)
        rec[f"time_us_{how}"] = tm.median_us if tm else None
        rec[f"nvlink_gbps_{how}"] = nv = gbps(nvl_rows, tm.median_us) if tm else None
        rec[f"fraction_of_ceiling_{how}"] = nv / ceil if ceil and nv else None
        rec[f"nccl_time_us_{how}"] = nc
        rec[f"ratio_to_nccl_{how}"] = tm.median_us / nc if tm and nc else None
    rec["time_us_steady_min"] = t["steady"].min_us if t.get("steady") else None
    return rec


def log_line(rec: dict) -> str:
    """One record as the benchmark prints it: times (call / graph / steady), NVLink GB/s, fraction, NCCL ratio."""
    def opt(key, fmt, prefix=" / "):
        return f"{prefix}{rec[key]:{fmt}}" if rec.get(key) else ""
    line = (f"  {rec['op']:16s} {rec['dtype']:5s} sms={rec['num_sms']:3d} tokens={rec['tokens']:6d}  "
            f"{rec['time_us_median']:8.1f}{opt('time_us_graph', '7.1f', ' / graph ')}"
            f"{opt('time_us_steady', '7.1f', ' / steady ')} us  nvlink {rec['nvlink_gbps']:6.1f}"
            f"{opt('nvlink_gbps_graph', '6.1f')}{opt('nvlink_gbps_steady', '6.1f')} GB/s")
    if rec.get("fraction_of_ceiling"):
        line += (f"  {rec['fraction_of_ceiling']:.2f}{opt('fraction_of_ceiling_graph', '.2f', '/')}"
                 f"{opt('fraction_of_ceiling_steady', '.2f', '/')} x ceiling")
    if rec.get("ratio_to_nccl"):
        line += (f"  {rec['ratio_to_nccl']:.2f}{opt('ratio_to_nccl_graph', '.2f', '/')}"
                 f"{opt('ratio_to_nccl_steady', '.2f', '/')}x NCCL time")
    return line


def markdown_table(doc: dict) -> str:
    """The normal-mode results as markdown: the header says how each column is timed; cells with several
    values are call / graph / steady ("-" where not measured)."""
    steady_n = (doc.get("args") or {}).get("steady_n")

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    def each(r, key, fmt, hows=("", "_graph", "_steady")):
        return " / ".join(f(r.get(key + h), fmt) for h in hows)
    host = doc["backend"] == "host"
    shared = doc.get("shared_gpu_ranks")
    if host:
        title = f"# cupy_ep benchmark: host-backend results (numpy + MPI on the CPU, no GPU), {doc['num_ranks']} ranks"
    else:
        title = (f"# cupy_ep benchmark ({doc['backend']}, {doc['num_ranks']} ranks, {doc.get('gpu')}"
                 + (", ranks sharing a GPU)" if shared else ")"))
    lines = [title, ""]
    if host:
        lines += ["Host backend (backend=host): the CPU reference path, run to check the pipeline; its times are "
                  "not GPU numbers and say nothing about NVLink.", ""]
    lines += shared_gpu_markdown(shared, doc.get("nccl"))
    lines += [f"commit `{doc['commit']}`, driver {doc.get('driver')}, ceiling (P2P copy, every GPU writing to all its "
             f"peers) {f(doc['ceiling_gbps'], '.1f')} GB/s per GPU as graph replays (`ceiling_gbps`), "
             f"{f(doc.get('ceiling_gbps_steady'), '.1f')} GB/s steady (`ceiling_gbps_steady`); "
             f"startup {doc['startup']}", "",
             "Three timings per op, each the median over iterations of the slowest rank: "
             "*call* = CUDA events around the Python call (host overhead included); "
             "*graph* = the call captured in a CUDA graph, one op per replay started right after an MPI barrier "
             "(device time, but an op that waits for its peers also waits out the skew between the ranks' launches, "
             "which the copy ceiling never pays); "
             f"*steady* = {steady_n or 'n'} ops back to back in one graph, L2 flushed before each, minus a "
             "flush-only graph, divided by n (device time per op in a pipeline, as DeepEP measures: the skew is "
             "paid once per n ops). NVLink GB/s counts bytes that left the GPU; logical GB/s (call) counts all "
             "received bytes (DeepEP's way). *of ceiling* divides by the ceiling timed the same way (graph by "
             "`ceiling_gbps`, steady by `ceiling_gbps_steady`); NCCL (grouped send/recv of the same per-peer "
             "bytes) is timed each way too, and ours/NCCL compares like with like. *round_trip* = cached dispatch, "
             "a stand-in expert step (a copy of the received rows) and combine back to back with no host sync; its "
             "NCCL figure = the all-to-all, the same copy and the all-to-all back. The call is the end-to-end time, "
             "graph and steady the kernels' (`kernel_time_us`: steady, else graph); logical GB/s counts both "
             "halves of a round trip.", "",
             "| op | dtype | SMs | tokens | call us | graph us | steady us | logical GB/s "
             "| NVLink GB/s (call / graph / steady) | of ceiling (graph / steady) | NCCL us (call / graph / steady) "
             "| ours/NCCL (call / graph / steady) |",
             ]
    header = ["| op | dtype | SMs | tokens | call us | graph us | steady us | logical GB/s "
              "| NVLink GB/s (call / graph / steady) | of ceiling (graph / steady) | NCCL us (call / graph / steady) "
              "| ours/NCCL (call / graph / steady) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(r.get("model") for r in doc["results"]):
        rows = [r for r in doc["results"] if r.get("model") == model]
        if model is not None:  # one table per model shape
            r0 = rows[0]
            lines += [f"## {model}: {r0['experts']} experts, top-{r0['topk']}, hidden {r0['hidden']}", ""]
        lines += header
        for r in rows:
            lines.append(f"| {op_label(r)} | {r['dtype']} | {r['num_sms']} | {r['tokens']} | "
                         f"{r['time_us_median']:.1f} | {f(r.get('time_us_graph'), '.1f')} | "
                         f"{f(r.get('time_us_steady'), '.1f')} | {r['logical_gbps']:.1f} | "
                         f"{each(r, 'nvlink_gbps', '.1f')} | "
                         f"{each(r, 'fraction_of_ceiling', '.2f', ('_graph', '_steady'))} | "
                         f"{each(r, 'nccl_time_us', '.1f')} | {each(r, 'ratio_to_nccl', '.2f')} |")
        lines.append("")
    lines += extra_markdown(doc)
    return "\n".join(lines) + "\n"


def extra_markdown(doc: dict) -> list[str]:
    """The report's closing sections (each only where the document has it): the routing's load per rank, the
    model shapes skipped and why, the kernels compiled and loaded."""
    out = []
    if doc.get("routing"):
        out += ["Routing: the tokens each rank receives in a dispatch (a token counted once per destination rank) "
                "and the busiest rank's over the mean (1.00: balanced).", "",
                "| model | tokens/rank | routing | seed | tokens received per rank | busiest / mean |",
                "|---|---|---|---|---|---|"]
        for r in doc["routing"]:
            load = "-" if r["busiest_rank_load"] is None else f"{r['busiest_rank_load']:.3f}"
            out.append(f"| {r['model']} | {r['tokens']} | {r['routing']} | {r['seed']} | "
                       f"{', '.join(map(str, r['recv_tokens_per_rank']))} | {load} |")
        out.append("")
    for s in doc.get("skipped") or []:
        out += [f"**Skipped** {s['model']} ({s['experts']} experts, top-{s['topk']}, hidden {s['hidden']}) in "
                f"{s['mode']} mode: {s['reason']}.", ""]
    jit = doc.get("jit") or {}
    if jit.get("run") is not None:
        out += [f"Kernels (rank 0): {jit_text(jit['startup'])} up to the first dispatch; {jit_text(jit['run'])} in "
                "the whole run (compiled: not in the disk cache, cold; from the disk cache: warm).", ""]
    return out


def _device_gbps(r: dict) -> tuple[float, str]:
    """A record's NVLink GB/s for the plot, and how it was timed: steady, else graph, else the call."""
    for how in ("steady", "graph"):
        if r.get(f"nvlink_gbps_{how}"):
            return r[f"nvlink_gbps_{how}"], how
    return r["nvlink_gbps"], "call"


def _nccl_gbps(r: dict) -> float | None:
    """NCCL's GB/s on the record's NVLink bytes, NCCL timed steady where measured, else graph, else the call."""
    us = r.get("nccl_time_us_steady") or r.get("nccl_time_us_graph") or r.get("nccl_time_us")
    return r["nvlink_gbps"] * r["time_us_median"] / us if us else None


def plot(doc: dict, path: Path):
    """NVLink GB/s by SM count and by tokens per rank (the first model shape), and per model shape at
    --default-sms and --tokens; device times (steady where measured, else graph, else the call; the legend says
    which), the ceiling timed as the ops are, NCCL on the same bytes. A host-backend run's plot says so."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    args = doc["args"]
    first = next((r.get("model") for r in doc["results"]), None)
    res = [r for r in doc["results"] if r.get("model") == first]
    fig, axes = plt.subplots(1, 3, figsize=(19, 5))
    notes = []
    if doc["backend"] == "host":
        notes.append("host backend (numpy + MPI on the CPU): not GPU numbers")
    if doc.get("shared_gpu_ranks"):
        notes.append(f"{shared_text(doc['shared_gpu_ranks'])}: HBM copies through the shared GPU, not NVLink figures"
                     + ("; no NCCL baseline" if str(doc.get("nccl", "")).startswith("skipped") else ""))
    if notes:
        fig.suptitle("; ".join(notes), fontsize=10)
    steady = bool(doc.get("ceiling_by_sms_steady"))
    ceiling_by_sms = doc.get("ceiling_by_sms_steady") or doc.get("ceiling_by_sms")
    ceiling = doc.get("ceiling_gbps_steady") or doc.get("ceiling_gbps")
    ceiling_label = f"P2P copy ceiling ({'steady' if steady else 'graph'})"
    shape = f"{first}: " if first else ""
    r0 = res[0] if res else {"hidden": args["hidden"], "topk": args["topk"], "experts": args["experts"]}

    def series(ax, rows, x_key, label):
        pts = sorted((r[x_key], _device_gbps(r)[0]) for r in rows)
        if pts:
            hows = sorted({_device_gbps(r)[1] for r in rows})
            ax.plot(*zip(*pts), marker="o", label=f"{label} ({'/'.join(hows)})")

    ax = axes[0]
    for op, dtype, zc in (("dispatch", "bf16", False), ("cached_dispatch", "bf16", False),
                          ("cached_dispatch", "fp8", False), ("combine", "bf16", False),
                          ("cached_dispatch", "bf16", True), ("combine", "bf16", True), ("round_trip", "bf16", False)):
        series(ax, [r for r in res if r["op"] == op and r["dtype"] == dtype and r["tokens"] == args["tokens"]
                    and bool(r.get("zero_copy")) == zc], "num_sms", f"{op} {dtype}{' zero-copy' if zc else ''}")
    if ceiling_by_sms:
        pts = sorted((int(k), v) for k, v in ceiling_by_sms.items())
        ax.plot(*zip(*pts), "k--", label=ceiling_label)
    nccl = [r for r in res if r["op"] == "dispatch" and r["dtype"] == "bf16" and r["tokens"] == args["tokens"]
            and not r.get("zero_copy") and _nccl_gbps(r)]
    if nccl:
        ax.axhline(_nccl_gbps(nccl[0]), color="gray", ls=":", label="NCCL all-to-all (same bytes)")
    ax.set(xlabel="SMs", ylabel="NVLink-crossing GB/s per GPU",
           title=f"{shape}EP{doc['num_ranks']}, {args['tokens']} tokens/rank")
    _legend(ax)
    ax = axes[1]
    for op, zc in (("dispatch", False), ("cached_dispatch", False), ("combine", False), ("cached_dispatch", True),
                   ("combine", True), ("round_trip", False)):
        series(ax, [r for r in res if r["op"] == op and r["dtype"] == "bf16" and r["num_sms"] == args["default_sms"]
                    and bool(r.get("zero_copy")) == zc], "tokens", f"{op} bf16{' zero-copy' if zc else ''}")
    pts = sorted((r["tokens"], _nccl_gbps(r)) for r in res
                 if r["op"] == "dispatch" and r["dtype"] == "bf16" and not r.get("zero_copy") and _nccl_gbps(r)
                 and r["num_sms"] == args["default_sms"])
    if pts:
        ax.plot(*zip(*pts), "k:", marker="x", label="NCCL all-to-all (same bytes)")
    if ceiling:
        ax.axhline(ceiling, color="k", ls="--", label=ceiling_label)
    ax.set(xlabel="tokens per rank", ylabel="NVLink-crossing GB/s per GPU", xscale="log",
           title=f"{shape}{args['default_sms']} SMs, hidden {r0['hidden']}, top-{r0['topk']} of {r0['experts']}")
    _legend(ax)
    by_model_plot(axes[2], doc)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _legend(ax) -> None:
    """The panel's legend, or a note that the run measured nothing for it (an SM or token sweep cut short)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes)


def by_model_plot(ax, doc: dict) -> None:
    """Bars per model shape: dispatch, combine and round trip (bf16, not zero-copy) GB/s at --tokens and
    --default-sms (else the first SM count measured), device time where measured."""
    args = doc["args"]
    ops = ("dispatch", "cached_dispatch", "combine", "round_trip")
    names = list(dict.fromkeys(r.get("model") for r in doc["results"]))
    width = 0.8 / len(ops)
    for k, op in enumerate(ops):
        heights = []
        for name in names:
            rows = [r for r in doc["results"] if r.get("model") == name and r["op"] == op and r["dtype"] == "bf16"
                    and not r.get("zero_copy") and r["tokens"] == args["tokens"]]
            rows = [r for r in rows if r["num_sms"] == args["default_sms"]] or rows[:1]
            heights.append(_device_gbps(rows[0])[0] if rows else 0.0)
        ax.bar([i + k * width for i in range(len(names))], heights, width, label=op)
    labels = []
    for name in names:
        r = next(r for r in doc["results"] if r.get("model") == name)
        labels.append(f"{name}\n{r['experts']}/{r['topk']}/{r['hidden']}")
    ax.set_xticks([i + width * (len(ops) - 1) / 2 for i in range(len(names))], labels, fontsize=7)
    ax.set(ylabel="NVLink-crossing GB/s per GPU", title=f"per model shape (experts/top-k/hidden), "
           f"{args['tokens']} tokens/rank")
    _legend(ax)


# the warm start's consecutive parts (Bench.first_dispatch); what they leave of the process's age is unaccounted_s
STARTUP_PARTS = ("process_age_at_mpi_start_s", "mpi_init_s", "gpu_probe_s", "buffer_sizes_s", "buffer_s",
                 "first_layout_dispatch_s")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), to time start-up including the imports."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except Exception:
        return None


def start(argv=None, args: argparse.Namespace | None = None):
    """The benchmark's start-up, up to its arguments: the arguments parsed (unless ``args`` are given: run as the
    main job, ``cupy_ep.bench`` parsed them first), MPI started with the imports and CuPy's runtime start (the
    GPU probe) running beside it (already done by ``cupy_ep.bench`` when it runs as the main job), the
    defaults that depend on the backend filled in, the arguments checked against the job (:func:`check_world`)
    and the start-up times put into them. Returns ``(comm, args)``."""
    process_age_at_main, t_main = process_age_s(), time.perf_counter()
    if args is None:
        args = parse_args(argv)  # before MPI: --help and bad values end here
    started = cupy_ep.start_world()
    comm = started.comm
    gpu_visible = bool(started.gpu if started.gpu is not None else cupy_ep.gpu_available())
    resolve_defaults(args, gpu_visible and args.backend != "host")
    check_world(args, comm, gpu_visible)
    args.mpi_init_s = started.mpi_init_s
    args.gpu_probe_s = started.preload_wait_s  # the imports + probe left over once MPI was up
    args.mpi_start = started.how
    args.process_age_at_main_s = process_age_at_main  # interpreter start, imports and (run as main) MPI start
    # interpreter start + the imports before start_mpi began (in cupy_ep.bench, or in this function)
    args.process_age_at_mpi_start_s = None if process_age_at_main is None else \
        max(0.0, process_age_at_main - (t_main - started.t_begin))
    return comm, args


def main(argv=None, args: argparse.Namespace | None = None):
    """``python -m cupy_ep.bench``: ``argv`` (default ``sys.argv[1:]``) or already parsed ``args``."""
    comm, args = start(argv, args)
    if args.mode == "low-latency":
        from . import bench_ll
        bench_ll.main(args, comm)
        return
    if args.mode == "internode":
        from . import bench_internode
        bench_internode.main(args, comm)
        return
    if comm.Get_rank() == 0 and (args.backend == "host" or not cupy_ep.gpu_available()):
        why = "--backend host" if args.backend == "host" else "NO GPU visible"
        print(f"cupy_ep.bench: {why} -> host backend (numpy + MPI); the numbers are not GPU numbers; results go to "
              f"{args.out}", flush=True)
    Bench(args, comm).run()
