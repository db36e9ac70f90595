"""Calls whose positional arguments are not just the tensors in order: torch.einsum(eq, a, b),
torch.cat([a, b], dim), F.layer_norm(x, shape, weight, bias), x.view(8, 16). The spec decides
the positions, the case carries them (CallArg), the harness builds the call from them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardverify.errors import InvalidArgument, SpecError
from shardverify.spec.loader import load_yaml_text
from shardverify.spec.op import parse_op_spec
from shardverify.spec.case import CallArg, InputDecl, OpCase

SPECS = Path(__file__).resolve().parents[1] / "specs"


def spec_cases(name: str) -> dict[str, OpCase]:
    spec = parse_op_spec(load_yaml_text((SPECS / f"{name}.yaml").read_text(), f"specs/{name}.yaml"))
    return dict(spec.op_cases())


def op_node(case: OpCase):
    graph_module, name = case.build()
    return next(n for n in graph_module.graph.nodes if n.name == name)


def test_call_args_are_validated_eagerly():
    with pytest.raises(InvalidArgument, match="kind must be one of"):
        CallArg("starred", 1)
    with pytest.raises(InvalidArgument, match=r"a keyword argument is a \(keyword, input name\) pair, got 1"):
        CallArg("keyword", 1)
    with pytest.raises(InvalidArgument, match="names an input"):
        CallArg("tensor", 3)
    with pytest.raises(InvalidArgument, match="one or more inputs"):
        CallArg("list", ())
    inputs = (InputDecl("a", (2, 2)), InputDecl("b", (2, 2)))
    with pytest.raises(InvalidArgument, match="exactly once"):
        OpCase(op="cat", target="torch.cat", inputs=inputs, positional=(CallArg("list", ("a", "a")),))
    with pytest.raises(InvalidArgument, match="needs a tensor first"):
        OpCase(op="m", target="torch.Tensor.add", inputs=inputs[:1],
               positional=(CallArg("value", 1.0), CallArg("tensor", "a")))


def test_einsum_takes_its_equation_first():
    cases = spec_cases("einsum")
    case = next(c for cid, c in cases.items() if "bkj" in cid)
    node = op_node(case)
    assert node.target is torch.einsum and node.args[0] == "bij,bkj->bik"
    assert [a.name for a in node.args[1:]] == ["a", "b"]
    assert "einsum('bij,bkj->bik', a: float32[4, 8, 8], b: float32[4, 8, 8])" in case.describe()


def test_cat_takes_its_tensors_as_one_list():
    for count, case in enumerate(list(spec_cases("cat").values())[::3][:2], start=2):   # tensors: 2, then 3
        node = op_node(case)
        names = [f"tensors_{k}" for k in range(count)]
        assert isinstance(node.args[0], (list, tuple)) and [a.name for a in node.args[0]] == names
        assert case.positional == (CallArg("list", tuple(names)),)


def test_layer_norm_passes_normalized_shape_before_its_affine_tensors_and_none_for_a_dropped_one():
    cases = spec_cases("layer_norm_functional")
    both = op_node(cases["torch.nn.functional.layer_norm-normalized_shape_8.16-weight_True-bias_True"])
    assert both.args[1] == (8, 16) and [both.args[2].name, both.args[3].name] == ["weight", "bias"]
    no_weight = op_node(cases["torch.nn.functional.layer_norm-normalized_shape_8.16-weight_False-bias_True"])
    assert no_weight.args[2] is None and no_weight.args[3].name == "bias"
    plain = cases["torch.nn.functional.layer_norm-normalized_shape_8.16-weight_False-bias_False"]
    assert plain.positional == ()          # just the input: the plain call, its shape by keyword


def test_plain_calls_keep_their_plain_form():
    assert all(case.positional == () for case in spec_cases("add").values())


SPEC = """\
op: view
targets: [torch.Tensor.view]
operands:
  input: {kind: input, index: 0}
  output: {kind: output}
params:
  size: {keyword: size, varargs: true}
generator: {family: rules, options: {view: reshape, shape_param: size}}
verify:
  inputs: {input: {shape: [8, 4]}}
  grid: {size: [[32]]}
  meshes: [[2]]
"""


def test_varargs_needs_an_index():
    with pytest.raises(SpecError, match=r"specs/view.yaml:7: .*'varargs' reads the positional arguments"):
        parse_op_spec(load_yaml_text(SPEC, "specs/view.yaml"))


def test_shape_param_is_only_for_reshape_views():
    text = SPEC.replace("size: {keyword: size, varargs: true}", "size: {index: 1, keyword: size, varargs: true}")
    text = text.replace("view: reshape, shape_param", "view: transpose, dim0_param: size, dim1_param: size, shape_param")
    with pytest.raises(SpecError, match="shape_param.*applies to view: reshape"):
        parse_op_spec(load_yaml_text(text, "specs/view.yaml"))


def test_a_position_before_a_tensor_must_be_declared():
    text = (SPECS / "einsum.yaml").read_text().replace("  equation: {index: 0}\n", "  equation: {keyword: equation}\n")
    with pytest.raises(SpecError, match=r"operand 'a' is passed positionally .* at index 1, but nothing is declared "
                                        r"at index 0") as info:
        parse_op_spec(load_yaml_text(text, "specs/einsum.yaml"))
    assert info.value.field == "verify.inputs.a"


def test_indices_must_name_an_operand():
    text = (SPECS / "embedding.yaml").read_text().replace("indices: {input: v}", "indices: {ids: v}")
    with pytest.raises(SpecError, match=r"option 'indices' names operand 'ids', which the spec does not declare"):
        parse_op_spec(load_yaml_text(text, "specs/embedding.yaml"))
