"""The "model" spec kind: parsing specs/models/*.yaml strictly (errors name file, line and
field), expanding plan grids, and rendering generated tests whose plans equal the parsed ones."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from shardverify.cli.catalogue import KINDS  # noqa: F401 - registers every kind
from shardverify.spec.kinds import get_spec_kind
from shardverify.spec.loader import load_yaml, load_yaml_text
from shardverify.codegen.render import Renderer
from shardverify.features.ddp import DDPOptions
from shardverify.features.ddp.spec import parse_model_spec, render_model_spec
from shardverify.features.ddp.check import dry_run
from shardverify.errors import InvalidArgument, SpecError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "specs" / "models").glob("*.yaml"))

GOOD = """\
name: tiny
model:
  layers:
    - {module: torch.nn.Linear, args: [4, 5]}
    - torch.nn.ReLU
    - {module: torch.nn.Linear, args: [5, 2], kwargs: {bias: false}}
data:
  input: [8, 4]
  target: [8, 2]
loss: {name: mse, reduction: sum}
optimizer: {name: sgd, lr: 0.1, momentum: 0.5}
steps: 2
meshes: [[2], [4]]
plans:
  - {}
  - {accumulate: [2, 3], static_graph: [false, true]}
  - {comm_hook: fp16_compress, tolerance: {rtol: 0.1}}
  - {comm_hook: sum_without_average, expect: differ}
"""


def parse(text: str):
    return parse_model_spec(load_yaml_text(textwrap.dedent(text), "specs/models/tiny.yaml"))


def edit(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new)


def test_good_spec_expands_each_plan_entry_as_a_product():
    spec = parse(GOOD)
    assert spec.name == "tiny" and spec.meshes == ((2,), (4,)) and spec.base.steps == 2
    assert [p.options for p in spec.plans[1:5]] == [
        DDPOptions(accumulate=a, static_graph=s) for a in (2, 3) for s in (False, True)]
    assert spec.plans[0].options == DDPOptions() and spec.plans[-1].expect == "differ"
    fp16 = spec.plan(spec.plans[5])
    assert (fp16.options.comm_hook, fp16.rtol, fp16.atol) == ("fp16_compress", 0.1, None)
    assert spec.base.model.layers[2].kwargs == (("bias", False),)


@pytest.mark.parametrize("old, new, line, field, message", [
    ("  - {}\n", "  - {acumulate: 2}\n", 15, "plans[0].acumulate", "unknown key 'acumulate' (did you mean 'accumulate'?)"),
    ("  - {}\n", "  - {accumulate: 0}\n", 15, "plans[0]", "accumulate must be an int >= 1, got 0"),
    ("  - {}\n", "  - {comm_hook: fp8}\n", 15, "plans[0]", "comm_hook must be one of"),
    ("  - {}\n", "  - {static_graph: yes please}\n", 15, "plans[0].static_graph", "expected a boolean"),
    ("  - {}\n", "  - {expect: maybe}\n", 15, "plans[0].expect", "expected one of equal, differ"),
    ("  - {}\n", "  - {accumulate: 2}\n", 16, "plans[1]", "is already listed at plans[0]"),
    ("torch.nn.ReLU", "torch.nn.Relu", 5, "model.layers[1]", "does not resolve"),
    ("torch.nn.ReLU", "torch.relu", 5, "model.layers[1]", "is not a torch.nn.Module class"),
    ("meshes: [[2], [4]]", "meshes: [[2], [3]]", 13, "meshes[1]", "not divisible by the data-parallel world size 3"),
    ("loss: {name: mse, reduction: sum}", "loss: {name: mae}", 10, "loss.name", "unknown loss 'mae'"),
    ("momentum: 0.5", "momentun: 0.5", 11, "optimizer.momentun", "unknown key 'momentun'"),
    ("momentum: 0.5", "momentum: -1", 11, "optimizer", "Invalid momentum value"),
    ("  target: [8, 2]\n", "", 7, "data", "loss 'mse' needs target_shape"),
])
def test_bad_specs_name_file_line_and_field(old, new, line, field, message):
    with pytest.raises(SpecError) as info:
        parse(edit(old, new))
    error = info.value
    assert (error.file, error.line, error.field) == ("specs/models/tiny.yaml", line, field), str(error)
    assert message in error.reason


@pytest.mark.parametrize("old, new, message", [
    ("input: [8, 4]", "input: [8, 3]", "does not run on the declared data"),
    ("target: [8, 2]", "target: [8]", "mse needs the model output shape (8, 2) to equal the target shape (8,)"),
])
def test_a_model_that_does_not_run_is_found_when_checked_not_when_read(old, new, message):
    """Reading a spec builds no model (it would run the factory); the check's dry run, in the
    calling process before any rank starts, names the model and the problem in one line."""
    spec = parse(edit(old, new))
    with pytest.raises(InvalidArgument) as info:
        dry_run(spec.plan(spec.plans[0]))
    assert "specs/models/tiny.yaml:2: field 'model': model 'tiny" in str(info.value) and message in str(info.value)


def test_reading_a_factory_spec_runs_nothing(tmp_path, monkeypatch):
    """The factory's module is read, not imported: its top-level code (here: writing a file)
    does not run, and its parameters are still checked against the spec's kwargs."""
    marker = tmp_path / "ran"
    (tmp_path / "evil_models.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\n\ndef make(width=4):\n    raise SystemExit('called')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SHARDVERIFY_TRUSTED_TARGETS", "evil_models")   # the user names it: a spec may name it
    text = GOOD.replace(GOOD[GOOD.index("  layers:"):GOOD.index("data:")], "  factory: evil_models:make\n")
    spec = parse(text)
    assert spec.base.model.factory == "evil_models:make" and not marker.exists()
    with pytest.raises(SpecError, match="does not bind"):
        parse(text.replace("factory: evil_models:make\n", "factory: evil_models:make\n  kwargs: {depth: 2}\n"))
    assert not marker.exists()


