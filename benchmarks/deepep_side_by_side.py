"""DeepEP-style code timed on two implementations of DeepEP's API: cupy_ep's drop-in (``cupy_ep.deep_ep``) and
DeepEP itself (``deep_ep``: its legacy kernels, built outside this tree by ``scripts/deepep.sh``). One script, the
same inputs and the same timers (``cupy_ep.tools.harness``), on the same machine; one implementation per launch
(two NVSHMEM worlds do not share a process), then ``--compare`` puts the two side by side.

    mpirun -np 2 python benchmarks/deepep_side_by_side.py --impl cupy_ep --out DIR
    PYTHONPATH=/tmp/deepep/src:$PYTHONPATH mpirun -np 2 python benchmarks/deepep_side_by_side.py --impl deepep --out DIR
    python benchmarks/deepep_side_by_side.py --compare DIR          # DIR/side_by_side.md from the two JSON files
    CUPY_EP_BACKEND=host mpiexec -n 2 python benchmarks/deepep_side_by_side.py --impl cupy_ep --out DIR  # no GPU

Ops: ``get_dispatch_layout``, ``dispatch`` from the layout, the cached ``dispatch`` (the handle), ``combine``, each
at ``--tokens`` with each implementation's own configs at ``--sms`` SMs (``Buffer.set_num_sms``,
``get_dispatch_config``, ``get_combine_config``); ``low_latency_dispatch`` (FP8) and ``low_latency_combine`` at
``--ll-tokens``. Timings (GPU): *call* = CUDA events around the call after a barrier and an L2 flush, the slowest
rank per iteration; *graph* = one op per CUDA-graph replay (two for the low-latency calls, whose buffers
alternate); *steady* = 10 ops back to back minus a flush-only graph, per op. torch's current stream is bound to the
timer's stream around each call, so both implementations run where the timer's events are. An op an
implementation refuses (a hidden size or top-k its kernels lack) or that cannot be captured is recorded with the
reason instead of a time.

Before timing, each implementation's outputs are checked: the rows are small integers in BF16, so that every sum
is exact in any order: ``combine(dispatch(x)) == x * (ranks the token reached)``, and the low-latency combine of a
BF16 dispatch with unit weights ``== x * (valid top-k entries)``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

IMPLS = ("cupy_ep", "deepep")
STEADY_N = 10


def parse_args(argv=None) -> argparse.Namespace:
    from cupy_ep.tools import models
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--impl", choices=IMPLS, help="the implementation this launch times")
    p.add_argument("--compare", metavar="DIR", help="write DIR/side_by_side.md from DIR's results and exit")
    p.add_argument("--model", default=models.DEFAULT_MODEL, choices=list(models.MODELS), help="the MoE shape")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank, normal mode")
    p.add_argument("--ll-tokens", type=int, default=128, help="tokens per rank (and max tokens), low-latency mode")
    p.add_argument("--sms", type=int, default=24, help="SMs of the normal-mode kernels (even)")
    p.add_argument("--iters", type=int, default=50, help="timed iterations per op and timing")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    p.add_argument("--routing", default="uniform", help="uniform, zipf:S or hot-expert:F")
    p.add_argument("--seed", type=int, default=1234, help="inputs of rank r from seed + r")
    p.add_argument("--out", default="side_by_side", help="results folder")
    args = p.parse_args(argv)
    if args.compare is None and args.impl is None:
        p.error("give --impl (a timing launch) or --compare DIR")
    if args.sms < 2 or args.sms % 2:
        p.error(f"--sms: must be even and at least 2 (DeepEP's rule), got {args.sms}")
    return args


def implementation(name: str):
    """The module whose ``Buffer`` this launch drives: ``cupy_ep.deep_ep`` or DeepEP's ``deep_ep``."""
    if name == "cupy_ep":
        import cupy_ep.deep_ep as mod
        return mod
    try:
        import deep_ep as mod
    except ImportError as e:
        raise SystemExit(f"deepep_side_by_side: cannot import deep_ep ({e}); build it with scripts/deepep.sh build "
                         "and put /tmp/deepep/src on PYTHONPATH") from e
    return mod


