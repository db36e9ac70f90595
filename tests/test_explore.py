"""shardverify.features.explore: strategies derived from a spec, the property check, the CLI search.

The central test plants a bug that the spec's grid cannot see: a generator registered under a
test-only family name that forgets to gather a reduced dim when the dim is given as a negative
number. The grid (non-negative dims only) passes; the search finds the bug and shrinks it to
the smallest case, which is then shown minimal by checking that every one-step simpler case
passes.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
from hypothesis import find, given, settings
from hypothesis.errors import NoSuchExample

from shardverify.features import explore
from shardverify.strategies.for_node import strategies_for_node
from shardverify.backends import get_backend
from shardverify.cli.main import main
from shardverify.spec.loader import load_yaml_text
from shardverify.spec.op_kind import HANDLER_DIR, render_op_spec
from shardverify.spec.op import parse_op_spec
from shardverify.codegen.render import Renderer
from shardverify.errors import InvalidArgument
from shardverify.strategies.generators.registry import get_generator, register_generator
from shardverify.strategies.handlers.base import unregister_handler
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.strategies.rules.sources import parse_rule
from shardverify.verify.engine import verify_case
from shardverify.verify.report import assert_passed

PLANTED_FAMILY = "test_only_following_forgets_negative_dims"

PLANTED_SPEC = f"""\
op: planted_nansum
description: test-only; its generator forgets to gather dims given as negative numbers
targets:
  - torch.nansum
operands:
  input: {{kind: input, index: 0, keyword: input}}
  output: {{kind: output}}
params:
  dim: {{index: 1, keyword: dim, default: null}}
  keepdim: {{index: 2, keyword: keepdim, default: false}}
generator:
  family: {PLANTED_FAMILY}
  options: {{follow: input, reduce_dims_param: dim, keepdim_param: keepdim}}
verify:
  predecessor: {{target: torch.nn.Linear, args: [4, 8], kwargs: {{bias: false}}}}
  inputs:
    input: {{shape: [4]}}
  grid:
    dim: [0, [0], null]
    keepdim: [false, true]
  meshes: [[2, 2], [4]]
"""


@register_generator(PLANTED_FAMILY, parse=parse_rule)     # it takes the rules family's options
def forgets_negative_dims(ctx):
    """sum's rules strategies (follow: input), except that a reduced dim named by a negative number keeps
    the predecessor's shard (it is never gathered), so each rank sums only its own slice."""
    strategies = get_generator("rules")(ctx)
    raw = ctx.params.get("dim")
    dims = (raw,) if isinstance(raw, int) else tuple(raw or ())
    inp = ctx.operand("input")
    forgotten = {d % len(inp.shape) for d in dims if d < 0}
    if not forgotten:
        return strategies
    planted = []
    for strategy, pred in zip(strategies, ctx.predecessor_strategies("input")):
        produced = pred.get_sharding_spec_by_name(inp.name).partition_dict()
        kept = {d: axes for d, axes in produced.items() if d in forgotten}
        layout = strategy.get_sharding_spec_by_name(inp.name)
        wrong = ShardingSpec.from_partition(ctx.mesh.shape, inp.shape, {**layout.partition_dict(), **kept})
        planted.append(strategy.replace(sharding_specs=tuple(
            (name, wrong if name == inp.name else spec) for name, spec in strategy.sharding_specs)))
    return planted


@pytest.fixture(scope="module")
def planted_spec():
    """The planted spec, with its handler generated and registered like any shipped spec's."""
    spec = parse_op_spec(load_yaml_text(PLANTED_SPEC, "specs/planted_nansum.yaml"))
    handler_code = render_op_spec(spec, Renderer())[f"{HANDLER_DIR}/{spec.name}.py"]
    module = types.ModuleType("planted_nansum_handler")
    exec(compile(handler_code, "planted_nansum_handler.py", "exec"), module.__dict__)  # noqa: S102
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


def _variant(example: explore.Example, *, point=None, predecessor_args=None, mesh=None):
    """The example with some fields changed (a one-step simplification of it)."""
    verify = example.spec.verify
    changes = {}
    if point is not None:
        changes["grid"] = tuple((key, (value,)) for key, value in point)
    if predecessor_args is not None:
        changes["predecessor"] = dataclasses.replace(verify.predecessor, args=predecessor_args)
    if mesh is not None:
        changes["meshes"] = (mesh,)
    return explore.Example(dataclasses.replace(example.spec, verify=dataclasses.replace(verify, **changes)))


