"""The MoE shapes the tools run: published models' routed experts, experts per token and hidden size.

One table (``MODELS``) for the benchmark's ``--model`` presets and for tests that sweep the shapes; what a mode
of the library cannot run is said by :func:`skip_reason`, so that a preset beyond a mode's limits is reported as
skipped with its reason rather than failing the run.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's MoE shape: ``experts`` routed experts in all, ``topk`` of them per token, ``hidden`` values per
    token (bf16 on the wire)."""
    name: str
    experts: int
    topk: int
    hidden: int

    def describe(self) -> str:
        return f"{self.name} ({self.experts} experts, top-{self.topk}, hidden {self.hidden})"


DEFAULT_MODEL = "deepseek-v3"
MODELS = {s.name: s for s in (
    Shape("deepseek-v3", 256, 8, 7168),
    Shape("deepseek-v4-flash", 256, 6, 4096),
    Shape("deepseek-v4-pro", 384, 6, 7168),
    Shape("kimi-k3", 896, 16, 3584),
    Shape("nemotron-super", 512, 22, 1024),
    Shape("qwen3-235b", 128, 8, 4096),
)}
CUSTOM = "custom"  # the name of a shape whose --experts / --topk / --hidden differ from its preset's


def skip_reason(shape: Shape, mode: str, num_ranks: int) -> str | None:
    """Why ``shape`` cannot run in ``mode`` ("normal", "low-latency", "internode") over ``num_ranks`` ranks, or
    None when it can: the experts must split evenly over the ranks, top-k within the mode's kernels' limit
    (``config.MAX_TOPK``; ``reference.LOW_LATENCY_MAX_TOPK`` in low-latency mode) and the hidden size a multiple
    of the mode's row unit (16 values; 128 in low-latency mode)."""
    from ..config import MAX_TOPK
    from ..reference import LOW_LATENCY_MAX_TOPK
    low_latency = mode == "low-latency"
    max_topk = LOW_LATENCY_MAX_TOPK if low_latency else MAX_TOPK
    unit = 128 if low_latency else 16
    if shape.experts % num_ranks:
        return f"{shape.experts} experts do not split evenly over {num_ranks} ranks"
    if shape.topk > shape.experts:
        return f"top-{shape.topk} is more than its {shape.experts} experts"
    if shape.topk > max_topk:
        return f"top-{shape.topk} is above the {mode} kernels' limit of {max_topk} experts per token"
    if shape.hidden % unit:
        return f"hidden {shape.hidden} is not a multiple of {unit} ({mode} mode)"
    return None


def resolve(names, experts: int | None = None, topk: int | None = None, hidden: int | None = None) -> list[Shape]:
    """The shapes of ``names`` (preset names, or ``["all"]`` for every preset), each with the fields given
    explicitly (not None) put in place of the preset's; a shape so changed is named ``custom`` (``<name>-custom``
    among several)."""
    names = list(MODELS) if list(names) == ["all"] else list(names)
    out = []
    for name in names:
        base = MODELS[name]
        shape = dataclasses.replace(base, **{k: v for k, v in (("experts", experts), ("topk", topk),
                                                               ("hidden", hidden)) if v is not None})
        if shape != base:
            shape = dataclasses.replace(shape, name=CUSTOM if len(names) == 1 else f"{name}-{CUSTOM}")
        out.append(shape)
    return out


def is_custom(shape: Shape) -> bool:
    """Whether ``shape`` is not a preset as published (its fields were given on the command line)."""
    return shape.name not in MODELS
