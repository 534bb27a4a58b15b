"""Before/after timing of two trees of cupy_ep inside one process per rank, the trees' calls interleaved.

    mpirun -n 2 python benchmarks/ab_inprocess.py BASE_TREE [--reps 8] [--iters 50] [--out DIR]

The checkout's ``cupy_ep`` is the head; ``BASE_TREE`` (a folder holding another tree's ``cupy_ep/`` and
``cuda_src/``, as ``scripts/bench_ab.sh prepare COMMIT`` writes it to ``.carry/ab_base``) is imported a second
time under the name ``cupy_ep_ab_base``. Each tree gets its own Buffers (a normal-mode one and a low-latency one
over the CUDA-IPC transport: NVSHMEM starts once per process) and its own kernels (each tree compiles its own
``cuda_src/``); both are driven by the same inputs and timed by the same timers, the benchmark's own
(:class:`cupy_ep.tools.harness.GpuTimer`: one op per CUDA-graph replay, and ``steady``, n ops back to back per
replay; :func:`cupy_ep.tools.bench_ll.host_us_per_call`: calls back to back on the host).

Why one process: separate benchmark runs of the two trees differ by more than the changes to be shown (which
cores the ranks got, the clocks, the other rank's timing on a shared GPU): the host time per call of the same
tree varies by up to 2x between runs. Here every repetition times both trees back to back in the same
processes, in the order base, head, then head, base, and so on, and the ratio head/base is taken per repetition
and then its median over the repetitions, so that what drifts between repetitions cancels.

The ops: the layout, the cached dispatch (BF16, FP8, each also zero-copy) and the combine (also zero-copy) at
4096 tokens per rank, DeepSeek-V3's shape (hidden 7168, top-8 of 256 experts), 24 SMs; the low-latency dispatch
(FP8) and combine (24-bit, bf16 and LogFMT partials) at 128 tokens per rank. Every op is timed *graph* and
*steady* (device time) and by its host time per call (``check_values=False``): the low-latency pair as *host*,
calls back to back (the benchmark's way; also with ``check_values=True``), the normal-mode ops as *host (alone)*,
each call from an idle device (:func:`host_us_alone`). The results go to ``DIR/ab_inprocess.json`` and ``.md``;
:func:`summarize` makes the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

BASE_NAME = "cupy_ep_ab_base"
HOST_CALLS = 100  # back-to-back calls per host timing
T, H, K, E, SMS, M = 4096, 7168, 8, 256, 24, 128


def load_tree(root, name: str = BASE_NAME):
    """Import the ``cupy_ep`` package found under ``root`` as the top-level package ``name`` (its modules import
    each other relatively, so the copy is complete and separate from the checkout's ``cupy_ep``)."""
    pkg = Path(root) / "cupy_ep"
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    if spec is None or spec.loader is None:
        raise ImportError(f"no cupy_ep package under {root}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def tree_commit(root) -> str:
    """The commit a prepared tree names in its COMMIT file (scripts/bench_ab.sh prepare), else '?'."""
    path = Path(root) / "COMMIT"
    return path.read_text().strip() if path.is_file() else "?"


def host_us_alone(comm, fn, calls: int, sync) -> float:
    """Host time of ``fn`` timed one call at a time, each from an idle device (``sync()``) and an MPI barrier: the
    median over ``calls`` of the slowest rank's. For the normal-mode ops, whose device time exceeds their host
    time: back to back, their calls would also wait for the device's queue."""
    times = []
    for _ in range(calls):
        sync()
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    sync()
    return float(np.median(np.max(np.array(comm.allgather(times)), axis=0)))


def summarize(samples: dict) -> list[dict]:
    """``samples[(op, timing)] = {"base": [us per repetition], "head": [...]}`` -> one row per figure: the median
    of each tree over its repetitions, ``ratio`` = the median over repetitions of head/base (the two measured in
    the same repetition), ``low``/``high`` = the smallest and largest of those per-repetition ratios, and
    ``base_spread`` = the base tree's own spread between repetitions (max/min - 1)."""
    rows = []
    for (op, timing), by_tree in samples.items():
        base, head = by_tree.get("base", []), by_tree.get("head", [])
        # a None is a steady time that was not resolved (harness.resolved): that repetition has no pair
        pairs = [h / b for b, h in zip(base, head) if b is not None and h is not None]
        base = [b for b in base if b is not None]
        head = [h for h in head if h is not None]
        if not pairs:
            continue
        rows.append({"op": op, "timing": timing, "reps": len(pairs), "base_us": statistics.median(base),
                     "head_us": statistics.median(head), "ratio": statistics.median(pairs), "low": min(pairs),
                     "high": max(pairs), "base_spread": max(base) / min(base) - 1 if min(base) > 0 else None})
    return rows


def markdown(rows: list[dict], about: dict) -> str:
    """The table of :func:`summarize`'s rows, under a line naming the trees, the machine and the run."""
    lines = [f"Base `{about['base_commit']}`, head `{about['head_commit']}`; {about['gpu']}, {about['ranks']} ranks"
             f"{' as MPS clients of one GPU' if about.get('shared_gpu') else ''}; {about['reps']} repetitions "
             f"(order base, head / head, base alternating), {about['iters']} iterations per timing; "
             f"{about.get('first', 'base')}'s memory allocated first; "
             f"{about['date']}.", "",
             "| op | timing | base us | head us | head/base (median of pairs) | pairs min-max | base spread |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        spread = "-" if r["base_spread"] is None else f"{100 * r['base_spread']:.1f} %"
        lines.append(f"| {r['op']} | {r['timing']} | {r['base_us']:.1f} | {r['head_us']:.1f} | {r['ratio']:.3f} | "
                     f"{r['low']:.3f}-{r['high']:.3f} | {spread} |")
    return "\n".join(lines) + "\n"


class Tree:
    """One tree's Buffers, inputs on the device and ops: ``ops[name] = (fn, per_replay)`` (2: a low-latency op)."""

    def __init__(self, ep, comm, inputs_np: dict, to_device):
        import cupy
        R = comm.Get_size()
        self.ep, hidden_bytes = ep, 2 * H
        Buffer, Config = ep.Buffer, ep.Config
        ring = max(dataclasses.replace(get(R, hidden_bytes=hidden_bytes), num_sms=SMS).get_nvl_buffer_size_hint(
            hidden_bytes, R) for get in (Buffer.get_dispatch_config, Buffer.get_combine_config))
        nvl = max(ring, Buffer.get_zero_copy_nvl_size_hint(T, hidden_bytes, R, K), Config(24, 6, 256)
                  .get_nvl_buffer_size_hint(hidden_bytes, R))
        self.buf = buf = Buffer(comm, num_nvl_bytes=int(-(-nvl // (1 << 21)) * (1 << 21)), check_values=False)
        self.ll = ll = Buffer(comm, 0, ep.config.low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True,
                              low_latency_transport="ipc", check_values=False)
        self.device = cupy.cuda.Device(buf.device_id)
        with self.device:
            inputs = {k: to_device(v) for k, v in inputs_np.items()}
            x, x8, idx, w = (inputs[k] for k in ("x", "x8", "idx", "w"))
            dcfg = dataclasses.replace(Buffer.get_dispatch_config(R, hidden_bytes=hidden_bytes), num_sms=SMS)
            ccfg = dataclasses.replace(Buffer.get_combine_config(R, hidden_bytes=hidden_bytes), num_sms=SMS)
            layout = buf.get_dispatch_layout(idx, E)
            first = {}
            for name, xx in (("bf16", x), ("fp8", x8)):
                first[name] = buf.dispatch(xx, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                           num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w,
                                           config=dcfg)
            recv_x, handle = first["bf16"][0], first["bf16"][4]
            fp8_handle = first["fp8"][4]
            lx, lidx, lw, ly = (inputs[k] for k in ("ll_x", "ll_idx", "ll_w", "ll_y"))
            _, _, ll_handle, _, _ = ll.low_latency_dispatch(lx, lidx, M, E, use_fp8=True)
            cupy.cuda.runtime.deviceSynchronize()
        self.ops = {
            "layout": (lambda: buf.get_dispatch_layout(idx, E), 1),
            "cached_dispatch bf16": (lambda: buf.dispatch(x, handle=handle, config=dcfg), 1),
            "cached_dispatch bf16 zero-copy": (lambda: buf.dispatch(x, handle=handle, config=dcfg, zero_copy=True),
                                               1),
            "cached_dispatch fp8": (lambda: buf.dispatch(x8, handle=fp8_handle, config=dcfg), 1),
            "cached_dispatch fp8 zero-copy": (lambda: buf.dispatch(x8, handle=fp8_handle, config=dcfg,
                                                                   zero_copy=True), 1),
            "combine bf16": (lambda: buf.combine(recv_x, handle, config=ccfg), 1),
            "combine bf16 zero-copy": (lambda: buf.combine(recv_x, handle, config=ccfg, zero_copy=True), 1),
            "ll_dispatch fp8": (lambda: ll.low_latency_dispatch(lx, lidx, M, E, use_fp8=True), 2),
            "ll_combine 24-bit": (lambda: ll.low_latency_combine(ly, lidx, lw, ll_handle), 2),
            "ll_combine bf16 partials": (lambda: ll.low_latency_combine(ly, lidx, lw, ll_handle,
                                                                        bf16_partials=True), 2),
            "ll_combine logfmt": (lambda: ll.low_latency_combine(ly, lidx, lw, ll_handle, use_logfmt=True), 2),
        }
        self.checked_ops = ("ll_dispatch fp8", "ll_combine 24-bit")  # also timed with check_values=True

    def destroy(self) -> None:
        self.ll.destroy()
        self.buf.destroy()


def make_inputs(comm) -> dict:
    """numpy inputs of this rank (the benchmark's: seed 1234 + rank, uniform routing), normal and low-latency."""
    from cupy_ep.tools.harness import make_inputs as bench_inputs
    rank, R = comm.Get_rank(), comm.Get_size()
    x, x8, idx, w = bench_inputs(rank, R, T, H, K, E, 0.0)
    lx, _, lidx, lw = bench_inputs(rank, R, M, H, K, E, 0.0, seed=4321)
    rng = np.random.default_rng(99 + rank)
    ly = rng.standard_normal((E // R, R * M, H), dtype=np.float32).astype(x.dtype)
    return {"x": x, "x8": x8, "idx": idx, "w": w, "ll_x": lx, "ll_idx": lidx, "ll_w": lw, "ll_y": ly}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base_tree", help="folder with the base tree's cupy_ep/ and cuda_src/ (.carry/ab_base)")
    p.add_argument("--reps", type=int, default=8, help="repetitions, each timing both trees (default 8)")
    p.add_argument("--iters", type=int, default=50, help="iterations per device timing (default 50)")
    p.add_argument("--steady-n", type=int, default=10, help="ops per graph of the steady timing (even; default 10)")
    p.add_argument("--first", choices=("base", "head"), default="base",
                   help="the tree whose Buffers and inputs are allocated first (default base): where the memory lies "
                        "may favour one tree by a few percent, so a comparison is worth running both ways")
    p.add_argument("--budget-s", type=float, default=None,
                   help="no new pair of repetitions after this many seconds of timing (default: all --reps)")
    p.add_argument("--out", default=None, help="folder of ab_inprocess.json and .md (default: none written)")
    a = p.parse_args(argv)
    os.environ.setdefault("CUPY_EP_PREINIT", "0")  # two trees, one CUDA context: no start-up thread per tree
    from mpi4py import MPI

    import cupy
    import cupy_ep as head_ep
    from cupy_ep.tools import harness
    from cupy_ep.tools.bench_ll import host_us_per_call
    base_ep = load_tree(a.base_tree)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()

    def log(*args):
        if rank == 0:
            print(*args, flush=True)
    inputs_np = make_inputs(comm)
    trees = {}
    order = (("base", base_ep), ("head", head_ep))
    for label, ep in order if a.first == "base" else order[::-1]:
        t0 = time.perf_counter()
        trees[label] = Tree(ep, comm, inputs_np, harness.to_device)
        log(f"[{label}] {ep.__file__}: buffers, first calls and kernels in {time.perf_counter() - t0:.1f} s")
    device = trees["head"].device
    with device:
        shared = harness.shared_gpus(comm)
    about = {"base_commit": tree_commit(a.base_tree), "head_commit": harness.git_commit(), "gpu": harness.gpu_name(),
             "ranks": comm.Get_size(), "shared_gpu": bool(shared), "reps": 0, "iters": a.iters,
             "steady_n": a.steady_n, "first": a.first, "date": time.strftime("%Y-%m-%d"),
             "mps_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")}
    samples: dict = {}

    def report(final: bool) -> None:
        """Rank 0: the table so far to --out (after every repetition: a run stopped at a time limit keeps what it
        measured), and printed at the end."""
        if rank != 0:
            return
        rows = summarize(samples)
        text = markdown(rows, about)
        if final:
            print(text, flush=True)
        if a.out:
            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            samples_doc = [{"op": op, "timing": timing, **by_tree} for (op, timing), by_tree in samples.items()]
            (out / "ab_inprocess.json").write_text(json.dumps({**about, "rows": rows, "samples": samples_doc},
                                                              indent=1))
            (out / "ab_inprocess.md").write_text(text)

    def sync():
        cupy.cuda.runtime.deviceSynchronize()

    def add(op: str, timing: str, label: str, us) -> None:
        samples.setdefault((op, timing), {}).setdefault(label, []).append(us)
    with device:
        timer = harness.GpuTimer(comm, a.iters, 3)
        started = time.perf_counter()
        for rep in range(a.reps):
            # a pair of repetitions holds both orders; rank 0's clock decides for all ranks
            late = a.budget_s is not None and time.perf_counter() - started > a.budget_s
            if rep % 2 == 0 and comm.bcast(late, root=0):
                log(f"time budget of {a.budget_s:.0f} s spent: {rep} repetitions")
                break
            t0 = time.perf_counter()
            order = ("base", "head") if rep % 2 == 0 else ("head", "base")
            for label in order:
                tree = trees[label]
                for op, (fn, per_replay) in tree.ops.items():
                    add(op, "graph", label, timer.graph(fn, per_replay=per_replay).median_us)
                    # the low-latency ops' steady time is not resolved on a shared GPU (the benchmark reports none)
                    if not (shared and per_replay == 2):
                        steady = harness.resolved(timer.steady(fn, a.steady_n))
                        add(op, "steady", label, None if steady is None else steady.median_us)
                    if per_replay == 2:  # the low-latency pair: calls back to back, as the benchmark times them
                        add(op, "host", label, host_us_per_call(comm, fn, HOST_CALLS, sync)[0])
                    else:
                        add(op, "host (alone)", label, host_us_alone(comm, fn, HOST_CALLS // 2, sync))
                for op in tree.checked_ops:
                    for b in (tree.buf, tree.ll):
                        b.check_values = True
                    add(op, "host (check_values)", label, host_us_per_call(comm, tree.ops[op][0], HOST_CALLS, sync)[0])
                    for b in (tree.buf, tree.ll):
                        b.check_values = False
            about["reps"] = rep + 1
            report(final=False)
            log(f"repetition {rep + 1}/{a.reps} ({'/'.join(order)}) in {time.perf_counter() - t0:.1f} s")
        for tree in trees.values():
            tree.destroy()
    report(final=True)
    comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