class Runner:
    """One implementation's buffers, inputs, checks and timings over ``comm`` (``Get_rank``, ``Get_size``,
    ``Barrier``, ``allgather``: mpi4py's, or cupy_ep's adapter of a torch.distributed group)."""

    def __init__(self, args, comm, mod):
        import torch

        from cupy_ep.tools import harness, models
        self.args, self.comm, self.mod, self.harness = args, comm, mod, harness
        self.rank, self.R = comm.Get_rank(), comm.Get_size()
        self.shape = models.MODELS[args.model]
        self.gpu = torch.cuda.is_available() and os.environ.get("CUPY_EP_BACKEND", "") != "host"
        self.device = torch.device("cuda", self._local_rank() % torch.cuda.device_count()) if self.gpu else "cpu"
        if self.gpu:
            torch.cuda.set_device(self.device)  # DeepEP's Buffer works on the current device
        self.records: list[dict] = []

    def _local_rank(self) -> int:
        for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "LOCAL_RANK", "SLURM_LOCALID"):
            if var in os.environ:
                return int(os.environ[var])
        return self.rank

    # ---- inputs -----------------------------------------------------------------------------------
    def inputs(self, tokens: int):
        """``x [T, H] bf16`` (integers in [-4, 4]: exact sums), ``topk_idx [T, K] int64``, unit ``topk_weights``."""
        import torch
        s, a = self.shape, self.args
        rng = np.random.default_rng(a.seed + self.rank)
        x = torch.from_numpy(rng.integers(-4, 5, size=(tokens, s.hidden)).astype(np.float32)).to(torch.bfloat16)
        idx = torch.from_numpy(self.harness.make_routing(rng, tokens, s.topk, s.experts, self.R, 0.0, a.routing,
                                                         a.seed))
        w = torch.ones((tokens, s.topk), dtype=torch.float32)
        return x.to(self.device), idx.to(self.device), w.to(self.device)

    # ---- timing -----------------------------------------------------------------------------------
    def on_timer_stream(self, fn):
        """``fn`` with torch's current stream set to CuPy's current one (the timer's), on the GPU."""
        if not self.gpu:
            return fn
        import cupy
        import torch

        def run():
            stream = torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr, device=self.device)
            with torch.cuda.stream(stream):
                return fn()
        return run

    def time(self, op: str, fn, hows, per_replay: int = 1) -> None:
        """Records of ``op`` timed each way in ``hows`` ("call", "graph", "steady"); a failure is recorded with its
        reason (every rank must fail alike: the refusals are argument checks)."""
        a, h = self.args, self.harness
        if not self.gpu:
            t = h.HostTimer(self.comm, a.iters, a.warmup)(fn)
            self.records.append(dict(op=op, timing="call", median_us=t.median_us, min_us=t.min_us))
            return
        import cupy
        timer = h.GpuTimer(self.comm, a.iters, a.warmup)
        wrapped = self.on_timer_stream(fn)
        for how in hows:
            try:
                if how == "call":
                    stream = cupy.cuda.Stream(non_blocking=True)
                    with stream:
                        t = timer(wrapped)
                elif how == "graph":
                    t = timer.graph(wrapped, per_replay=per_replay)
                else:
                    t = h.resolved(timer.steady(wrapped, STEADY_N))
                rec = dict(median_us=t.median_us, min_us=t.min_us) if t else dict(note="not resolved")
            except Exception as e:  # noqa: BLE001 - a refusal or a failed capture is a result here
                cupy.cuda.runtime.deviceSynchronize()
                rec = dict(note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            self.comm.Barrier()
            self.records.append(dict(op=op, timing=how, **rec))

    def refused(self, op: str, e: Exception) -> None:
        self.records.append(dict(op=op, timing="-", note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))

    # ---- normal mode ------------------------------------------------------------------------------
    def normal(self) -> None:
        import torch
        mod, s, R = self.mod, self.shape, self.R
        mod.Buffer.set_num_sms(self.args.sms)
        dcfg, ccfg = mod.Buffer.get_dispatch_config(R), mod.Buffer.get_combine_config(R)
        hidden_bytes = s.hidden * 2
        nvl = max(dcfg.get_nvl_buffer_size_hint(hidden_bytes, R), ccfg.get_nvl_buffer_size_hint(hidden_bytes, R))
        buf = mod.Buffer(None, nvl, 0, explicitly_destroy=True, comm=self.comm)
        try:
            x, idx, w = self.inputs(self.args.tokens)
            layout = buf.get_dispatch_layout(idx, s.experts)
            per_rank, _, per_expert, in_rank, _ = layout

            def dispatch():
                return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                    num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, config=dcfg)
            recv_x, _, _, _, handle, _ = dispatch()
            combined = buf.combine(recv_x, handle, config=ccfg)[0]
            want = x.float() * in_rank.sum(dim=1, keepdim=True).float()
            self.check("combine(dispatch(x))", torch.equal(combined.float(), want))
            self.time("get_dispatch_layout", lambda: buf.get_dispatch_layout(idx, s.experts), ("call", "graph"))
            self.time("dispatch", dispatch, ("call",))  # the layout's counts reach the host: not capturable
            self.time("cached_dispatch", lambda: buf.dispatch(x, handle=handle, config=dcfg),
                      ("call", "graph", "steady"))
            self.time("combine", lambda: buf.combine(recv_x, handle, config=ccfg), ("call", "graph", "steady"))
        finally:
            self.sync()
            buf.destroy()

    # ---- low-latency mode -------------------------------------------------------------------------
    def low_latency(self) -> None:
        import torch
        mod, s, R, M = self.mod, self.shape, self.R, self.args.ll_tokens
        rdma = mod.Buffer.get_low_latency_rdma_size_hint(M, s.hidden, R, s.experts)
        buf = mod.Buffer(None, 0, rdma, low_latency_mode=True, num_qps_per_rank=s.experts // R,
                         explicitly_destroy=True, comm=self.comm)
        try:
            x, idx, w = self.inputs(M)
            try:
                recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, s.experts, use_fp8=False)
                combined = buf.low_latency_combine(recv_x, idx, w, handle)[0]
            except (AssertionError, ValueError, RuntimeError, TypeError) as e:
                self.refused("low_latency_dispatch", e)
                return
            want = x.float() * (idx >= 0).sum(dim=1, keepdim=True).float()
            self.check("low_latency_combine(low_latency_dispatch(x))", torch.equal(combined.float(), want))
            self.time("low_latency_dispatch", lambda: buf.low_latency_dispatch(x, idx, M, s.experts, use_fp8=True),
                      ("call", "graph", "steady"), per_replay=2)
            self.time("low_latency_combine", lambda: buf.low_latency_combine(recv_x, idx, w, handle),
                      ("call", "graph", "steady"), per_replay=2)
        finally:
            self.sync()
            buf.destroy()

    def sync(self) -> None:
        if self.gpu:
            import torch
            torch.cuda.synchronize()
        self.comm.Barrier()

    def check(self, what: str, ok: bool) -> None:
        """Every rank's verdict; a wrong output ends the run on all of them."""
        bad = [r for r, good in enumerate(self.comm.allgather(bool(ok))) if not good]
        if bad:
            raise SystemExit(f"deepep_side_by_side ({self.args.impl}): {what} differs from the exact result on "
                             f"rank(s) {bad}")
        self.records.append(dict(op=what, timing="check", note="exact"))


