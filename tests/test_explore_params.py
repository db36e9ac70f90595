"""The property tests' parameters: every grid key drawn, beyond the grid where the rule serves
any value and within it where the rule is bound to it, coupled parameters (``same_length``)
drawn together, and a failure reported with the drawn call.

The central test plants a rule that is wrong only outside the grid: ``torch.triu`` written as
pointwise and verified on ``diagonal: [-8]`` (on sizes up to 8 that keeps every element, so
any layout passes), while the spec claims ``serves: any``. The search draws other diagonals
and finds it; bound to its grid value instead, the same rule is never drawn (nor served)
outside it.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample, Unsatisfiable

from shardverify.features import explore
from shardverify.backends import get_backend
from shardverify.spec.op_kind import HANDLER_DIR, render_op_spec
from shardverify.codegen.render import Renderer
from shardverify.errors import SpecError
from shardverify.sharding.mesh import DeviceMesh
from shardverify.spec.loader import load_yaml_text
from shardverify.spec.op import parse_op_spec
from shardverify.spec.op_model import value_length
from shardverify.strategies.handlers.base import unregister_handler
from shardverify.verify.engine import verify_case
from shardverify.verify.report import assert_passed

QUICK = settings(max_examples=200, database=None, derandomize=True, deadline=None)


def _triu_spec(name: str, target: str, serves: str) -> str:
    return f"""\
op: {name}
description: test-only; triu written as pointwise, right only for a diagonal that keeps every element
targets: [{target}]
operands:
  input: {{kind: input, index: 0, keyword: input}}
  output: {{kind: output}}
params:
  diagonal: {{index: 1, keyword: diagonal, default: 0{serves}}}
generator:
  family: rules
  options: {{pointwise: true}}
verify:
  inputs:
    input: {{shape: [8, 8]}}
  grid:
    diagonal: [-8]
  meshes: [[2], [4]]
"""


# wrongly `serves: any`: the rule holds only for diagonals that keep every element
SERVES_ANY_TRIU = _triu_spec("planted_triu_any", "torch.triu", ", serves: any")
# bound to the grid's diagonal (no `serves`): its handler refuses every other one
BOUND_TRIU = _triu_spec("planted_triu_bound", "torch.Tensor.triu", "")


def _registered(text: str, file: str):
    """The spec parsed, with its handler generated and registered like a shipped spec's."""
    spec = parse_op_spec(load_yaml_text(text, file))
    code = render_op_spec(spec, Renderer())[f"{HANDLER_DIR}/{spec.name}.py"]
    exec(compile(code, f"{spec.name}_handler.py", "exec"), types.ModuleType(f"{spec.name}_handler").__dict__)  # noqa: S102
    return spec


@pytest.fixture(scope="module")
def serves_any_triu():
    spec = _registered(SERVES_ANY_TRIU, "specs/planted_triu_any.yaml")
    yield spec
    unregister_handler(spec.name)


@pytest.fixture(scope="module")
def bound_triu():
    spec = _registered(BOUND_TRIU, "specs/planted_triu_bound.yaml")
    yield spec
    unregister_handler(spec.name)


@pytest.fixture(scope="module")
def backends():
    made: dict = {}

    def backend_for(mesh_shape):
        if mesh_shape not in made:
            made[mesh_shape] = get_backend("simulated", DeviceMesh(mesh_shape))
        return made[mesh_shape]

    yield backend_for
    for backend in made.values():
        backend.close()


def _drawn(spec, key):
    return dict(explore.param_strategies(spec))[key]


# ------------------------------------------------------------------------ beyond the grid / within it