# ------------------------------------------------------------------------ the planted bug

def test_the_planted_bug_passes_the_listed_grid(planted_spec, backends):
    checked = 0
    for _, case in planted_spec.op_cases():
        for mesh in planted_spec.verify.meshes:
            results = verify_case(backends(mesh), case)
            assert_passed(results)
            checked += len(results)
    assert checked >= 6 * 2 * 3  # six grid points on two meshes, several strategies each


@pytest.fixture(scope="module")
def planted_failure(planted_spec, backends):
    """One search for the planted bug (meshes of up to 2 devices keep it quick)."""
    return explore.search(planted_spec, examples_count=60, mesh_max_size=2, backend_factory=backends)


def test_the_search_finds_the_planted_bug_and_shrinks_it_to_a_minimal_case(planted_failure, backends):
    assert planted_failure is not None, "the search missed the bug of every negative reduced dim"
    example = planted_failure.example
    # The one minimal case: the Linear's output (the op's only dim) of size 2, sharded over a
    # 2-device mesh and reduced as dim -1; every other size 1.
    assert example.target == "torch.nansum"
    assert example.shapes == {"input": (1,)}
    assert example.spec.verify.predecessor.args == (1, 2)
    assert example.point == (("dim", -1), ("keepdim", False))
    assert example.mesh_shape == (2,)
    assert "max abs error" in planted_failure.error
    reproduction = planted_failure.reproduction
    assert "dim: [-1]" in reproduction and "shape: [1]" in reproduction and "args: [1, 2]" in reproduction
    assert "shardverify verify planted_nansum --mesh 2" in reproduction
    assert "replay(OpCase(op='planted_nansum'" in reproduction

    # Minimal: every one-step simpler case passes.
    for simpler in (_variant(example, point=(("dim", 0), ("keepdim", False))),   # the same dim, non-negative
                    _variant(example, predecessor_args=(1, 1)),                  # nothing left to shard
                    _variant(example, mesh=(1,))):                               # a single device
        explore.check_example(backends(simpler.mesh_shape), simpler)
    with pytest.raises(AssertionError, match="max abs error"):
        explore.check_example(backends(example.mesh_shape), example)


def test_the_reproductions_reproduce_the_failure(planted_failure, planted_spec, backends):
    reproduction = planted_failure.reproduction
    # The python -c line, run in this process (where the planted handler is registered).
    code = reproduction.split('python -c "', 1)[1].rsplit('"', 1)[0]
    with pytest.raises(AssertionError, match="max abs error"):
        exec(code, {})  # noqa: S102
    # The verify: block, pasted over the spec's own.
    lines = reproduction.splitlines()
    start = lines.index("    verify:")
    block = "\n".join(line[4:] for line in lines[start:] if line.startswith("    "))
    narrowed = parse_op_spec(load_yaml_text(PLANTED_SPEC.split("verify:")[0] + block, "repro.yaml"))
    (_, case), = narrowed.op_cases()
    assert narrowed.verify.meshes == ((2,),)
    with pytest.raises(AssertionError, match="max abs error"):
        assert_passed(verify_case(backends((2,)), case))


def test_cli_explore_prints_the_shrunk_case_and_reproduction(planted_spec, tmp_path, capsys):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "planted_nansum.yaml").write_text(PLANTED_SPEC)
    status = main(["explore", "planted_nansum", "--root", str(tmp_path), "--examples", "60",
                   "--mesh-max-size", "2"])
    out = capsys.readouterr().out
    assert status == 1
    assert "FAILED: planted_nansum" in out
    assert "nansum(input: float32[1], dim=-1, keepdim=False) after Linear(1, 2, bias=False) on mesh (2,)" in out
    assert "Reproduce" in out and "meshes:\n" in out


