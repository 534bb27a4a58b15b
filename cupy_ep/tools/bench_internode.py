"""``python -m cupy_ep.bench --mode internode``: internode dispatch / combine bandwidth (DeepEP's figures).

Topology: the job's nodes (MPI shared-memory split); when it fits one box, ``CUPY_EP_BENCH_RANKS_PER_NODE``
(default R / 2) GPUs per "node", so 2 ranks on a 2-GPU box run as 2 nodes x 1 GPU. Transport:
``CUPY_EP_INTERNODE_TRANSPORT`` (``nvshmem`` default, or ``ipc``).

Per op (FP8 and BF16 dispatch, cached BF16 dispatch, BF16 combine) it reports, as DeepEP does:
  * ``rdma_gbps`` = (token, destination node) pairs, own node included, x row bytes / time ("logical" RDMA bytes;
    FP8 rows count H + 4 * H/128 bytes);
  * ``nvl_gbps``  = received rows x row bytes / time;
  * ``rdma_ceiling_gbps``: the transport's put bandwidth (``internode_put_bandwidth``: every GPU puts to every other
    PE of its RDMA domain at once) measured in the same run, and ``rdma_vs_ceiling``.
Results are verified against :mod:`cupy_ep.reference` / :mod:`cupy_ep.internode_reference` before timing (a mismatch
aborts). Writes ``<out>/bench_internode_<transport>_ep<R>.json`` and ``.md`` (``..._shared_gpu`` where ranks share
a GPU: their timings are copies through that GPU, and the report says so).
"""
from __future__ import annotations

import os

import numpy as np

from cupy_ep import Buffer, bootstrap, internode_reference, reference
from cupy_ep import config as cfgmod
from . import harness
from .harness import (GpuTimer, make_routing, results_stem, shared_gpu_markdown, shared_gpu_warning, shared_gpus,
                      to_device, write_report)


