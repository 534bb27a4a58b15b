"""benchmarks/ab_table.py: the before/after table of scripts/bench_ab.sh from its run folders."""
import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "ab_table.py"
_spec = importlib.util.spec_from_file_location("ab_table", _PATH)
ab_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_table)


def _normal(us_call, us_steady):
    return {"results": [{"op": "combine", "dtype": "bf16", "zero_copy": False, "time_us_median": us_call,
                         "time_us_graph": None, "time_us_steady": us_steady}]}


def _ll(us):
    return {"results": [
        {"op": "ll_dispatch", "dtype": "fp8", "tokens": 128, "timing": "graph", "graph": True, "time_us_median": us},
        {"op": "ll_dispatch", "dtype": "fp8", "tokens": 128, "timing": "steady", "graph": True,
         "time_us_median": 0.001},
        {"op": "ll_combine", "partials": "24-bit", "dtype": "bf16", "tokens": 128, "timing": "graph", "graph": True,
         "time_us_median": 2 * us},
        {"op": "ll_combine", "partials": "logfmt", "dtype": "bf16", "tokens": 128, "timing": "graph", "graph": True,
         "time_us_median": 4 * us},
        {"op": "ll_combine", "partials": "24-bit", "dtype": "bf16", "tokens": 128, "timing": "host", "graph": False,
         "check_values": False, "host_us_per_call": us / 2, "time_us_median": None}]}


def _write(root: Path, name: str, data: dict) -> None:
    (root / name).mkdir()
    (root / name / "bench.json").write_text(json.dumps(data))


def test_the_table_has_every_run_the_medians_ratio_and_the_base_spread(tmp_path):
    _write(tmp_path, "normal_base_1", _normal(100.0, 50.0))
    _write(tmp_path, "normal_base_2", _normal(110.0, 52.0))
    _write(tmp_path, "normal_head_1", _normal(99.0, 51.0))
    _write(tmp_path, "normal_head_2", _normal(101.0, 53.0))
    _write(tmp_path, "ll_base_1", _ll(20.0))
    _write(tmp_path, "ll_head_1", _ll(22.0))
    (tmp_path / "host_base_1.log").write_text("host time per call, combine: median 40.0 us, min 30.0 us\n")
    (tmp_path / "host_head_1.log").write_text("noise\nhost time per call, combine: median 30.0 us, min 29.0 us\n")
    table = ab_table.collect(tmp_path)
    assert table[("normal", "combine bf16", "call")] == {"base": {1: 100.0, 2: 110.0}, "head": {1: 99.0, 2: 101.0}}
    assert ("normal", "combine bf16", "graph") not in table  # no graph timing in the run: no row
    text = ab_table.markdown(table)
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:3]): line for line in text.splitlines()[2:]}
    call = rows[("normal", "combine bf16", "call")].split("|")
    assert call[-3].strip() == f"{100.0 / 105.0:.3f}"  # head median 100 over base median 105
    assert call[-2].strip() == "10.0 %"  # base 110 / 100 - 1
    steady = rows[("normal", "combine bf16", "steady")].split("|")
    assert steady[-3].strip() == f"{52.0 / 51.0:.3f}"
    ll = rows[("ll", "ll_dispatch fp8 T=128", "graph")].split("|")
    assert ll[-3].strip() == "1.100" and ll[-2].strip() == "-"  # one base round: no spread
    assert ("ll", "ll_dispatch fp8 T=128", "steady") not in rows  # not resolved (written as 0.001): no row
    # the combine's partials name separate figures, not one row the last of them overwrites
    assert table[("ll", "ll_combine bf16 T=128 (24-bit partials)", "graph")] == {"base": {1: 40.0}, "head": {1: 44.0}}
    assert table[("ll", "ll_combine bf16 T=128 (logfmt partials)", "graph")] == {"base": {1: 80.0}, "head": {1: 88.0}}
    assert table[("ll", "ll_combine bf16 T=128 (24-bit partials)", "host (no checks)")] == {"base": {1: 10.0},
                                                                                "head": {1: 11.0}}
    host = rows[("host", "combine", "host")].split("|")
    assert host[-3].strip() == "0.750"


def test_a_figure_timed_in_one_tree_only_has_no_row(tmp_path):
    _write(tmp_path, "normal_base_1", _normal(100.0, 50.0))
    assert ab_table.markdown(ab_table.collect(tmp_path)).count("\n") == 1  # the header lines only


@pytest.mark.parametrize("argv", [[], ["/nonexistent/ab"]])
def test_a_missing_folder_is_a_usage_error(argv, capsys):
    assert ab_table.main(argv) == 2
    assert "ab_table.py" in capsys.readouterr().err