def test_a_parameter_that_serves_any_value_is_drawn_beyond_the_grid(serves_any_triu):
    diagonal = _drawn(serves_any_triu, "diagonal")
    assert find(diagonal, lambda v: True, settings=QUICK) == -8          # the grid's value first
    assert find(diagonal, lambda v: v != -8, settings=QUICK) == 0       # then ints near it and 0
    with pytest.raises(NoSuchExample):                                  # ints, from -10 to 2
        find(diagonal, lambda v: not isinstance(v, int) or not -10 <= v <= 2, settings=QUICK)
    # a float near the listed one, of its sign; an int count near the listed one, never below 1
    other = _drawn(explore.load_spec("specs/compare_scalar.yaml"), "other")
    assert isinstance(find(other, lambda v: v != 0.25, settings=QUICK), float)
    with pytest.raises(NoSuchExample):
        find(other, lambda v: v <= 0, settings=QUICK)
    chunks = _drawn(explore.load_spec("specs/chunk.yaml"), "chunks")
    assert find(chunks, lambda v: v > 2, settings=QUICK) == 3
    with pytest.raises(NoSuchExample):
        find(chunks, lambda v: v < 1, settings=QUICK)


def test_a_bound_parameter_stays_within_its_grid_values(bound_triu):
    diagonal = _drawn(bound_triu, "diagonal")
    with pytest.raises(NoSuchExample):
        find(diagonal, lambda v: v != -8, settings=QUICK)
    # a bound dims parameter too (index_select's dim, verified on 0 only): no other dim is drawn
    dim = _drawn(explore.load_spec("specs/index_select.yaml"), "dim")
    with pytest.raises(NoSuchExample):
        find(dim, lambda v: v != 0, settings=QUICK)
    kinds = {draw.key: draw.kind for draw in explore.param_draws(bound_triu)}
    assert kinds == {"diagonal": "listed"}


def test_a_call_the_handler_refuses_is_rejected_not_failed(bound_triu, backends):
    example = _example(bound_triu, diagonal=0)

    @settings(max_examples=1, database=None, deadline=None)
    @given(st.just(example))
    def check(drawn):
        explore.check_example(backends((2,)), drawn)

    with pytest.raises(Unsatisfiable):    # every example rejected, none failed
        check()


def _example(spec, **point):
    verify = dataclasses.replace(spec.verify, grid=tuple((k, (v,)) for k, v in point.items()), meshes=((2,),),
                                 inputs=tuple(dataclasses.replace(i, shape=(2, 2)) for i in spec.verify.inputs))
    return explore.Example(dataclasses.replace(spec, verify=verify))


# ------------------------------------------------------------------------ the planted rule

def test_the_planted_rule_passes_its_grid(serves_any_triu, backends):
    for _, case in serves_any_triu.op_cases():
        for mesh in serves_any_triu.verify.meshes:
            assert_passed(verify_case(backends(mesh), case))


def test_the_search_finds_a_rule_wrong_only_beyond_the_grid_and_names_the_call(serves_any_triu, backends):
    failure = explore.search(serves_any_triu, examples_count=40, mesh_max_size=2, backend_factory=backends)
    assert failure is not None, "the search never drew a diagonal beyond the grid's -8"
    example = failure.example
    diagonal = dict(example.point)["diagonal"]
    assert diagonal != -8 and example.mesh_shape == (2,)
    first = failure.error.splitlines()[0]
    shape = ", ".join(map(str, example.shapes["input"]))
    assert first == f"drawn call: torch.triu(input: float32[{shape}], diagonal={diagonal}) on mesh (2,)", first
    assert "max abs error" in failure.error
    assert f"diagonal: [{diagonal}]" in failure.reproduction


def test_bound_to_its_grid_the_same_rule_passes_the_search(bound_triu, backends):
    seen = []
    failure = explore.search(bound_triu, examples_count=10, mesh_max_size=2, backend_factory=backends,
                             on_example=lambda e: seen.append(dict(e.point)["diagonal"]))
    assert failure is None and set(seen) == {-8}


# ------------------------------------------------------------------------ coupled parameters: roll

ROLL = explore.load_spec("specs/roll.yaml")
ROLL_TEXT = open("specs/roll.yaml").read()


def test_roll_grid_keeps_only_points_of_equal_lengths():
    assert ROLL.verify.same_length == (("shifts", "dims"),)
    points = {case.point for case in ROLL.cases()}
    assert points == {(("shifts", 3), ("dims", 1)), (("shifts", (1, -2)), ("dims", (0, -1)))}


