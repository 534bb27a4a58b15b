"""The before/after table of a ``scripts/bench_ab.sh run``: python benchmarks/ab_table.py AB_DIR [> table.md].

``AB_DIR`` is the run's ``$OUT/ab``: per run ``<mode>_<tree>_<round>/`` (the benchmark's JSON) and
``host_<tree>_<round>.log`` (benchmarks/host_overhead.py). Per timed figure the table lists every run's median, the
median over the rounds per tree, their ratio head/base, and the spread of the base tree between its own rounds
(max/min - 1): a ratio inside that spread is noise, not a change.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

_RUN = re.compile(r"^(normal|ll)_(base|head)_(\d+)$")
_HOST_LOG = re.compile(r"^host_(base|head)_(\d+)\.log$")
_HOST_LINE = re.compile(r"^host time per call, (.+): median ([0-9.]+) us")
#: per mode, the JSON fields of a result row that name it and the timings it carries
_NORMAL_TIMINGS = (("call", "time_us_median"), ("graph", "time_us_graph"), ("steady", "time_us_steady"))


def _rows(mode: str, data: dict):
    """``(name, timing, us)`` of every timed figure of one benchmark JSON."""
    for r in data.get("results", []):
        if mode == "normal":
            name = f"{r['op']} {r['dtype']}{' zero-copy' if r.get('zero_copy') else ''}"
            for timing, field in _NORMAL_TIMINGS:
                if isinstance(r.get(field), (int, float)) and r[field] > 0.01:
                    yield name, timing, float(r[field])
        else:
            # the combine's forms differ only in their partials (24-bit, bf16, logfmt): each is a figure of its own
            partials = f" ({r['partials']} partials)" if r.get("partials") else ""
            name = f"{r['op']} {r['dtype']} T={r['tokens']}{partials}"
            if r.get("timing") == "host":  # the benchmark's back-to-back host time per call
                if isinstance(r.get("host_us_per_call"), (int, float)):
                    checks = "check_values" if r.get("check_values") else "no checks"
                    yield name, f"host ({checks})", float(r["host_us_per_call"])
            elif isinstance(r.get("time_us_median"), (int, float)) and r["time_us_median"] > 0.01:
                yield name, r["timing"], float(r["time_us_median"])  # call, graph or steady


def collect(ab_dir: Path) -> dict:
    """``{(mode, name, timing): {tree: {round: us}}}`` of every run under ``ab_dir``."""
    table: dict = defaultdict(lambda: defaultdict(dict))
    for path in sorted(ab_dir.iterdir()):
        m = _RUN.match(path.name)
        if m and path.is_dir():
            mode, tree, rnd = m.group(1), m.group(2), int(m.group(3))
            for js in sorted(path.glob("*.json")):
                for name, timing, us in _rows(mode, json.loads(js.read_text())):
                    table[(mode, name, timing)][tree][rnd] = us
        h = _HOST_LOG.match(path.name)
        if h:
            for line in path.read_text().splitlines():
                hl = _HOST_LINE.match(line)
                if hl:
                    table[("host", hl.group(1), "host")][h.group(1)][int(h.group(2))] = float(hl.group(2))
    return table


def markdown(table: dict) -> str:
    """The table as markdown, one row per figure timed in both trees."""
    rounds = sorted({r for per_tree in table.values() for runs in per_tree.values() for r in runs})
    head = ["mode", "figure", "timing"] + [f"base {r}" for r in rounds] + [f"head {r}" for r in rounds]
    lines = ["| " + " | ".join(head + ["head/base", "base spread"]) + " |", "|" + "---|" * (len(head) + 2)]
    for (mode, name, timing), per_tree in table.items():
        base, new = per_tree.get("base", {}), per_tree.get("head", {})
        if not base or not new:
            continue
        cells = [mode, name, timing] + [f"{base[r]:.1f}" if r in base else "-" for r in rounds]
        cells += [f"{new[r]:.1f}" if r in new else "-" for r in rounds]
        ratio = statistics.median(new.values()) / statistics.median(base.values())
        spread = max(base.values()) / min(base.values()) - 1 if len(base) > 1 else None
        cells += [f"{ratio:.3f}", "-" if spread is None else f"{100 * spread:.1f} %"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    print(markdown(collect(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