def test_cli_explore_passes_a_shipped_spec(capsys):
    status = main(["explore", "sum", "--examples", "3", "--mesh-max-size", "2", "--seed", "1"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.startswith("passed: sum: 3 drawn case(s)")


def test_cli_explore_rejects_bad_options(capsys):
    with pytest.raises(SystemExit):
        main(["explore", "sum", "--mesh-max-size", "9"])
    assert "--mesh-max-size '9' is not an integer from 1 to 8" in capsys.readouterr().err
    assert main(["explore", "no_such_op"]) == 2
    assert "no spec named 'no_such_op'" in capsys.readouterr().err


# ------------------------------------------------------------------------ strategies from a spec

def test_sizes_shared_between_places_are_tied(planted_spec):
    groups = explore.size_groups(planted_spec)
    # input [4] after Linear(4, 8): the 4 is the input's dim and the Linear's first argument
    # (one tied size); the 8 varies on its own.
    assert [[(s.place, s.index) for s in g] for g in groups] == [
        [("inputs.input", 0), ("predecessor", 0)], [("predecessor", 1)]]
    sum_groups = explore.size_groups(explore.load_spec("specs/sum.yaml"))
    # sum's input [4, 4, 4, 16] after Linear(16, 32): the three 4s are unrelated sizes.
    assert [len(g) for g in sum_groups] == [1, 1, 1, 2, 1]


def test_linear_weight_bias_and_module_sizes_stay_consistent():
    spec = explore.load_spec("specs/linear.yaml")

    @settings(max_examples=6, derandomize=True, database=None, deadline=None)
    @given(explore.examples(spec, mesh_max_size=4))
    def consistent(example):
        shapes = example.shapes
        k, n = shapes["input"][-1], shapes["other"][0]
        assert shapes["other"] == (n, k) and shapes["bias"] == (n,)
        assert example.spec.verify.module.args == (k, n)
        assert isinstance(dict(example.point)["bias"], bool)
        case = example.case()
        case.build()  # the harness accepts every drawn size

    consistent()


def test_dims_cover_int_tuple_negative_and_all():
    dims = explore.dims_strategy(4, allow_all=True)
    quick = settings(max_examples=200, database=None, derandomize=True)
    assert find(dims, lambda d: True, settings=quick) is None   # the fewest choices
    assert find(explore.dims_strategy(4, allow_all=False), lambda d: True, settings=quick) == 0
    assert find(dims, lambda d: isinstance(d, int) and d < 0, settings=quick) == -4
    assert find(dims, lambda d: isinstance(d, tuple) and len(d) == 2, settings=quick) == (0, 1)


@settings(max_examples=40, derandomize=True, database=None)
@given(explore.dims_strategy(3, allow_all=False))
def test_drawn_dims_are_distinct_and_in_range(dims):
    assert dims is not None  # the spec does not allow "all"
    items = (dims,) if isinstance(dims, int) else dims
    assert all(-3 <= d < 3 for d in items)
    assert len({d % 3 for d in items}) == len(items)


@settings(max_examples=40, derandomize=True, database=None)
@given(explore.mesh_shapes(max_size=4))
def test_drawn_meshes_fit_the_world_size(shape):
    assert 1 <= len(shape) <= 3 and all(size >= 1 for size in shape)
    size = 1
    for axis in shape:
        size *= axis
    assert 2 <= size <= 4


def test_meshes_reach_3d_with_size_1_axes_and_shrink_to_two_devices():
    assert find(explore.mesh_shapes(4), lambda s: len(s) == 3 and 1 in s and max(s) > 1) in {
        (1, 1, 2), (1, 2, 1), (2, 1, 1)}
    assert find(explore.mesh_shapes(4), lambda s: True) == (2,)      # one device shards nothing
    with pytest.raises(InvalidArgument, match="mesh_max_size=9"):
        explore.examples(explore.load_spec("specs/sum.yaml"), mesh_max_size=9)


# ------------------------------------------------------------------------ layouts that fit

def test_a_layout_splitting_a_one_element_dim_or_of_another_shape_is_reported():
    spec = explore.load_spec("specs/sum.yaml")
    example = explore.Example(dataclasses.replace(spec, targets=spec.targets[:1], verify=dataclasses.replace(
        spec.verify, grid=(("dim", (1,)), ("keepdim", (False,))), meshes=((2,),), counts=())))
    graph_module, node = example.case().build()
    mesh = DeviceMesh((2,))
    strategies = list(strategies_for_node(graph_module, node, mesh))
    assert explore.layout_problems(strategies, mesh) == []
    # An uneven layout is a layout (DTensor cuts 3 rows 2 + 1); splitting one row is not, and
    # neither is a layout of another shape than its operand: a stand-in without the model's
    # validation smuggles both in.
    sharded = next(s for s in strategies if s.sharding_specs[0][1].partition_dict().get(0))
    inp = sharded.operands[0]
    for rows, reported in ((3, False), (1, True)):
        spec0 = ShardingSpec.from_partition((2,), (rows,) + inp.shape[1:], {0: (0,)})
        odd = _Unvalidated(sharded.name, (dataclasses.replace(inp, shape=(rows,) + inp.shape[1:], logical_shape=None),)
                           + sharded.operands[1:], {**dict(sharded.sharding_specs), inp.name: spec0})
        problems = explore.layout_problems([odd], mesh)
        assert any(f"dim 0 of size {rows} is split 2 ways over mesh axes (0,)" in p for p in problems) == reported, \
            problems
    odd = _Unvalidated(sharded.name, (dataclasses.replace(inp, shape=(3,) + inp.shape[1:], logical_shape=None),)
                       + sharded.operands[1:], dict(sharded.sharding_specs))
    problems = explore.layout_problems([odd], mesh)
    assert any("is for tensor (4, 4, 4, 32)" in p for p in problems), problems
    assert all(p.startswith(f"strategy {odd.name!r}, operand {inp.name!r}") for p in problems)


@dataclasses.dataclass(frozen=True)
class _Unvalidated:
    """Just what layout_problems reads of a strategy, without the model's validation."""

    name: str
    operands: tuple
    layouts: dict

    def get_sharding_spec_by_name(self, name):
        return self.layouts[name]


# ------------------------------------------------------------------------ profiles

def test_profiles():
    ci, dev = settings.get_profile("ci"), settings.get_profile("dev")
    assert ci.derandomize and ci.deadline is None and ci.database is None
    assert dev.max_examples > ci.max_examples and dev.deadline is None
    assert explore.profile_settings("ci", fraction=0.25).max_examples == max(1, ci.max_examples // 4)
    with pytest.raises(InvalidArgument, match="'nightly'"):
        explore.load_profile("nightly")
    with pytest.raises(InvalidArgument, match="fraction=0"):
        explore.profile_settings("ci", fraction=0)


def test_profile_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(explore.PROFILE_ENV, "dev")
    assert explore.profile_settings().max_examples == settings.get_profile("dev").max_examples
    monkeypatch.setenv(explore.PROFILE_ENV, "bogus")
    with pytest.raises(InvalidArgument, match="'bogus'"):
        explore.profile_settings()


def test_parameters_are_drawn_from_what_the_spec_declares():
    sum_params = dict(explore.param_strategies(explore.load_spec("specs/sum.yaml")))
    assert set(sum_params) == {"dim", "keepdim"}
    quick = settings(max_examples=300, database=None, derandomize=True)
    assert find(sum_params["keepdim"], lambda v: v is True, settings=quick) is True
    assert find(sum_params["dim"], lambda v: isinstance(v, tuple) and any(d < 0 for d in v),
                settings=quick) == (-4,)
    linear_params = dict(explore.param_strategies(explore.load_spec("specs/linear.yaml")))
    assert set(linear_params) == {"bias"}
    assert find(linear_params["bias"], lambda v: v, settings=quick) is True
    # A dims parameter whose grid lists only ints stays an int; a non-dims int parameter only
    # takes its listed values.
    spec = explore.load_spec("specs/sum.yaml")
    spec = dataclasses.replace(spec, verify=dataclasses.replace(spec.verify, grid=(("dim", (1, -1)),)))
    ints_only = dict(explore.param_strategies(spec))["dim"]
    assert find(ints_only, lambda v: v is None, settings=quick) is None  # the default: every dim
    with pytest.raises(NoSuchExample):
        find(ints_only, lambda v: isinstance(v, tuple), settings=quick)
    spec = dataclasses.replace(spec, options=(), verify=dataclasses.replace(spec.verify, grid=(("keepdim", (3, 5)),)))
    listed = dict(explore.param_strategies(spec))["keepdim"]
    with pytest.raises(NoSuchExample):
        find(listed, lambda v: v not in (3, 5), settings=quick)


def test_every_op_spec_renders_a_property_test(planted_spec):
    outputs = render_op_spec(planted_spec, Renderer())
    text = outputs["generated_tests/test_planted_nansum_properties.py"]
    compile(text, "test_planted_nansum_properties.py", "exec")
    assert "explore.load_spec(Path(__file__).resolve().parents[1] / 'specs/planted_nansum.yaml'" in text
    assert "def test_planted_nansum_properties_simulated(sv_backend, example):" in text
    assert "@pytest.mark.dist\n@explore.profile_settings(fraction=0.125" in text