@pytest.fixture(scope="module")
def roll_examples():
    """60 drawn roll examples, each built (traced) on the way: torch refuses unequal lengths."""
    drawn = []

    @settings(max_examples=60, database=None, derandomize=True, deadline=None)
    @given(explore.examples(ROLL, mesh_max_size=4))
    def draw(example):
        example.case().build()
        drawn.append(example)

    draw()
    return drawn


def test_roll_examples_always_have_equal_lengths(roll_examples):
    points = [dict(example.point) for example in roll_examples]
    assert len(points) == 60
    for point in points:
        assert value_length(point["shifts"]) == value_length(point["dims"]), point
    # every length the input's rank allows, and shifts beyond the grid's
    assert {value_length(point["dims"]) for point in points} == {1, 2, 3}
    assert any(point["shifts"] not in (3, (1, -2)) for point in points)


def test_roll_reproduction_block_keeps_the_constraint(roll_examples):
    block = roll_examples[-1].verify_block()
    assert "  same_length: [shifts, dims]\n" in block
    text = ROLL_TEXT.split("verify:")[0] + block
    narrowed = parse_op_spec(load_yaml_text(text, "repro.yaml"))
    assert narrowed.verify.same_length == (("shifts", "dims"),)
    assert {case.point for case in narrowed.cases()} == {roll_examples[-1].point}   # one point, each target


@pytest.mark.parametrize("old, new, where, message", [
    ("same_length: [shifts, dims]", "same_length: [shifts, dim]", "27: field 'verify.same_length[1]'",
     "same_length names 'dim', which is not a parameter of the spec; parameters: dims, shifts"),
    ("same_length: [shifts, dims]", "same_length: [shifts]", "27: field 'verify.same_length'",
     "a same_length group names at least two parameters"),
    ("same_length: [shifts, dims]", "same_length: [shifts, [dims]]", "27: field 'verify.same_length'",
     "not a mix of names and lists"),
    ("same_length: [shifts, dims]", "same_length: [[shifts, dims], [dims, shifts]]",
     "27: field 'verify.same_length[1][0]'", "'dims' is in two same_length groups"),
    ("shifts: [3, [1, -2]]", "shifts: [3, [1, -2], [1, 2, 3]]", "25: field 'verify.grid.shifts[2]'",
     "grid value [1, 2, 3] of 'shifts' has length 3, but no value of 'dims' has"),
    ("targets: [torch.roll, torch.Tensor.roll]",
     "targets: [torch.roll, {target: torch.Tensor.roll, where: {shifts: 3, dims: [0, -1]}}]",
     "7: field 'targets[1].where'", "takes no grid point: its 'where' values break same_length"),
])
def test_same_length_errors_name_file_line_and_field(old, new, where, message):
    assert old in ROLL_TEXT
    with pytest.raises(SpecError) as caught:
        parse_op_spec(load_yaml_text(ROLL_TEXT.replace(old, new), "specs/roll.yaml"))
    text = str(caught.value)
    assert text.startswith(f"specs/roll.yaml:{where}: "), text
    assert message in text, text


# ------------------------------------------------------------------------ a string's choices

GELU_CHOICES = open("specs/gelu.yaml").read().replace(
    "approximate: {index: 1, keyword: approximate, default: none}",
    "approximate: {index: 1, keyword: approximate, default: none, serves: any, choices: [none, tanh]}").replace(
    "approximate: [none, tanh]", "approximate: [none]")


def test_a_strings_choices_are_drawn_beyond_the_grid():
    spec = parse_op_spec(load_yaml_text(GELU_CHOICES.replace("op: gelu", "op: gelu_choices"), "specs/gelu_choices.yaml"))
    assert dict(spec.verify.grid)["approximate"] == ("none",)
    (draw,) = [d for d in explore.param_draws(spec) if d.key == "approximate"]
    assert set(draw.values) == {"none", "tanh"}
    assert find(draw.strategy(), lambda v: v == "tanh", settings=QUICK) == "tanh"
    with pytest.raises(SpecError, match="goes with 'serves: any'"):
        parse_op_spec(load_yaml_text(GELU_CHOICES.replace(", serves: any", ""), "specs/gelu_choices.yaml"))
