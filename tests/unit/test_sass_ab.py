"""benchmarks/sass_ab.py: the SASS comparison of two trees (parsing and counting; nvdisasm is not needed here)."""
import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "sass_ab.py"
_spec = importlib.util.spec_from_file_location("sass_ab", _PATH)
sass_ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_ab)

_TEXT = """
\t.section\t.text._Z1kv,"ax",@progbits
.text._Z1kv:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.64 R2, desc[UR4][R4.64] ;
        /*0020*/              @!P0 STG.E.STRONG.SYS desc[UR4][R6.64+0x10], R3 ;
        /*0030*/                   NOP;
        /*0040*/                   BRA `(.L_x_12) ;
.text._Z1jv:
        /*0000*/                   EXIT ;
"""


def test_parse_splits_kernels_and_drops_nops():
    functions = sass_ab.parse_sass(_TEXT)
    assert list(functions) == ["_Z1kv", "_Z1jv"]
    assert functions["_Z1kv"] == ["LDC R1, c[0x0][0x28]", "LDG.E.64 R2, desc[UR4][R4.64]",
                                  "@!P0 STG.E.STRONG.SYS desc[UR4][R6.64+0x10], R3", "BRA `(.L_x_12)"]
    assert functions["_Z1jv"] == ["EXIT"]


def test_renamed_registers_and_moved_instructions_are_no_difference():
    base = ["LDG.E.64 R2, desc[UR4][R4.64]", "IADD3 R1, R2, 0x4, RZ", "@P0 BRA `(.L_x_3)"]
    head = ["IADD3 R7, R9, 0x8, RZ", "LDG.E.64 R8, desc[UR6][R10.64]", "@P1 BRA `(.L_x_9)"]
    c = sass_ab.compare(base, head)
    assert c == {"base": 3, "head": 3, "differing": 0, "memory_base": 1, "memory_head": 1}


def test_an_added_or_removed_instruction_counts_and_memory_ops_are_told_apart():
    base = ["LDC R1, c[0x0][0x28]", "LDS R2, [R3]", "ATOM.E.ADD.STRONG.GPU PT, R0, desc[UR4][R6.64], R1"]
    head = base[:2] + ["@!P2 STG.E desc[UR4][R6.64], R3", "MEMBAR.SC.SYS", "FADD R1, R2, R3"]
    c = sass_ab.compare(base, head)
    # the atomic is gone (1), the store, the fence and the add are new (3); LDC is a constant load, not memory
    assert c["differing"] == 4
    assert (c["memory_base"], c["memory_head"]) == (2, 3)


def test_a_tree_without_the_sources_is_a_usage_error(tmp_path, capsys):
    assert sass_ab.main([str(tmp_path)]) == 2
    assert "holds no cupy_ep/" in capsys.readouterr().err
    assert sass_ab.main([]) == 2