def test_model_needs_exactly_one_of_layers_and_factory():
    both = edit("model:\n", "model:\n  factory: shardverify.features.ddp.zoo:unused_branch_model\n")
    with pytest.raises(SpecError, match="exactly one of 'layers'"):
        parse(both)
    with pytest.raises(SpecError, match="has no attribute 'nope'"):
        parse(GOOD.replace(GOOD[GOOD.index("  layers:"):GOOD.index("data:")],
                           "  factory: shardverify.features.ddp.zoo:nope\n"))


def test_rendered_test_module_rebuilds_exactly_the_parsed_plans():
    spec = parse(GOOD)
    (path, text), = render_model_spec(spec, Renderer()).items()
    assert path == "generated_tests/test_model_tiny.py"
    namespace: dict = {}
    exec(compile(text, path, "exec"), namespace)  # noqa: S102 - our own generated code
    plans = [param.values[0] for param in namespace["PLANS"]]
    assert plans == [spec.plan(point) for point in spec.plans]
    assert [param.id for param in namespace["PLANS"]] == [point.id for point in spec.plans]
    assert [param.values[0] for param in namespace["MESH_SHAPES"]] == [(2,), (4,)]
    test = namespace["test_model_tiny"]
    assert any(mark.name == "dist" for mark in test.pytestmark)


def test_model_kind_is_registered_for_specs_models():
    kind = get_spec_kind("model")
    assert kind.subdir == "models"
    assert kind.parse(load_yaml(SHIPPED[0])) == parse_model_spec(load_yaml(SHIPPED[0]))   # the feature's parser


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_specs_parse_and_their_generated_tests_are_current(path):
    spec = parse_model_spec(load_yaml(path, display=f"specs/models/{path.name}"))
    assert spec.meshes == ((2,), (4,))
    (out, text), = render_model_spec(spec, Renderer()).items()
    on_disk = (ROOT / out).read_text()
    assert on_disk.endswith(text), f"{out} is stale: run `shardverify generate`"


def test_shipped_specs_cover_the_issue():
    specs = {p.stem: parse_model_spec(load_yaml(p)) for p in SHIPPED}
    options = [(name, point) for name, spec in specs.items() for point in spec.plans]
    assert specs["mlp"].base.loss.name == "sum"
    assert any(point.options.accumulate > 1 for _, point in options)
    assert any(point.options.find_unused_parameters for _, point in options)
    assert any(point.options.comm_hook == "fp16_compress" for _, point in options)
    assert any(point.options.join for _, point in options)
    bn = {(point.options.sync_batchnorm, point.expect) for point in specs["conv_bn"].plans}
    assert {(False, "differ"), (True, "equal")} <= bn