def write(args, comm, records: list, gpu: bool) -> Path:
    """``<out>/side_by_side_<impl>.json`` (rank 0)."""
    from cupy_ep.tools import harness
    out = Path(args.out)
    path = out / f"side_by_side_{args.impl}.json"
    if comm.Get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        doc = dict(impl=args.impl, commit=harness.git_commit(), gpu=harness.gpu_name() if gpu else None,
                   backend="cuda" if gpu else "host", num_ranks=comm.Get_size(), model=args.model,
                   tokens=args.tokens, ll_tokens=args.ll_tokens, sms=args.sms, iters=args.iters,
                   routing=args.routing, seed=args.seed, results=records)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"deepep_side_by_side: wrote {path}", flush=True)
    return path


def compare(folder) -> str:
    """The side-by-side table of ``folder``'s ``side_by_side_<impl>.json`` files (either may be missing)."""
    docs = {}
    for impl in IMPLS:
        p = Path(folder) / f"side_by_side_{impl}.json"
        if p.exists():
            docs[impl] = json.loads(p.read_text())
    if not docs:
        raise SystemExit(f"deepep_side_by_side --compare: no side_by_side_*.json in {folder}")
    first = next(iter(docs.values()))
    lines = [f"# DeepEP's API on two implementations: {first['model']}, EP{first['num_ranks']}", "",
             ", ".join(f"{impl}: commit `{d['commit']}`, {d['backend']} on {d['gpu'] or 'the host'}"
                       for impl, d in docs.items()) + f"; {first['tokens']} tokens per rank (low-latency "
             f"{first['ll_tokens']}), {first['sms']} SMs, routing {first['routing']}, {first['iters']} iterations, "
             "median us of the slowest rank.", "",
             "| op | timing | cupy_ep us | deepep us | cupy_ep / deepep |", "|---|---|---|---|---|"]

    def cell(impl, op, how):
        d = docs.get(impl)
        if d is None:
            return "not run", None
        for r in d["results"]:
            if r["op"] == op and r["timing"] == how:
                return (f"{r['median_us']:.1f}", r["median_us"]) if "median_us" in r else (r.get("note", "-"), None)
        return "-", None
    keys = list(dict.fromkeys((r["op"], r["timing"]) for d in docs.values() for r in d["results"]))
    for op, how in keys:
        (a_text, a), (b_text, b) = cell("cupy_ep", op, how), cell("deepep", op, how)
        ratio = f"{a / b:.2f}" if a and b else "-"
        lines.append(f"| {op} | {how} | {a_text} | {b_text} | {ratio} |")
    md = "\n".join(lines) + "\n"
    (Path(folder) / "side_by_side.md").write_text(md)
    return md


def main(argv=None, comm=None) -> None:
    """``comm``: the job's communicator (default :func:`cupy_ep.bootstrap.world`: mpi4py's world under mpirun,
    torch.distributed's default group under torchrun; DeepEP takes either as ``comm=``)."""
    args = parse_args(argv)
    if args.compare:
        print(compare(args.compare), end="")
        return
    if comm is None:
        from cupy_ep import bootstrap
        comm = bootstrap.world()
    runner = Runner(args, comm, implementation(args.impl))
    if runner.rank == 0:
        print(f"deepep_side_by_side: {args.impl} ({runner.mod.__name__}), {args.model}, EP{runner.R}, "
              f"{'GPU' if runner.gpu else 'host backend'}", flush=True)
    runner.normal()
    runner.low_latency()
    write(args, comm, runner.records, runner.gpu)


if __name__ == "__main__":
    main(sys.argv[1:])
