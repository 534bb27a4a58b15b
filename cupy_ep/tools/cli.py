"""The tools' command lines: what every tool shares (a rank known before MPI starts, a parser that prints on one
rank, argument types, one error for all ranks) and the benchmark's options (``python -m cupy_ep.bench --help``).

Nothing heavy is imported here: run as the main job, a tool parses its arguments first, so that ``--help`` and a
bad value end the process, printed by one rank, before MPI starts or numpy and CuPy load.
"""
from __future__ import annotations

import argparse
import os

from . import models

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


def model_list(text: str) -> list[str]:
    """An argparse type: comma-separated names of ``models.MODELS``, or ``all``."""
    names = [n.strip() for n in text.split(",")]
    if names == ["all"]:
        return names
    unknown = [n for n in names if n not in models.MODELS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown model {unknown[0]!r} (choose from {', '.join(models.MODELS)} "
                                         "or all)")
    return names


def routing_spec(text: str) -> str:
    """An argparse type: ``uniform``, ``zipf:S`` (S > 0) or ``hot-expert:F`` (F in [0, 1]), normalized."""
    kind, _, value = text.strip().partition(":")
    if kind == "uniform" and not value:
        return "uniform"
    if kind in ("zipf", "hot-expert") and value:
        try:
            v = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number in {text!r}") from None
        if kind == "zipf" and not v > 0:
            raise argparse.ArgumentTypeError(f"zipf:S needs S > 0, got {value}")
        if kind == "hot-expert" and not 0.0 <= v <= 1.0:
            raise argparse.ArgumentTypeError(f"hot-expert:F needs F in [0, 1], got {value}")
        return f"{kind}:{v:g}"
    raise argparse.ArgumentTypeError(f"expected uniform, zipf:S or hot-expert:F, got {text!r}")


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
        "The dispatch/combine benchmark: start it under mpirun (scripts/bench.sh) or torchrun, one rank per GPU. "
        "Every op is verified against cupy_ep.reference, then timed; the results go to --out as JSON and markdown "
        "(and a PNG plot on a GPU). Without a GPU it runs the host backend (numpy + MPI: a check that the pipeline "
        "runs, not GPU numbers)."))
    p.add_argument("--mode", choices=["normal", "low-latency", "internode"], default="normal",
                   help="normal: intranode dispatch/combine bandwidth; low-latency: decode dispatch/combine latency "
                        "(cupy_ep/tools/bench_ll.py; on a GPU or --backend host); internode: RDMA/NVLink-domain "
                        "bandwidth across nodes (cupy_ep/tools/bench_internode.py; GPU only)")
    p.add_argument("--model", type=model_list, default=models.DEFAULT_MODEL,
                   help="comma-separated MoE shapes to run, or 'all': " + ", ".join(
                       f"{s.name} ({s.experts}/{s.topk}/{s.hidden})" for s in models.MODELS.values())
                   + " (experts / top-k / hidden); a shape the mode cannot run is reported as skipped, with the "
                     "reason")
    p.add_argument("--tokens", type=positive_int, default=None,
                   help=f"tokens per rank (default: 4096; {LL_DEFAULT_TOKENS} in --mode low-latency)")
    p.add_argument("--hidden", type=positive_int, default=None,
                   help="hidden size, bf16 values per token (a multiple of 16: rows of 16-byte units; of 128 in "
                        "--mode low-latency); replaces the --model shape's (default: the --model shape's)")
    p.add_argument("--topk", type=positive_int, default=None,
                   help="experts per token (at most --experts); replaces the --model shape's (default: the --model "
                        "shape's)")
    p.add_argument("--experts", type=positive_int, default=None,
                   help="experts in all (a multiple of the rank count); replaces the --model shape's (default: the "
                        "--model shape's)")
    p.add_argument("--routing", type=routing_spec, default="uniform",
                   help="how tokens pick their experts: uniform; zipf:S (expert popularity ~ 1/rank^S, S > 0, the "
                        "experts' order shuffled by --seed); hot-expert:F (a fraction F of the tokens, in [0, 1], "
                        "pick expert 0 among their top-k); the busiest rank's load is reported")
    p.add_argument("--seed", type=non_negative_int, default=1234,
                   help="seed of the inputs and of the routing (rank r draws from seed + r)")
    p.add_argument("--sms", type=int_list(sm_count, allow_empty=False), default=None,
                   help="comma-separated SM counts to sweep (even, >= 4) " + per_backend("sms"))
    p.add_argument("--default-sms", type=sm_count, default=None,
                   help="SM count of the token sweep and of --mode internode (even, >= 4) "
                        + per_backend("default_sms"))
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
                   help="cuda: the GPU kernels; host: numpy + MPI on the CPU, --mode normal and low-latency (default: "
                        "cuda when a GPU is visible, else host)")
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
    explicit = {k: getattr(args, k) for k in ("experts", "topk", "hidden")}
    args.shapes = models.resolve(args.model, **explicit)
    # the first shape's fields stand for the run's (the low-latency and internode benchmarks read them per shape)
    args.experts, args.topk, args.hidden = args.shapes[0].experts, args.shapes[0].topk, args.shapes[0].hidden
    if explicit["hidden"] is not None and args.hidden % (128 if args.mode == "low-latency" else 16):
        p.error(f"argument --hidden: must be a multiple of {128 if args.mode == 'low-latency' else 16}"
                f"{' in --mode low-latency' if args.mode == 'low-latency' else ''}, got {args.hidden}")
    if (explicit["topk"] is not None or explicit["experts"] is not None) and args.topk > args.experts:
        p.error(f"argument --topk: must be at most --experts {args.experts}, got {args.topk}")
    if args.mode == "internode" and args.backend == "host":
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
    from ..config import MAX_TOPK
    from ..reference import LOW_LATENCY_MAX_TOPK
    R = comm.Get_size()
    # a shape given by --experts / --topk / --hidden must fit; a preset that does not is skipped by the run
    custom = any(models.is_custom(s) for s in args.shapes)
    problem = None
    if args.backend == "cuda" and not gpu_visible:
        problem = "argument --backend: cuda, but this rank sees no GPU"
    elif args.mode != "normal" and args.backend != "host" and not gpu_visible:
        problem = f"argument --mode: {args.mode} needs a GPU, and this rank sees none"
    elif custom and args.experts % R:
        problem = f"argument --experts: must be a multiple of the rank count {R}, got {args.experts}"
    elif custom and args.mode == "low-latency" and args.topk > LOW_LATENCY_MAX_TOPK:
        problem = f"argument --topk: the low-latency kernels take at most {LOW_LATENCY_MAX_TOPK}, got {args.topk}"
    elif custom and args.topk > MAX_TOPK:
        problem = f"argument --topk: must be at most {MAX_TOPK}, got {args.topk}"
    elif args.mode == "internode" and R < 2:
        problem = f"argument --mode: internode needs at least 2 ranks (2 nodes), got {R}"
    fail_once(comm, build_parser(), problem)

