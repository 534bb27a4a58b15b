"""``python -m cupy_ep.bench``: the main job. Run under mpirun, one rank per GPU (``scripts/bench.sh``).

In ONE run it measures (GPU backend):
  * the ceiling: an SM-driven copy where every GPU writes to all its peers at once (cuda_src/probes/copy.cu);
  * the baseline: NCCL grouped send/recv moving exactly the per-peer bytes our dispatch (combine) moves;
  * ours: layout, dispatch, cached dispatch (BF16 and FP8) and combine (BF16) over several SM counts and
    token counts, CUDA events, warm-up, median/min of --iters iterations, L2 flushed before each.
Each op is timed as a call, as a CUDA-graph replay (one op per replay) and, where it can be captured, steady
(--steady-n ops back to back per replay, GpuTimer.steady: the ranks' launch skew paid once per n ops); the
ceiling and NCCL are timed the same ways, and each comparison uses the same timing on both sides.
Every result is checked against ``cupy_ep.reference`` before timing; a mismatch aborts the run.
Writes JSON, a markdown table and a PNG plot into --out (default ``benchmarks/results``). Without a GPU (or with
``--backend host``) it runs the host backend (verification and a small table; no ceiling, no NCCL), written to
``out/bench_host`` (ignored by git) unless --out says otherwise. Where ranks share a GPU (CUDA MPS clients) NCCL
refuses to run: the benchmark runs every op without the NCCL baseline, says so in its log and files (``nccl``,
``shared_gpu_ranks``) and names them ``..._shared_gpu``.

The command line (``--help``) is parsed before MPI starts, by every rank alike; rank 0 alone prints help and errors.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# ------------------------------------------------------------------------------------------------------
# the command line (shared by cupy_ep.soak and cupy_ep.tune). Defined before anything heavy is imported: run as
# the main job, this module parses its arguments first, so that --help and a bad value end the process, printed
# by one rank, before MPI starts or CuPy loads.
# ------------------------------------------------------------------------------------------------------
# A process's rank as launchers export it before MPI_Init: Open MPI, MPICH/Hydra (PMI), PMIx, MVAPICH, Slurm,
# torchrun (RANK, else LOCAL_RANK). The MPI launchers' own names come first: a Slurm or torchrun variable may be
# inherited by every rank of an mpirun started inside such a job.
LAUNCHER_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID",
                      "RANK", "LOCAL_RANK")


def launcher_rank() -> int | None:
    """This process's rank as its launcher exported it (``LAUNCHER_RANK_VARS``, first found), or None (a plain
    ``python``)."""
    for name in LAUNCHER_RANK_VARS:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with ``(default: ...)``; one whose default depends on other options or on the
    machine states it in its own text (``(default: ...)`` already there) and is left as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        return text if "(default" in text else super()._get_help_string(action)


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser for a command started with several ranks: every rank parses the same argv, and only rank 0
    prints (help, usage, errors); the other ranks exit with the same status silently. ``rank``: the process's rank
    (None: ``launcher_rank()``, known before MPI starts; a plain ``python`` prints)."""

    def __init__(self, *args, rank: int | None = None, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.rank = rank

    def _print_message(self, message, file=None):
        rank = self.rank if self.rank is not None else launcher_rank()
        if not rank:
            super()._print_message(message, file)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an int: {text!r}") from None


def int_at_least(low: int):
    """An argparse type: an int >= ``low``."""
    def parse(text: str) -> int:
        value = _int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = f"int >= {low}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def sm_count(text: str) -> int:
    """An argparse type: an SM count of dispatch/combine (``Config.num_sms``: even, and >= 4 for a dispatch)."""
    value = _int(text)
    if value < 4 or value % 2:
        raise argparse.ArgumentTypeError(f"an SM count must be an even number >= 4, got {value}")
    return value


def int_list(item=positive_int, allow_empty: bool = True):
    """An argparse type: comma-separated values, each parsed by ``item`` ("" is the empty list when
    ``allow_empty``)."""
    def parse(text: str) -> list:
        parts = [p.strip() for p in text.split(",")]
        if parts == [""]:
            if allow_empty:
                return []
            raise argparse.ArgumentTypeError("needs at least one value")
        if "" in parts:
            raise argparse.ArgumentTypeError(f"an empty item in {text!r}")
        try:
            return [item(p) for p in parts]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (in {text!r})" if len(parts) > 1 else str(e)) from None
    parse.__name__ = "comma-separated list"
    return parse


def fraction(text: str) -> float:
    """An argparse type: a float in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def fail_once(comm, parser: CliParser, problem: str | None) -> None:
    """Collective: when any rank of ``comm`` found a ``problem`` (one rank may see what another does not: a GPU),
    every rank ends with ``parser.error`` (exit status 2), the message (the first rank's, naming it unless all
    agree) printed by rank 0 of ``comm`` only."""
    problems = comm.allgather(problem)
    first = next(((r, p) for r, p in enumerate(problems) if p), None)
    if first is not None:
        r, p = first
        parser.rank = comm.Get_rank()
        parser.error(p if all(q == p for q in problems) else f"{p} (rank {r})")


PROG = "python -m cupy_ep.bench"
# defaults that differ by backend: (GPU, host backend); a host run is small, it checks that the pipeline runs
BACKEND_DEFAULTS = {"sms": ([8, 16, 24, 32], [4]), "default_sms": (24, 4), "token_sweep": ([512, 1024, 2048, 8192], []),
                    "iters": (50, 3), "warmup": (5, 1), "out": ("benchmarks/results", "out/bench_host")}
LL_DEFAULT_TOKENS = 128


def build_parser(rank: int | None = None) -> CliParser:
    """The benchmark's options (``python -m cupy_ep.bench --help``)."""
    def per_backend(key: str, fmt=lambda v: ",".join(map(str, v)) if isinstance(v, list) else str(v)) -> str:
        gpu, host = BACKEND_DEFAULTS[key]
        return f"(default: {fmt(gpu) or 'none'} on a GPU, {fmt(host) or 'none'} on the host backend)"
    p = CliParser(prog=PROG, rank=rank, description=(
        "The dispatch/combine benchmark: start it under mpirun, one rank per GPU (scripts/bench.sh). Every op is "
        "verified against cupy_ep.reference, then timed; the results go to --out as JSON and markdown (and a PNG "
        "plot on a GPU). Without a GPU it runs the host backend (numpy + MPI: a check that the pipeline runs, not "
        "GPU numbers)."))
    p.add_argument("--mode", choices=["normal", "low-latency", "internode"], default="normal",
                   help="normal: intranode dispatch/combine bandwidth; low-latency: decode dispatch/combine latency "
                        "(cupy_ep/bench_ll.py; GPU only); internode: RDMA/NVLink-domain bandwidth across nodes "
                        "(cupy_ep/bench_internode.py; GPU only)")
    p.add_argument("--tokens", type=positive_int, default=None,
                   help=f"tokens per rank (default: 4096; {LL_DEFAULT_TOKENS} in --mode low-latency)")
    p.add_argument("--hidden", type=positive_int, default=7168,
                   help="hidden size, bf16 values per token (a multiple of 16: rows of 16-byte units; of 128 in "
                        "--mode low-latency)")
    p.add_argument("--topk", type=positive_int, default=8, help="experts per token (at most --experts)")
    p.add_argument("--experts", type=positive_int, default=256, help="experts in all (a multiple of the rank count)")
    p.add_argument("--sms", type=int_list(sm_count, allow_empty=False), default=None,
                   help="comma-separated SM counts to sweep (even, >= 4) " + per_backend("sms"))
    p.add_argument("--default-sms", type=sm_count, default=None,
                   help="SM count of the token sweep and of --mode internode (even, >= 4) " + per_backend("default_sms"))
    p.add_argument("--token-sweep", type=int_list(), default=None,
                   help="comma-separated tokens per rank to run at --default-sms besides --tokens ('' for none) "
                        + per_backend("token_sweep"))
    p.add_argument("--iters", type=positive_int, default=None,
                   help="timed iterations per measurement " + per_backend("iters")[:-1]
                        + "; at least 200 in --mode low-latency)")
    p.add_argument("--warmup", type=non_negative_int, default=None,
                   help="untimed iterations before each measurement " + per_backend("warmup"))
    p.add_argument("--skew", type=fraction, default=0.0,
                   help="fraction of tokens whose experts are all on rank 0 (routing skew, in [0, 1])")
    p.add_argument("--steady-n", type=non_negative_int, default=10,
                   help="ops back to back per graph in the steady timing (GpuTimer.steady; 0: no steady timing; "
                        "rounded up to even in --mode low-latency, where two buffers alternate)")
    p.add_argument("--ll-token-sweep", type=int_list(non_negative_int), default="0,128",
                   help="--mode low-latency: comma-separated tokens per rank T of the steady sweep, at the same max "
                        "tokens M (--ll-max-tokens); T=0 is the fixed cost; T > M is skipped; '' for none")
    p.add_argument("--ll-max-tokens", type=positive_int, default=None,
                   help="--mode low-latency: the buffer's max tokens per rank M (num_max_dispatch_tokens_per_rank), "
                        "at least --tokens; serving often sizes M above the batch (default: --tokens)")
    p.add_argument("--ll-stamps", action="store_true",
                   help="--mode low-latency: also report where a call's time goes (the kernels' phase stamps)")
    p.add_argument("--ll-transport", choices=["nvshmem", "ipc"], default=None,
                   help="--mode low-latency: Buffer(low_latency_transport=...); with ipc the report is named "
                        "bench_ll_gpu_ep<R>_ipc (default: env CUPY_EP_LL_TRANSPORT, else nvshmem)")
    p.add_argument("--backend", choices=["cuda", "host"], default=None,
                   help="cuda: the GPU kernels; host: numpy + MPI on the CPU, --mode normal only (default: cuda when "
                        "a GPU is visible, else host)")
    p.add_argument("--out", default=None,
                   help="folder for the JSON, markdown and plot " + per_backend("out")[:-1]
                        + ", which git ignores)")
    return p


def parse_args(argv=None, gpu: bool | None = None, rank: int | None = None) -> argparse.Namespace:
    """The benchmark's arguments from ``argv`` (default ``sys.argv[1:]``); needs nothing beyond argparse and runs
    before MPI starts: ``--help`` and a bad value exit here (status 0 / 2), printed by rank 0 only. Defaults that
    depend on the mode are set; those that depend on the backend stay None until :func:`resolve_defaults`,
    done here when ``gpu`` (whether a GPU runs the benchmark) is given."""
    p = build_parser(rank)
    args = p.parse_args(argv)
    if args.tokens is None:
        args.tokens = LL_DEFAULT_TOKENS if args.mode == "low-latency" else 4096
    if args.hidden % (128 if args.mode == "low-latency" else 16):
        p.error(f"argument --hidden: must be a multiple of {128 if args.mode == 'low-latency' else 16}"
                f"{' in --mode low-latency' if args.mode == 'low-latency' else ''}, got {args.hidden}")
    if args.topk > args.experts:
        p.error(f"argument --topk: must be at most --experts {args.experts}, got {args.topk}")
    if args.mode != "normal" and args.backend == "host":
        p.error(f"argument --backend: --mode {args.mode} runs on a GPU only, not on the host backend")
    if args.mode == "low-latency" and args.ll_max_tokens is not None and args.tokens > args.ll_max_tokens:
        p.error(f"argument --tokens: --tokens {args.tokens} is above --ll-max-tokens {args.ll_max_tokens}")
    if gpu is not None:
        resolve_defaults(args, gpu)
    return args


def resolve_defaults(args, gpu: bool) -> None:
    """Fill the defaults that differ by backend (``BACKEND_DEFAULTS``): ``gpu`` says whether a GPU runs the
    benchmark (a GPU is visible and ``--backend`` is not host). A host run writes to ``out/bench_host``, which git
    ignores, so that it never lands among the committed GPU results in ``benchmarks/results``."""
    for key, (on_gpu, on_host) in BACKEND_DEFAULTS.items():
        if getattr(args, key) is None:
            value = on_gpu if gpu else on_host
            setattr(args, key, list(value) if isinstance(value, list) else value)


def check_world(args, comm, gpu_visible: bool) -> None:
    """Collective, once MPI is up: the arguments against the job (rank count, GPUs); a problem ends every rank
    with one argparse error (:func:`fail_once`), before any buffer exists."""
    from .config import MAX_TOPK
    from .reference import LOW_LATENCY_MAX_TOPK
    R = comm.Get_size()
    problem = None
    if args.backend == "cuda" and not gpu_visible:
        problem = "argument --backend: cuda, but this rank sees no GPU"
    elif args.mode != "normal" and not gpu_visible:
        problem = f"argument --mode: {args.mode} needs a GPU, and this rank sees none"
    elif args.experts % R:
        problem = f"argument --experts: must be a multiple of the rank count {R}, got {args.experts}"
    elif args.mode == "low-latency" and args.topk > LOW_LATENCY_MAX_TOPK:
        problem = f"argument --topk: the low-latency kernels take at most {LOW_LATENCY_MAX_TOPK}, got {args.topk}"
    elif args.topk > MAX_TOPK:
        problem = f"argument --topk: must be at most {MAX_TOPK}, got {args.topk}"
    elif args.mode == "internode" and R < 2:
        problem = f"argument --mode: internode needs at least 2 ranks (2 nodes), got {R}"
    fail_once(comm, build_parser(), problem)


if __name__ == "__main__":
    # Run as the main job: the arguments first (--help and bad values end here, before MPI), then MPI starts while
    # a thread imports numpy, CuPy and the backend (below they are then already loaded), instead of after them
    # with the GIL held (cupy_ep/mpi_start.py; main() reads the times).
    _MAIN_ARGS = parse_args()
    from cupy_ep.mpi_start import start_mpi
    start_mpi()

import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import cupy_ep  # noqa: E402
from cupy_ep import Buffer, reference  # noqa: E402
from cupy_ep import config as cfgmod  # noqa: E402


# ------------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------------
def make_routing(rng, tokens: int, topk: int, experts: int, num_ranks: int, skew: float) -> np.ndarray:
    """``[T, K] int64`` distinct experts per token, uniform; with probability ``skew`` a token's experts
    are drawn from rank 0's range only (routing skew)."""
    scores = rng.random((tokens, experts), dtype=np.float32)
    if skew > 0:
        hot = rng.random(tokens) < skew
        scores[hot, experts // num_ranks:] -= 2.0
    return np.argsort(-scores, axis=1)[:, :topk].astype(np.int64)


def make_inputs(rank: int, num_ranks: int, tokens: int, hidden: int, topk: int, experts: int, skew: float,
                seed: int = 1234):
    rng = np.random.default_rng(seed + rank)
    x = (rng.standard_normal((tokens, hidden), dtype=np.float32)).astype(reference.bfloat16)
    x8 = rng.integers(0, 0x7f, size=(tokens, hidden), dtype=np.uint8)  # positive finite e4m3 bytes
    scales = rng.random((tokens, -(-hidden // 128)), dtype=np.float32)
    idx = make_routing(rng, tokens, topk, experts, num_ranks, skew)
    w = rng.random((tokens, topk), dtype=np.float32)
    return x, (x8, scales), idx, w


# ------------------------------------------------------------------------------------------------------
# timing helpers
# ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Timing:
    median_us: float
    min_us: float


STEADY_FLOOR_US = 1e-3  # a steady per-op time is clamped here (1 ns): noise can push (ops - flush) / n <= 0


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
        from cupy_ep import jit
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
    from cupy_ep import jit
    R = buf.num_ranks
    n_int4 = max(1, bytes_per_peer // 16)
    room = (buf.num_nvl_bytes - cfgmod.NOTIFY_BYTES) // (16 * R)
    n_int4 = min(n_int4, room)
    src = cupy.random.randint(0, 1 << 30, size=4 * n_int4, dtype=cupy.int32).view(cupy.int32)
    kernel = jit.get_kernel("probes/copy.cu", "ep::p2p_copy")
    graph, steady = {}, {}
    for sms in sms_list:
        def run():
            kernel((sms,), (768,), (src, buf._nvl.ptr_table, np.int64(cfgmod.SIGNAL_BYTES + cfgmod.NOTIFY_BYTES),
                                    np.int64(n_int4), np.int32(buf.rank), np.int32(R)))
        t = timer.graph(run)  # device time: the kernel alone, like the graph-timed ops
        graph[sms] = n_int4 * 16 * (R - 1) / (t.median_us * 1e-6) / 1e9
        if steady_n:
            t = timer.steady(run, steady_n)
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

    from .bootstrap import gpu_of_each_rank
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
    NCCL_ERROR_INVALID_USAGE in its first call, so the benchmark runs without it and says so."""
    if shared:
        return None, f"skipped: {shared_text(shared)} (NCCL refuses two ranks on one GPU)"
    return NcclAllToAll(comm), "measured"


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


# ------------------------------------------------------------------------------------------------------
# the benchmark
# ------------------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args, comm):
        self.args, self.comm = args, comm
        self.rank, self.R = comm.Get_rank(), comm.Get_size()
        self.experts = args.experts
        t_enter = time.perf_counter()
        max_tokens = max([args.tokens] + args.token_sweep)
        self.hidden_bytes = args.hidden * 2
        hints = [dataclasses.replace(get(self.R, self.hidden_bytes), num_sms=sms).get_nvl_buffer_size_hint(
                     self.hidden_bytes, self.R)
                 for sms in args.sms + [args.default_sms]
                 for get in (Buffer.get_dispatch_config, Buffer.get_combine_config)]
        nvl = max(max(hints),
                  # room for zero-copy calls of the largest batch (their rows stay in the buffer)
                  Buffer.get_zero_copy_nvl_size_hint(max_tokens, self.hidden_bytes, self.R, args.topk),
                  # room for the ceiling copy of the largest batch
                  cfgmod.NOTIFY_BYTES + 16 * self.R * (max_tokens * self.hidden_bytes // 16) + (1 << 20))
        t0 = time.perf_counter()
        self.t_sizes = t0 - t_enter  # the configs and size hints (Python only)
        self.buf = Buffer(comm, num_nvl_bytes=int(cfgmod.align_up(nvl)), check_values=False,
                          backend=args.backend)
        self.t_buffer = time.perf_counter() - t0
        self.gpu = self.buf.backend == "cuda"
        self.records: list[dict] = []
        self.ceiling: dict = {}
        # the NCCL baseline (GPU: run() opens it) and what the results say of it; the groups of ranks sharing a GPU
        self.nccl, self.nccl_status, self.shared = None, "not measured: the host backend has no NCCL", None
        self.startup = self.first_dispatch()

    def first_dispatch(self) -> dict:
        """Warm start: process start -> Buffer -> first layout + dispatch done (a small batch, before any
        other measurement), minus MPI's own start-up. Kernels come from the disk cache when it is warm."""
        a, R = self.args, self.R
        t0 = time.perf_counter()
        x_np, _, idx_np, w_np = make_inputs(self.rank, R, 128, a.hidden, a.topk, self.experts, 0.0, seed=7)
        with self.device_ctx():
            x, idx, w = self.dev(x_np), self.dev(idx_np), self.dev(w_np)
            t1 = time.perf_counter()
            layout = self.buf.get_dispatch_layout(idx, self.experts)
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

    def log(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    # -- array plumbing --
    def dev(self, a):
        if not self.gpu:
            return a
        import cupy
        if isinstance(a, tuple):
            return tuple(self.dev(v) for v in a)
        if a.dtype == reference.bfloat16:
            return cupy.asarray(a.view(np.uint16)).view(cupy_ep.interop.BF16)
        return cupy.asarray(a)

    @staticmethod
    def host(a):
        if a is None:
            return None
        if isinstance(a, tuple):
            return tuple(Bench.host(v) for v in a)
        return a.get() if hasattr(a, "get") else np.asarray(a)

    def device_ctx(self):
        import contextlib
        if not self.gpu:
            return contextlib.nullcontext()
        import cupy
        return cupy.cuda.Device(self.buf.device_id)

    # -- one workload --
    def run_workload(self, tokens: int, sms_list, verify: bool, with_baselines: bool):
        a, R, rank = self.args, self.R, self.rank
        x_np, x8_np, idx_np, w_np = make_inputs(rank, R, tokens, a.hidden, a.topk, self.experts, a.skew)
        x, x8, idx, w = self.dev(x_np), self.dev(x8_np), self.dev(idx_np), self.dev(w_np)
        timer = (GpuTimer if self.gpu else HostTimer)(self.comm, a.iters, a.warmup)
        buf = self.buf

        layout = buf.get_dispatch_layout(idx, self.experts)
        num_per_rank_np = np.asarray(self.host(layout[0]))

        def dispatch(xx, cfg, handle=None, zero_copy=False):
            if handle is not None:
                return buf.dispatch(xx, handle=handle, config=cfg, zero_copy=zero_copy)
            return buf.dispatch(xx, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w, config=cfg,
                                zero_copy=zero_copy)

        dcfg0 = dataclasses.replace(Buffer.get_dispatch_config(R, self.hidden_bytes), num_sms=a.default_sms)
        out = dispatch(x, dcfg0)
        if verify:
            self.verify(x_np, x8_np, idx_np, w_np, layout, dispatch, dcfg0)

        # bytes: rows this rank sends to each peer (self included), and what it receives
        row_bf16, row_fp8 = a.hidden * 2, a.hidden + 4 * (-(-a.hidden // 128))
        recv_rows = np.array(self.comm.allgather(num_per_rank_np))[:, rank]  # rows from each source
        sent_rows = num_per_rank_np
        nvl_sent = int(sent_rows.sum() - sent_rows[rank])
        nvl_back = int(recv_rows.sum() - recv_rows[rank])
        num_recv = int(recv_rows.sum())

        nccl = self.nccl_baselines(timer, sent_rows, recv_rows, row_bf16, row_fp8) \
            if self.nccl is not None and with_baselines else {}
        ceiling = {"graph": self.ceiling.get("gbps"), "steady": self.ceiling.get("gbps_steady")}

        def add(op, dtype, sms, fn, row_bytes, logical_rows, nvl_rows, graph: bool, zero_copy: bool = False):
            """Time ``fn`` (``time_op``) and append its record."""
            t = self.time_op(timer, fn, graph)
            key = (op.replace("cached_", ""), dtype)
            rec = make_record(dict(op=op, dtype=dtype, num_sms=sms, tokens=tokens, hidden=a.hidden, topk=a.topk,
                                   experts=self.experts, zero_copy=zero_copy), t, row_bytes, logical_rows, nvl_rows,
                              ceiling, {how: us.get(key) for how, us in nccl.items()})
            rec["steady_n"] = a.steady_n if t["steady"] else None
            self.records.append(rec)
            self.log(log_line(rec))

        if with_baselines:
            add("layout", "-", 0, lambda: buf.get_dispatch_layout(idx, self.experts), 0, 0, 0, graph=True)
        for sms in sms_list:
            dcfg = dataclasses.replace(Buffer.get_dispatch_config(R, self.hidden_bytes), num_sms=sms)
            ccfg = dataclasses.replace(Buffer.get_combine_config(R, self.hidden_bytes), num_sms=sms)
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
        del out

    def time_op(self, timer, fn, graph: bool) -> dict:
        """``fn`` timed as a call (events around the Python call: host overhead included) and, when ``graph``
        (it can be captured) on a GPU, as graph replays (one op per replay) and steady (``--steady-n`` ops back
        to back; none with --steady-n 0): ``{"call": Timing, "graph": Timing | None, "steady": Timing | None}``."""
        device, n = graph and self.gpu, self.args.steady_n
        return {"call": timer(fn), "graph": timer.graph(fn) if device else None,
                "steady": timer.steady(fn, n) if device and n else None}

    def nccl_baselines(self, timer, sent_rows, recv_rows, row_bf16: int, row_fp8: int) -> dict:
        """NCCL grouped send/recv of exactly the per-peer bytes of dispatch (bf16, fp8) and combine (bf16),
        timed as our ops are: ``{"call" | "graph" | "steady": {(op, dtype): median us}}``. A timing whose graph
        capture fails is left out (logged): NCCL inside a graph is not essential."""
        nc, n = self.nccl, self.args.steady_n
        runs = {("dispatch", name): nc.make(sent_rows * rb, recv_rows * rb)
                for name, rb in (("bf16", row_bf16), ("fp8", row_fp8))}
        runs[("combine", "bf16")] = nc.make(recv_rows * row_bf16, sent_rows * row_bf16)
        hows = {"graph": timer.graph}
        if n:
            hows["steady"] = lambda fn: timer.steady(fn, n)
        out = {"call": {}, "graph": {}, "steady": {}}
        for key, run in runs.items():
            out["call"][key] = timer(run).median_us
            for how, time_it in hows.items():
                try:
                    out[how][key] = time_it(run).median_us
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
                                     [g[3] for g in gathered], self.experts, rank, 1,
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
        self.log(f"cupy_ep.bench: backend={self.buf.backend} ranks={self.R} tokens={a.tokens} hidden={a.hidden} "
                 f"topk={a.topk} experts={self.experts} skew={a.skew} iters={a.iters} steady_n={a.steady_n}")
        self.log(f"  warm start (s; MPI start {self.startup['mpi_start']}): "
                 + ", ".join(f"{k[:-2]} {v:.3f}" for k, v in self.startup.items() if isinstance(v, float)))
        with self.device_ctx():
            if self.gpu:
                self.shared = shared_gpus(self.comm)
                self.nccl, self.nccl_status = nccl_baseline(self.comm, self.shared)
                if self.shared:
                    self.log(shared_gpu_warning("cupy_ep.bench", self.shared, self.nccl_status))
                self.measure_ceiling(GpuTimer(self.comm, a.iters, a.warmup))
            self.run_workload(a.tokens, a.sms, verify=True, with_baselines=True)
            for tokens in a.token_sweep:
                if tokens != a.tokens:
                    self.run_workload(tokens, [a.default_sms], verify=False, with_baselines=True)
        self.buf.destroy()
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
        meta = {"commit": _git_commit(), "backend": self.buf.backend, "num_ranks": self.R,
                "ceiling_gbps": self.ceiling.get("gbps"), "ceiling_by_sms": self.ceiling.get("by_sms"),
                "ceiling_gbps_steady": self.ceiling.get("gbps_steady"),
                "ceiling_by_sms_steady": self.ceiling.get("by_sms_steady"),
                "nccl": self.nccl_status, "shared_gpu_ranks": self.shared,
                "startup": self.startup, "args": vars(self.args)}
        if self.gpu:
            import cupy
            props = cupy.cuda.runtime.getDeviceProperties(0)
            meta["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            meta["driver"] = cupy.cuda.runtime.driverGetVersion()
            try:
                meta["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                                capture_output=True, text=True, timeout=20).stdout.split()[0]
            except Exception:
                pass
        else:
            meta["gpu"], meta["driver"] = None, None
        return meta

    def write(self):
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = results_stem(f"bench_{'gpu' if self.gpu else 'host'}_ep{self.R}", self.shared)
        doc = dict(self.meta(), results=self.records)
        (out / f"{stem}.json").write_text(json.dumps(doc, indent=1, default=str))
        md = markdown_table(doc)
        (out / f"{stem}.md").write_text(md)
        print(md)
        if self.gpu:
            try:
                plot(doc, out / f"{stem}.png")
            except Exception as e:  # matplotlib missing: say so, keep the numbers
                print(f"cupy_ep.bench: no plot ({e})", file=sys.stderr)
        print(f"cupy_ep.bench: wrote {out}/{stem}.json/.md" + ("/.png" if self.gpu else ""))


def make_record(base: dict, t: dict, row_bytes: int, logical_rows: int, nvl_rows: int, ceiling: dict,
                nccl: dict) -> dict:
    """One result: ``base`` (op, dtype, num_sms, tokens, ...) and, from the timings ``t`` (``time_op``), per timing:
    time, NVLink GB/s (``nvl_rows`` x ``row_bytes`` / time), the fraction of the ceiling and the ratio to NCCL.
    The fraction divides by the ceiling timed the same way (``ceiling["graph"]``, the headline ``ceiling_gbps``,
    for the call and graph timings, ``ceiling["steady"]`` for steady), the ratio by NCCL timed the same way
    (``nccl[how]`` us). Logical GB/s (``logical_rows``: all received rows, DeepEP's figure) is the call's."""
    def gbps(rows, us):
        return rows * row_bytes / (us * 1e-6) / 1e9 if rows and us else 0.0
    call = t["call"]
    rec = dict(base, time_us_median=call.median_us, time_us_min=call.min_us,
               logical_gbps=gbps(logical_rows, call.median_us), nvlink_gbps=gbps(nvl_rows, call.median_us))
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


def op_label(r: dict) -> str:
    """How reports name a record's op: ``op``, then " zero-copy" (normal mode, ``zero_copy``) or
    " (bf16 partials)" / " (LogFMT-10 partials)" (low-latency combine, ``partials`` "bf16" / "logfmt")."""
    return (r["op"] + (" zero-copy" if r.get("zero_copy") else "")
            + {"bf16": " (bf16 partials)", "logfmt": " (LogFMT-10 partials)"}.get(r.get("partials"), ""))


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
             "bytes) is timed each way too, and ours/NCCL compares like with like.", "",
             "| op | dtype | SMs | tokens | call us | graph us | steady us | logical GB/s "
             "| NVLink GB/s (call / graph / steady) | of ceiling (graph / steady) | NCCL us (call / graph / steady) "
             "| ours/NCCL (call / graph / steady) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        lines.append(f"| {op_label(r)} | {r['dtype']} | {r['num_sms']} | {r['tokens']} | {r['time_us_median']:.1f} | "
                     f"{f(r.get('time_us_graph'), '.1f')} | {f(r.get('time_us_steady'), '.1f')} | "
                     f"{r['logical_gbps']:.1f} | {each(r, 'nvlink_gbps', '.1f')} | "
                     f"{each(r, 'fraction_of_ceiling', '.2f', ('_graph', '_steady'))} | "
                     f"{each(r, 'nccl_time_us', '.1f')} | {each(r, 'ratio_to_nccl', '.2f')} |")
    return "\n".join(lines) + "\n"


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
    """NVLink GB/s by SM count and by tokens per rank; device times (steady where measured, else graph,
    else the call; the legend says which), the ceiling timed as the ops are, NCCL on the same bytes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = doc["results"]
    args = doc["args"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    if doc.get("shared_gpu_ranks"):
        fig.suptitle(f"{shared_text(doc['shared_gpu_ranks'])}: HBM copies through the shared GPU, not NVLink figures"
                     + ("; no NCCL baseline" if str(doc.get("nccl", "")).startswith("skipped") else ""), fontsize=10)
    steady = bool(doc.get("ceiling_by_sms_steady"))
    ceiling_by_sms = doc.get("ceiling_by_sms_steady") or doc["ceiling_by_sms"]
    ceiling = doc.get("ceiling_gbps_steady") or doc["ceiling_gbps"]
    ceiling_label = f"P2P copy ceiling ({'steady' if steady else 'graph'})"

    def series(ax, rows, x_key, label):
        pts = sorted((r[x_key], _device_gbps(r)[0]) for r in rows)
        if pts:
            hows = sorted({_device_gbps(r)[1] for r in rows})
            ax.plot(*zip(*pts), marker="o", label=f"{label} ({'/'.join(hows)})")

    ax = axes[0]
    for op, dtype, zc in (("dispatch", "bf16", False), ("cached_dispatch", "bf16", False),
                          ("cached_dispatch", "fp8", False), ("combine", "bf16", False),
                          ("cached_dispatch", "bf16", True), ("combine", "bf16", True)):
        series(ax, [r for r in res if r["op"] == op and r["dtype"] == dtype and r["tokens"] == args["tokens"]
                    and bool(r.get("zero_copy")) == zc], "num_sms", f"{op} {dtype}{' zero-copy' if zc else ''}")
    if ceiling_by_sms:
        pts = sorted((int(k), v) for k, v in ceiling_by_sms.items())
        ax.plot(*zip(*pts), "k--", label=ceiling_label)
    nccl = [r for r in res if r["op"] == "dispatch" and r["dtype"] == "bf16" and r["tokens"] == args["tokens"]
            and not r.get("zero_copy") and _nccl_gbps(r)]
    if nccl:
        ax.axhline(_nccl_gbps(nccl[0]), color="gray", ls=":", label="NCCL all-to-all (same bytes)")
    ax.set(xlabel="SMs", ylabel="NVLink-crossing GB/s per GPU", title=f"EP{doc['num_ranks']}, {args['tokens']} tokens/rank")
    ax.legend(fontsize=8)
    ax = axes[1]
    for op, zc in (("dispatch", False), ("cached_dispatch", False), ("combine", False), ("cached_dispatch", True),
                   ("combine", True)):
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
           title=f"{args['default_sms']} SMs, hidden {args['hidden']}, top-{args['topk']} of {args['experts']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(out_dir, stem: str, records: list, doc: dict, make_lines, mode: str) -> None:
    """Stamp ``records`` with the commit and GPU, write ``<out_dir>/<stem>.json`` (those two fields, ``doc``, then
    ``results``) and ``<stem>.md`` (``make_lines(common)``: the markdown lines, given the stamp); print the table.
    The writer of the low-latency and internode benchmarks."""
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(0)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    common = {"commit": _git_commit(), "gpu": gpu}
    for r in records:
        r.update(common)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(dict(common, **doc, results=records), indent=1, default=str))
    md = "\n".join(make_lines(common)) + "\n"
    (out / f"{stem}.md").write_text(md)
    print(md)
    print(f"cupy_ep.bench --mode {mode}: wrote {out}/{stem}.json/.md")


def _git_commit(repo: Path | None = None) -> str:
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
    main job, this module parsed them at its top), MPI started with the imports and CuPy's runtime start (the
    GPU probe) running beside it (already done at the top of this module when it runs as the main job), the
    defaults that depend on the backend filled in, the arguments checked against the job (:func:`check_world`)
    and the start-up times put into them. Returns ``(comm, args)``."""
    process_age_at_main, t_main = process_age_s(), time.perf_counter()
    if args is None:
        args = parse_args(argv)  # before MPI: --help and bad values end here
    started = cupy_ep.start_mpi()
    comm = started.MPI.COMM_WORLD
    gpu_visible = bool(started.gpu if started.gpu is not None else cupy_ep.gpu_available())
    resolve_defaults(args, gpu_visible and args.backend != "host")
    check_world(args, comm, gpu_visible)
    args.mpi_init_s = started.mpi_init_s
    args.gpu_probe_s = started.preload_wait_s  # the imports + probe left over once MPI was up
    args.mpi_start = started.how
    args.process_age_at_main_s = process_age_at_main  # interpreter start, imports and (run as main) MPI start
    # interpreter start + the imports before start_mpi began (at the top of this module, or in this function)
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


if __name__ == "__main__":
    main(args=_MAIN_ARGS)