def ranks_per_node(comm) -> int:
    """GPUs per node for the benchmark: the real split when the job spans nodes, else the env override or R/2."""
    local = bootstrap.split_shared(comm)
    local_size = local.Get_size()
    local.Free()
    R = comm.Get_size()
    if local_size < R:
        return local_size
    value = int(os.environ.get("CUPY_EP_BENCH_RANKS_PER_NODE", max(1, R // 2)))
    if value <= 0 or R % value or R // value < 2:
        # every rank reads the same environment and ends alike (status 1); rank 0 says why
        raise SystemExit(f"CUPY_EP_BENCH_RANKS_PER_NODE={value}: must divide {R} into at least 2 nodes"
                         if comm.Get_rank() == 0 else 1)
    return value


def logical_bytes(idx: np.ndarray, num_experts: int, num_ranks: int, gpus_per_node: int) -> tuple[int, int]:
    """``(rdma_rows, nvl_rows)`` this rank sends: (token, destination node) pairs and (token, destination rank)
    pairs (own node / rank included)."""
    itr = reference.token_rank_matrix(idx, num_experts, num_ranks)
    return int(internode_reference.node_matrix(itr, gpus_per_node).sum()), int(itr.sum())


class InternodeBench(harness.Tool):
    """The internode benchmark of one model shape (``args.hidden``, ``args.topk``, ``args.experts``): :func:`main`
    runs one per ``--model`` shape."""

    def __init__(self, args, comm):
        super().__init__(args, comm)
        self.G = ranks_per_node(comm)
        self.N = self.R // self.G
        self.sms = args.default_sms
        self.dcfg = cfgmod.get_dispatch_config(self.R, self.sms, 2 * args.hidden)
        self.ccfg = cfgmod.get_combine_config(self.R, self.sms, 2 * args.hidden)
        sizes = [cfgmod.internode_buffer_bytes(self.N, self.G, 2 * args.hidden, c, args.topk)
                 for c in (self.dcfg, self.ccfg)]
        nvl, rdma = max(s[0] for s in sizes), max(s[1] for s in sizes)
        self.ceiling_bytes = 64 << 20
        rdma = max(rdma, cfgmod.align_up(4 << 20) + (1 + self.N) * self.ceiling_bytes)
        self.buf = Buffer(comm, num_nvl_bytes=nvl, num_rdma_bytes=rdma, num_ranks_per_node=self.G,
                          check_values=False, backend="cuda")
        self.transport = self.buf.impl.internode_transport
        self.records: list[dict] = []
        self.shared: list = []  # groups of ranks sharing a GPU (run() finds them)

    def run(self):
        import cupy
        a, R, buf = self.args, self.R, self.buf
        self.log(f"cupy_ep.bench --mode internode: {self.N} nodes x {self.G} GPUs, transport {self.transport}, "
                 f"tokens={a.tokens} hidden={a.hidden} topk={a.topk} experts={a.experts} sms={self.sms}")
        rng = np.random.default_rng(a.seed + self.rank)
        x_np = rng.standard_normal((a.tokens, a.hidden), dtype=np.float32).astype(reference.bfloat16)
        x8_np = rng.integers(0, 0x7f, size=(a.tokens, a.hidden), dtype=np.uint8)
        s_np = rng.random((a.tokens, -(-a.hidden // 128)), dtype=np.float32)
        idx_np = make_routing(rng, a.tokens, a.topk, a.experts, R, a.skew, a.routing, a.seed)
        w_np = rng.random((a.tokens, a.topk), dtype=np.float32)
        rdma_rows, _ = logical_bytes(idx_np, a.experts, R, self.G)
        timer = GpuTimer(self.comm, a.iters, a.warmup)
        with cupy.cuda.Device(buf.device_id):
            self.shared = shared_gpus(self.comm)
            if self.shared:
                self.log(shared_gpu_warning("cupy_ep.bench --mode internode", self.shared, None))
            x, x8 = to_device(x_np), to_device((x8_np, s_np))
            idx, w = to_device(idx_np), to_device(w_np)
            layout = buf.get_dispatch_layout(idx, a.experts)[:4]
            kw = dict(num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1], is_token_in_rank=layout[3],
                      num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w, config=self.dcfg)
            recv_x, _, _, _, handle, _ = buf.dispatch(x, **kw)
            num_recv = int(recv_x.shape[0])
            y = recv_x  # combine the received rows back (bf16)
            combined, _, _ = buf.combine(y, handle, config=self.ccfg)
            cupy.cuda.runtime.deviceSynchronize()
            self.verify(x_np, idx_np, w_np, recv_x, handle, combined, a.experts)

            ceiling_fn = buf.impl.internode_put_ceiling_launcher(self.ceiling_bytes, 2 * self.sms)
            t = timer(ceiling_fn)
            ceiling = (self.N - 1) * self.ceiling_bytes / (t.median_us * 1e-6) / 1e9
            self.log(f"  RDMA-domain put ceiling ({self.transport}): {ceiling:.1f} GB/s per GPU")

            fp8_row = a.hidden + 4 * (-(-a.hidden // 128))
            runs = [("internode_dispatch", "fp8", lambda: buf.dispatch(x8, **kw), fp8_row),
                    ("internode_dispatch", "bf16", lambda: buf.dispatch(x, **kw), 2 * a.hidden),
                    ("internode_dispatch_cached", "bf16", lambda: buf.dispatch(x, handle=handle, config=self.dcfg),
                     2 * a.hidden),
                    ("internode_combine", "bf16", lambda: buf.combine(y, handle, config=self.ccfg), 2 * a.hidden)]
            for op, dtype, fn, row in runs:
                t = timer(fn)
                rdma_gbps = rdma_rows * row / (t.median_us * 1e-6) / 1e9
                nvl_gbps = num_recv * row / (t.median_us * 1e-6) / 1e9
                rec = {"op": op, "dtype": dtype, "transport": self.transport, "time_us_median": t.median_us,
                       "time_us_min": t.min_us, "rdma_gbps": rdma_gbps, "nvl_gbps": nvl_gbps,
                       "rdma_ceiling_gbps": ceiling, "rdma_vs_ceiling": rdma_gbps / ceiling if ceiling else None,
                       "rdma_bytes": rdma_rows * row, "nvl_bytes": num_recv * row,
                       "tokens": a.tokens, "model": getattr(a, "model_name", None), "hidden": a.hidden,
                       "topk": a.topk, "experts": a.experts, "num_ranks": R,
                       "num_nodes": self.N, "gpus_per_node": self.G, "num_sms": self.sms,
                       "config_dispatch": vars(self.dcfg), "config_combine": vars(self.ccfg)}
                # gather: the slowest rank's time is already what GpuTimer reports; bandwidths are rank 0's bytes
                self.records.append(rec)
                self.log(f"  {op:26s} {dtype:4s} median {t.median_us:9.1f} us  RDMA {rdma_gbps:7.1f} GB/s  "
                         f"NVL {nvl_gbps:7.1f} GB/s")
        buf.destroy()

    def verify(self, x_np, idx_np, w_np, recv_x, handle, combined, num_experts):
        """Bit-exact check of the BF16 dispatch and of the combine (of the received rows) before any timing."""
        import cupy
        gathered = self.comm.allgather((x_np, idx_np, w_np))
        ref = reference.dispatch([g[0] for g in gathered], [g[1] for g in gathered], [g[2] for g in gathered],
                                 num_experts, self.rank)
        got = cupy.asnumpy(recv_x.view(cupy.uint16))
        problems = []
        if got.shape != ref.recv_x.shape or not np.array_equal(got, ref.recv_x.view(np.uint16)):
            problems.append("recv_x differs from the reference")
        ys = self.comm.allgather(got.view(reference.bfloat16))
        itr = [reference.token_rank_matrix(g[1], num_experts, self.R) for g in gathered]
        want, _ = internode_reference.combine(ys, itr, self.rank, self.G)
        if not np.array_equal(cupy.asnumpy(combined.view(cupy.uint16)), want.view(np.uint16)):
            problems.append("combined_x differs from internode_reference.combine")
        ok = bootstrap.allreduce(self.comm, not problems, "land")
        if not ok:
            raise SystemExit(f"cupy_ep.bench --mode internode: verification failed on rank {self.rank}: {problems}")
        self.log("  verified against the reference (dispatch bit-exact, combine bit-exact)")

    def write(self, records: list | None = None, skipped: list | None = None, shape_runs: list | None = None) -> None:
        """The report of ``records`` (default: this bench's; :func:`main` passes every model shape's), of the
        shapes ``skipped`` and of each shape's run (``shape_runs``: wall time and kernel counters)."""
        records = self.records if records is None else records

        def lines(common):
            out = [f"# cupy_ep internode benchmark ({self.N} nodes x {self.G} GPUs, {self.transport}, {common['gpu']}"
                   + (", ranks sharing a GPU)" if self.shared else ")"), ""]
            out += shared_gpu_markdown(self.shared, None, "RDMA GB/s and the RDMA ceiling are copies through the "
                                       "shared GPU too, not network figures.")
            out += [f"commit `{common['commit']}`; {self.args.tokens} tokens/rank; {self.sms} SMs; "
                    f"{self.args.iters} iterations. RDMA GB/s = (token, node) pairs incl. the own node x row bytes / "
                    "time (DeepEP's logical figure); NVL GB/s = received rows x row bytes / time.", "",
                    "| model | experts / top-k / hidden | op | dtype | median us | RDMA GB/s | NVL GB/s "
                    "| RDMA ceiling GB/s | RDMA / ceiling |", "|---|---|---|---|---|---|---|---|---|"]
            for r in records:
                out.append(f"| {r.get('model') or '-'} | {r.get('experts', self.args.experts)} / "
                           f"{r.get('topk', self.args.topk)} / {r.get('hidden', self.args.hidden)} | {r['op']} | "
                           f"{r['dtype']} | {r['time_us_median']:.1f} | {r['rdma_gbps']:.1f} | "
                           f"{r['nvl_gbps']:.1f} | {r['rdma_ceiling_gbps']:.1f} | {r['rdma_vs_ceiling']:.2f} |")
            for sk in skipped or []:
                out += ["", f"**Skipped** {sk['model']} ({sk['experts']} experts, top-{sk['topk']}, hidden "
                        f"{sk['hidden']}) in {sk['mode']} mode: {sk['reason']}."]
            return out + harness.shape_runs_markdown(shape_runs)
        write_report(self.args.out, results_stem(f"bench_internode_{self.transport}_ep{self.R}", self.shared),
                     records, dict(num_ranks=self.R, num_nodes=self.N, gpus_per_node=self.G,
                                   transport=self.transport, shared_gpu_ranks=self.shared or None,
                                   skipped=skipped or [], shape_runs=shape_runs or [],
                                   args=harness.args_doc(self.args)), lines, "internode")


def main(args, comm) -> None:
    """Entry from :func:`cupy_ep.tools.bench.main` (``--mode internode``; its ``check_world`` made sure of a GPU and
    at least 2 ranks): one :class:`InternodeBench` per ``--model`` shape it can run (the others logged as skipped,
    with the reason, and listed in the report), one report of them all."""
    from .bench import run_each_shape
    run_each_shape(args, comm, "internode", InternodeBench)


__all__ = ["InternodeBench", "logical_bytes", "ranks_per_node", "main", "Buffer"]
