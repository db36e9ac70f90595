"""A case grown for a benchmark grows its free dims only (shardverify/spec/scaled.py): rows,
batch and spatial dims, never a contracted dim two inputs share or a module's feature dim, and
a case that cannot grow is a clear error naming it. Shapes are propagated on meta tensors only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardverify.errors import InvalidArgument
from shardverify.spec.case import CallArg, InputDecl, ModuleDecl, OpCase
from shardverify.spec.scaled import scale_case

ROOT = Path(__file__).resolve().parents[1]


def shapes(case: OpCase) -> list[tuple[int, ...]]:
    return [decl.shape for decl in case.inputs]


def test_matmul_grows_its_rows_never_the_contracted_dim():
    case = OpCase(op="matmul", target="torch.matmul",
                  inputs=(InputDecl("input", (4, 8, 16)), InputDecl("other", (16, 8))))
    grown = scale_case(case, 8)
    assert shapes(grown.case) == [(32, 64, 16), (16, 8)]
    assert grown.describe() == "input[0, 1]"


def test_bmm_grows_the_batch_of_both_inputs_together():
    case = OpCase(op="bmm", target="torch.bmm",
                  inputs=(InputDecl("input", (4, 8, 16)), InputDecl("mat2", (4, 16, 8))))
    assert shapes(scale_case(case, 4).case) == [(16, 32, 16), (16, 16, 8)]


def test_a_dim_shared_by_two_inputs_that_leaves_the_result_as_it_was_is_contracted():
    """einsum's k: both inputs grown on it still build, but the result is no larger."""
    case = OpCase(op="einsum", target="torch.einsum", inputs=(InputDecl("a", (8, 4)), InputDecl("b", (8, 6))),
                  positional=(CallArg("value", "ki,kj->ij"), CallArg("tensor", "a"), CallArg("tensor", "b")))
    with pytest.raises(InvalidArgument, match=r"a\[0\] is contracted with b\[0\]"):
        scale_case(case, 2)


def test_conv2d_grows_batch_and_height_never_its_in_channels():
    case = OpCase(op="conv2d", target="torch.nn.Conv2d", inputs=(InputDecl("input", (2, 8, 6, 6)),),
                  module=ModuleDecl("torch.nn.Conv2d", (8, 4, 3), (("padding", 1),)))
    assert shapes(scale_case(case, 4).case) == [(8, 8, 24, 6)]


def test_one_input_cases_grow_every_leading_dim_as_the_benchmark_always_did():
    """linear's and sum's figures in past notes stay comparable."""
    linear = OpCase(op="linear", target="torch.nn.Linear", inputs=(InputDecl("input", (4, 4, 4, 16)),),
                    module=ModuleDecl("torch.nn.Linear", (16, 32), (("bias", False),)))
    total = OpCase(op="sum", target="torch.sum", inputs=(InputDecl("input", (4, 4, 4, 16)),),
                   params=(("dim", (0, 2)), ("keepdim", False)),
                   predecessor=ModuleDecl("torch.nn.Linear", (16, 32), (("bias", False),)))
    for case in (linear, total):
        assert shapes(scale_case(case, 8).case) == [(32, 32, 32, 16)]


def test_a_case_that_cannot_grow_is_an_error_naming_it():
    case = OpCase(op="view", target="torch.Tensor.view", inputs=(InputDecl("input", (8, 4, 16)),),
                  params=(("size", (32, 16)),))
    with pytest.raises(InvalidArgument, match=r"view\(input: float32\[8, 4, 16\].*input\[0\] does not build"):
        scale_case(case, 8)


def test_the_benchmark_row_refuses_it_as_unmeasured():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_verify
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    case = OpCase(op="view", target="torch.Tensor.view", inputs=(InputDecl("input", (8, 4, 16)),),
                  params=(("size", (32, 16)),))
    with pytest.raises(bench_verify.Unmeasured, match=r"^view: its first case cannot be grown x8"):
        bench_verify.scaled_case(case, 8)
