"""The YAML reader and the op spec validation: every error names file, line and field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardverify.spec.fields import Fields, as_dtype, as_identifier, as_shape, resolve_target
from shardverify.spec.loader import Node, load_yaml, load_yaml_text
from shardverify.spec.op import parse_op_spec
from shardverify.errors import SpecError
from shardverify.strategies.generators.registry import register_generator

SPECS = Path(__file__).resolve().parents[1] / "specs"

# A complete op spec; tests change one line (found by its text) and expect an error there.
BASE = """\
op: sum
targets:
  - torch.sum
  - torch.Tensor.sum
operands:
  input: {kind: input, index: 0, keyword: input}
  output: {kind: output}
params:
  dim: {index: 1, keyword: dim, default: null}
  keepdim: {index: 2, keyword: keepdim, default: false}
generator:
  family: rules
  options: {follow: input, reduce_dims_param: dim, keepdim_param: keepdim}
verify:
  predecessor: {target: torch.nn.Linear, args: [16, 32], kwargs: {bias: false}}
  inputs:
    input: {shape: [4, 4, 4, 16], dtype: float32}
  grid:
    dim: [[0, 2], 1, -1, null]
    keepdim: [false, true]
  meshes: [[2, 2], [4]]
  strategies:
    - {mesh: [2, 2], where: {dim: 1}, count: 3}
  tolerance: {rtol: 1.0e-5, atol: 1.0e-6}
"""


def line_of(text: str, needle: str) -> int:
    """1-based line of the only line containing `needle`."""
    hits = [n for n, line in enumerate(text.splitlines(), start=1) if needle in line]
    assert len(hits) == 1, (needle, hits)
    return hits[0]


def edit(old: str, new: str, text: str = BASE) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def parse(text: str, file: str = "specs/sum.yaml"):
    return parse_op_spec(load_yaml_text(text, file))


def spec_error(text: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse(text)
    return info.value


def assert_error_at(text: str, needle: str, *fragments: str, field: str | None = None) -> SpecError:
    """The spec fails with one error on the line containing `needle`, mentioning `fragments`."""
    error = spec_error(text)
    line = line_of(text, needle)
    message = str(error)
    assert error.file == "specs/sum.yaml" and error.line == line, message
    assert message.startswith(f"specs/sum.yaml:{line}:"), message
    for fragment in fragments:
        assert fragment in message, message
    if field is not None:
        assert error.field == field, message
    return error


# --------------------------------------------------------------------------- the reader

def test_nodes_keep_lines_and_field_paths():
    root = load_yaml_text(BASE, "specs/sum.yaml")
    grid_dim = root.value["verify"].value["grid"].value["dim"]
    assert grid_dim.line == line_of(BASE, "dim: [[0, 2]")
    assert grid_dim.value[1].path == "verify.grid.dim[1]" and grid_dim.value[1].value == 1
    assert root.plain()["verify"]["grid"]["dim"] == [[0, 2], 1, -1, None]
    error = grid_dim.value[3].error("boom")
    assert str(error) == f"specs/sum.yaml:{grid_dim.line}: field 'verify.grid.dim[3]': boom"


def test_duplicate_keys_are_errors_naming_both_lines():
    text = edit("    keepdim: [false, true]\n", "    keepdim: [false, true]\n    dim: [0]\n")
    with pytest.raises(SpecError) as info:
        load_yaml_text(text, "specs/sum.yaml")
    assert info.value.line == line_of(text, "dim: [0]")
    assert f"first defined on line {line_of(text, 'dim: [[0, 2]')}" in str(info.value)
    assert info.value.field == "verify.grid.dim"


@pytest.mark.parametrize("text, line, fragment", [
    ("a: [1, 2\nb: 3\n", 2, "invalid YAML"),
    ("a: 1\n  b: 2\n", 2, "invalid YAML"),
    ("a: &x 1\nb: *x\n", 2, "aliases"),
    ("a: !!python/object:os.system 1\n", 1, "tag"),
    ("base: {a: 1}\nc:\n  <<: {a: 1}\n", 3, "merge keys"),
    ("1: one\n", 1, "keys must be strings"),
    ("", 1, "empty"),
])
def test_yaml_problems_are_spec_errors_with_lines(text, line, fragment):
    with pytest.raises(SpecError) as info:
        load_yaml_text(text, "x.yaml")
    assert info.value.file == "x.yaml" and info.value.line == line, str(info.value)
    assert fragment in str(info.value)


def test_load_yaml_reads_files_and_names_them(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("a: 1\na: 2\n")
    with pytest.raises(SpecError, match=r"^specs/s\.yaml:2: field 'a': duplicate key"):
        load_yaml(path, display="specs/s.yaml")
    with pytest.raises(SpecError, match="cannot read"):
        load_yaml(tmp_path / "missing.yaml")


def test_fields_reject_unknown_keys_and_wrong_types():
    node = load_yaml_text("shape: [1, 2]\nflag: yes\ncount: true\nshpe: 3\n", "f.yaml")
    fields = Fields(node)
    assert as_shape(fields.required("shape", list)) == (1, 2)
    assert fields.required("flag", bool).value is True
    with pytest.raises(SpecError, match=r"^f\.yaml:3: field 'count': expected an integer, got boolean True"):
        fields.required("count", int)
    with pytest.raises(SpecError, match=r"^f\.yaml:1: field 'missing': missing required key 'missing'"):
        fields.required("missing", int)
    assert fields.optional("other", int) is None
    with pytest.raises(SpecError, match=r"^f\.yaml:4: field 'shpe': unknown key 'shpe' \(did you mean 'shape'\?\)"
                                        r"; allowed keys: shape, flag, count, missing, other"):
        fields.finish()
    with pytest.raises(SpecError, match="expected a mapping, got a list"):
        Fields(load_yaml_text("[1]", "f.yaml"))


@pytest.mark.parametrize("text, reader, fragment", [
    ("x: [2, 0]", as_shape, "expected a positive integer, got integer 0"),
    ("x: [2, -1]", as_shape, "expected a positive integer"),
    ("x: [2, true]", as_shape, "got boolean True"),
    ("x: [2, 2.0]", as_shape, "got number 2.0"),
    ("x: 4", as_shape, "expected a list, got integer 4"),
    ("x: flaot32", as_dtype, "unknown torch dtype 'flaot32'"),
    ("x: torch.sum", as_dtype, "unknown torch dtype"),
    ("x: class", as_identifier, "expected a Python identifier"),
    ("x: 'a-b'", as_identifier, "expected a Python identifier"),
    ("x: torch.nope", resolve_target, "does not resolve"),
    ("x: os.system", resolve_target, "not under 'torch'"),
    ("x: torch._C._nn.linear", resolve_target, "no private parts"),
    ("x: torch.ops.aten.__softmax.default", resolve_target, "no private parts"),   # one underscore only
    ("x: torch.ops._aten.sum.default", resolve_target, "no private parts"),
    ("x: torch.float32", resolve_target, "not a callable or class"),
    ("x: torch.nn", resolve_target, "not a callable or class"),
])
def test_value_readers_reject_bad_values(text, reader, fragment):
    node = load_yaml_text(text, "f.yaml").value["x"]
    with pytest.raises(SpecError) as info:
        reader(node)
    assert info.value.line == 1 and info.value.field is not None and info.value.field.startswith("x")
    assert fragment in str(info.value)


def test_value_readers_accept_good_values():
    node = load_yaml_text("a: [torch.sum, torch.Tensor.sum, torch.nn.Linear, torch.nn.functional.linear]\n"
                          "b: torch.bfloat16\nc: [2, 2, 2]\nd: []\n", "f.yaml").value
    assert [resolve_target(n) for n in node["a"].value] == [
        "torch.sum", "torch.Tensor.sum", "torch.nn.Linear", "torch.nn.functional.linear"]
    assert as_dtype(node["b"]) == "bfloat16"
    assert as_shape(node["c"]) == (2, 2, 2)
    assert as_shape(node["d"]) == ()
    with pytest.raises(SpecError, match="non-empty"):
        as_shape(node["d"], allow_empty=False)


def test_an_underscored_core_aten_overload_is_a_target():
    """The Core ATen IR names some ops with a leading underscore (what torch.export emits)."""
    node = load_yaml_text("a: [torch.ops.aten._softmax.default, torch.ops.aten._to_copy.default]\n", "f.yaml").value
    assert [resolve_target(n) for n in node["a"].value] == ["torch.ops.aten._softmax.default",
                                                           "torch.ops.aten._to_copy.default"]


# ------------------------------------------------------------------------- op specs

def test_seed_specs_parse():
    linear = parse_op_spec(load_yaml(SPECS / "linear.yaml", display="specs/linear.yaml"))
    assert [t.name for t in linear.targets] == ["torch.nn.Linear", "torch.nn.functional.linear"]
    assert [t.form for t in linear.targets] == ["module", "function"]
    assert linear.verify.meshes == ((2, 2), (4,), (1, 4))
    assert linear.generator == "rules" and linear.source == "specs/linear.yaml"
    total = parse_op_spec(load_yaml(SPECS / "sum.yaml", display="specs/sum.yaml"))
    assert [t.form for t in total.targets] == ["function", "method"]
    assert total.grid_size() == 8 and len(total.cases()) == 16


def test_cases_follow_targets_and_grid():
    spec = parse(BASE)
    cases = spec.cases()
    assert [c.target for c in cases] == ["torch.sum"] * 8 + ["torch.Tensor.sum"] * 8
    assert cases[0].params == (("dim", (0, 2)), ("keepdim", False))
    assert cases[7].params == (("dim", None), ("keepdim", True))
    assert len({c.id for c in cases}) == len(cases)


def test_optional_operand_grid_drives_module_kwargs_and_inputs():
    linear = parse_op_spec(load_yaml(SPECS / "linear.yaml", display="specs/linear.yaml"))
    by_id = {case.id: case for case in linear.cases()}
    module_false = by_id["torch.nn.Linear-bias_False"]
    assert module_false.module.kwargs[-1] == ("bias", False)
    assert [i.role for i in module_false.inputs] == ["input"]
    assert [i.role for i in by_id["torch.nn.functional.linear-bias_False"].inputs] == ["input", "other"]
    assert [i.role for i in by_id["torch.nn.functional.linear-bias_True"].inputs] == ["input", "other", "bias"]


@pytest.mark.parametrize("old, new, needle, fragments", [
    # unknown keys, at every level
    ("op: sum\n", "op: sum\nopp: x\n", "opp: x", ("unknown key 'opp'", "allowed keys: op,")),
    ("  meshes: [[2, 2], [4]]\n", "  meshes: [[2, 2], [4]]\n  mesh: [2]\n", "  mesh: [2]",
     ("unknown key 'mesh'", "did you mean 'meshes'")),
    ("  input: {kind: input, index: 0, keyword: input}",
     "  input: {kind: input, index: 0, keyword: input, kwarg: x}", "kwarg: x", ("unknown key 'kwarg'",)),
    # wrong types
    ("  keepdim: {index: 2,", "  keepdim: {index: two,", "index: two", ("expected an integer, got string 'two'",)),
    ("  meshes: [[2, 2], [4]]", "  meshes: 4", "meshes: 4", ("expected a list, got integer 4",)),
    ("op: sum", "op: [sum]", "op: [sum]", ("expected a string, got a list",)),
    ("  input: {kind: input,", "  input: {kind: tensor,", "kind: tensor", ("expected one of input, param, output",)),
    # targets
    ("  - torch.sum\n", "  - torch.summ\n", "torch.summ", ("does not resolve", "no attribute 'summ'")),
    ("  - torch.sum\n", "  - builtins.eval\n", "builtins.eval", ("not under 'torch'",)),
    ("  - torch.sum\n", "  - torch.Size\n", "torch.Size", ("not a torch.nn.Module",)),
    ("  - torch.Tensor.sum\n", "  - torch.sum  # again\n", "# again", ("listed twice",)),
    ("  predecessor: {target: torch.nn.Linear,", "  predecessor: {target: torch.relu,", "torch.relu",
     ("expected a torch.nn.Module class",)),
    # generator
    ("  family: rules", "  family: folowing", "family: folowing", ("unknown generator family 'folowing'",)),
    ("reduce_dims_param: dim,", "reduce_dims_param: dims,", "reduce_dims_param: dims",
     ("names parameter 'dims'", "declared: dim, keepdim")),
    # grid
    ("    keepdim: [false, true]", "    keepdim: []", "keepdim: []", ("grid values for 'keepdim' are empty",)),
    ("    keepdim: [false, true]", "    keepdim: [false, false]", "keepdim: [false, false]", ("listed twice",)),
    ("    keepdim: [false, true]", "    keepdims: [false, true]", "keepdims:",
     ("grid key 'keepdims' is neither a parameter nor an optional operand",)),
    ("    dim: [[0, 2], 1, -1, null]", "    dim: [{a: 1}]", "dim: [{a: 1}]", ("got a mapping",)),
    # meshes
    ("  meshes: [[2, 2], [4]]", "  meshes: [[2, 0], [4]]", "meshes:", ("expected a positive integer, got integer 0",)),
    ("  meshes: [[2, 2], [4]]", "  meshes: [[2, 2], [-4]]", "meshes:", ("expected a positive integer, got integer -4",)),
    ("  meshes: [[2, 2], [4]]", "  meshes: [[2, 2], []]", "meshes:", ("non-empty list",)),
    ("  meshes: [[2, 2], [4]]", "  meshes: [[2, 2], 4]", "meshes:", ("expected a list, got integer 4",)),
    ("  meshes: [[2, 2], [4]]", "  meshes: []", "meshes:", ("list at least one mesh",)),
    ("  meshes: [[2, 2], [4]]", "  meshes: [[2, 2], [2, 2]]", "meshes:", ("listed twice",)),
    # inputs, dtypes, expectations, tolerances
    ("dtype: float32}", "dtype: float33}", "float33", ("unknown torch dtype 'float33'",)),
    ("    input: {shape: [4, 4, 4, 16]", "    inp: {shape: [4, 4, 4, 16]", "inp:",
     ("'inp' is not an input or param operand",)),
    ("    - {mesh: [2, 2], where", "    - {mesh: [8], where", "mesh: [8]", ("not one of verify.meshes",)),
    ("where: {dim: 1}", "where: {dim: 3}", "dim: 3}", ("3 is not one of the grid values",)),
    ("where: {dim: 1}", "where: {dims: 1}", "dims: 1}", ("'dims' is not a grid key",)),
    ("tolerance: {rtol: 1.0e-5,", "tolerance: {rtol: -1.0,", "rtol: -1.0", ("expected a tolerance in [0, 0.1]",)),
    ("tolerance: {rtol: 1.0e-5,", "tolerance: {rtol: 1.0e+6,", "rtol: 1.0e+6", ("a looser one lets a wrong rule pass",)),
    ("tolerance: {rtol: 1.0e-5,", "tolerance: {rtol: .nan,", "rtol: .nan", ("finite number",)),
    # operands and params
    ("  keepdim: {index: 2,", "  keepdim: {index: 1,", "keepdim: {index: 1",
     ("positional index 1 of 'keepdim' is already used by 'dim'",)),
    ("  dim: {index: 1, keyword: dim,", "  dim: {index: 1, keyword: input,", "keyword: input, default",
     ("keyword 'input' of 'dim' is already used by 'input'",)),
    ("  output: {kind: output}", "  output: {kind: output, keyword: out}", "kind: output, keyword: out",
     ("takes no keyword",)),
    ("  input: {kind: input, index: 0, keyword: input}", "  input: {kind: input}", "input: {kind: input}",
     ("needs an 'index' or a 'keyword'",)),
])
def test_op_spec_errors_name_file_line_and_field(old, new, needle, fragments):
    assert_error_at(edit(old, new), needle, *fragments)


def test_missing_required_key_points_at_the_mapping():
    text = edit("  meshes: [[2, 2], [4]]\n", "")
    error = assert_error_at(text, "verify:", "missing required key 'meshes'")
    assert error.field == "verify.meshes"


def test_generator_option_naming_an_undeclared_operand():
    text = edit("options: {follow: input,", "options: {follow: weight,")
    assert_error_at(text, "follow: weight", "names operand 'weight'", "declared: input, output")


register_generator("test_no_options")(lambda ctx: [])   # a family registered without an options parser


def test_a_family_without_options_takes_none():
    text = edit("  family: rules\n  options: {follow: input, ", "  family: test_no_options\n  options: {")
    assert_error_at(text, "options: {", "generator family 'test_no_options' takes no options")


BLOCK_OPTIONS = edit("  options: {follow: input, reduce_dims_param: dim, keepdim_param: keepdim}\n",
                     "  options:\n    follow: input\n    reduce_dims_param: dim\n    keepdim_param: keepdim\n"
                     "    linear_in:\n      - input\n")


@pytest.mark.parametrize("old, new, needle, fragments, field", [
    ("    keepdim_param: keepdim\n", "    keepdim_param: keepdim\n    wohle: [x]\n", "wohle",
     ("unknown rule option 'wohle'",), "generator.options.wohle"),
    ("    keepdim_param: keepdim\n", "    keepdim_param: keepdim\n    whole: [x]\n", "whole: [x]",
     ("rule option 'whole' does not apply to a 'reduce_dims_param' rule", "einsum"), "generator.options.whole"),
    ("    keepdim_param: keepdim\n", "    keepdim_param: [keepdim]\n", "keepdim_param",
     ("'keepdim_param' must be a string",), "generator.options.keepdim_param"),
    ("    keepdim_param: keepdim\n", "    keepdim_param: keep\n", "keepdim_param",
     ("option 'keepdim_param' names parameter 'keep'", "declared: dim, keepdim"), "generator.options.keepdim_param"),
    ("      - input\n", "      - input\n      - bias\n", "- bias",
     ("option 'linear_in' names operand 'bias'", "declared: input, output"), "generator.options.linear_in[1]"),
    ("      - input\n", "      - input\n    monotone_in:\n      - input\n      - -input:sum\n", "-input:sum",
     ("monotone_in", "'-input:sum' is not `name`"), "generator.options.monotone_in[1]"),
])
def test_each_rule_option_error_names_its_own_line(old, new, needle, fragments, field):
    """Block-style options: an error about a key names that key's line (or the item's inside its
    value), not the line of `options:`."""
    assert_error_at(edit(old, new, BLOCK_OPTIONS), needle, *fragments, field=field)


def test_module_targets_need_module_init_and_attributes():
    text = edit("  - torch.Tensor.sum\n", "  - torch.nn.Softmax\n")
    error = spec_error(text)
    assert "a module target (a torch.nn.* class) needs 'module' under 'verify'" in str(error) and error.line == line_of(text, "verify:")
    linear = (SPECS / "linear.yaml").read_text()
    text = edit("    attribute: weight            # read from the module for torch.nn.Linear\n", "", linear)
    with pytest.raises(SpecError, match="param operand 'other' needs an 'attribute'"):
        parse(text)


def test_function_targets_need_every_position_before_a_tensor():
    linear = (SPECS / "linear.yaml").read_text()
    text = edit("    index: 2\n    keyword: bias", "    index: 3\n    keyword: bias", linear)
    with pytest.raises(SpecError, match=r"operand 'bias' is passed positionally .* at index 3, but nothing is declared at index 2") as info:
        parse(text)
    assert info.value.line == text.splitlines().index("    bias:") + 1
    assert info.value.field == "verify.inputs.bias"


def test_every_error_is_one_message_with_location():
    for bad in ("op: 1\n", "targets: 3\n", edit("  - torch.sum\n", "  - torch.sum.x\n")):
        message = str(spec_error(bad))
        assert re.match(r"specs/sum\.yaml:\d+: ", message), message
        assert "\n" not in message
