"""Solve for the real size, verify on the tiny build (shardverify.plan.real_size): the solver takes
its costs from the model at the size it trains at (captured on fake tensors, nothing allocated),
and the plan it picks is mapped onto the tiny build node by node and verified there; a model whose
structure differs between the sizes is refused naming the node; a strategy whose split differs
between the sizes is left out of the choice, with why. Every zoo model's figures at hidden 4096,
sequence 4096, batch 8 are in docs/real_size.md (`shardverify plan zoo:NAME --cost-size real`)."""

from __future__ import annotations

import sys

import pytest
import torch

from shardverify import DeviceMesh, verify_plan
from shardverify.cli.main import main
from shardverify.plan.capture_model import capture_model
from shardverify.plan.coverage import classify_nodes
from shardverify.plan.real_size import RealSize, StructureMismatch, capture_real, same_structure, solve_real_size
from shardverify.plan.verify import plan_with_coverage
from shardverify.plan.zoo import mlp_block, transformer_block
from shardverify.verify.tolerance import Tolerance

TINY = dict(d_model=32, n_heads=4, d_hidden=64)
REAL = dict(d_model=4096, n_heads=32, d_hidden=16384)


def _real(batch: int = 8, **sizes) -> RealSize:
    kwargs = {**REAL, **sizes}
    return RealSize(lambda: (transformer_block(**kwargs), (torch.zeros(batch, 4096, kwargs["d_model"]),)),
                    f"d_model={kwargs['d_model']}, batch={batch}")


def test_the_real_size_is_captured_without_allocating_it():
    """A 4096-wide block on 8 x 4096 tokens: 200M parameters and a 4 GiB activation, captured on
    fake tensors in a moment, with its real shapes."""
    graph = capture_real(_real())
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in graph.graph.nodes if "tensor_meta" in n.meta
              and hasattr(n.meta["tensor_meta"], "shape")}
    assert shapes["x"] == (8, 4096, 4096)
    assert (16384, 4096) in shapes.values()


def test_the_plan_solved_at_the_real_size_shards_and_verifies_on_the_tiny_build():
    """At width 32 the cheapest plan on (2,) leaves the attention replicated: a collective costs
    more than the compute it saves. Costed at width 4096, the solver shards the attention and the
    MLP (the batch: data parallel); that plan, mapped onto the tiny block, verifies end to end."""
    model, x = transformer_block(**TINY), (torch.randn(8, 16, 32),)
    _, tiny_only = plan_with_coverage(model, x, (2,), capture="export")
    result = verify_plan(model, x, (2,), cost_size=_real())
    assert result.passed, result.summary()
    assert not {"matmul", "matmul_1"} & set(tiny_only.sharded), tiny_only.sharded
    assert result.real_size is not None and result.coverage.sharded
    assert set(result.real_size.sharded) == set(result.coverage.sharded)   # mapped node by node
    assert {"matmul", "matmul_1", "linear_4", "linear_5"} <= set(result.coverage.sharded), result.coverage.sharded
    assert result.real_size.cost.total > 1e3 * result.plan.cost.total     # the costs are the real size's
    assert result.to_json()["real_size"]["label"] == "d_model=4096, batch=8"


def test_a_split_the_tiny_build_cannot_mirror_is_left_out_and_said():
    """The real batch of 8 splits evenly over 2 devices, the tiny build's batch of 3 does not: a
    batch-split strategy verified on the tiny build would check another case than the one
    trained, so the solver may not pick it, and says so."""
    mesh = DeviceMesh((2,))
    tiny = capture_model(transformer_block(**TINY), (torch.randn(3, 16, 32),), "export").graph
    options, _ = classify_nodes(tiny, mesh)
    plan, at_real = solve_real_size(tiny, options, _real(), mesh)
    why = {node: text for node, _, text in at_real.left_out}
    assert "x dim 0 splits evenly at the real size (8 over 2) but unevenly on the tiny build (3 over 2)" in \
        why["layer_norm"], why.get("layer_norm")
    splits_batch = [n.node for n in plan.nodes if n.strategy is not None and
                    any(0 in dict(spec.dim_partition) for _, spec in n.strategy.sharding_specs[-1:])
                    and n.node.startswith("layer_norm")]
    assert not splits_batch
    assert any("left out of the choice" in line for line in at_real.lines())


def test_a_real_size_of_another_structure_is_refused_naming_the_node():
    tiny = capture_model(transformer_block(**TINY), (torch.randn(8, 16, 32),), "export").graph
    other = RealSize(lambda: (mlp_block(4096, 16384), (torch.zeros(8, 4096, 4096),)), "an MLP")
    with pytest.raises(StructureMismatch, match=r"node #\d+ is .* there and .* in the tiny build"):
        same_structure(tiny, capture_real(other), other.label)


def test_the_cli_solves_a_factory_at_its_real_size(capsys):
    code = main(["plan", "shardverify.plan.zoo.transformer_block", "--kwarg", "d_model=32", "--kwarg", "n_heads=4",
                 "--input", "8,16,32", "--mesh", "2", "--cost-kwarg", "d_model=4096", "--cost-kwarg", "n_heads=32",
                 "--cost-input", "8,4096,4096", "--strict"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "costed at the real size (shardverify.plan.zoo.transformer_block at d_model=4096, n_heads=32, " \
           "[8,4096,4096])" in out
    assert out.startswith("PASS: ") and "predicted cost at shardverify.plan.zoo.transformer_block at d_model=4096" \
        in out.splitlines()[2], out


@pytest.mark.parametrize("argv, message", [
    (["shardverify.plan.zoo.mlp_block", "--input", "8,32", "--cost-size", "real"], "--cost-size names a zoo model"),
    (["zoo:llama", "--cost-size", "hidden=big"], "--cost-size expects 'real' or KEY=N"),
    (["zoo:llama", "--cost-size", "width=8"], "unknown size(s) ['width']"),
    (["shardverify.plan.zoo.mlp_block", "--input", "8,32", "--cost-kwarg", "d_in=64"], "needs the inputs at that size"),
    (["shardverify.plan.zoo.mlp_block", "--input", "8,32", "--cost-input", "8,64", "--capture", "fx"],
     "capture with export"),
    (["shardverify.plan.zoo.mlp_block", "--input", "8,32", "--cost-input", "8,64", "--kwarg", "d_in=32",
      "--cost-kwarg", "d_in=64", "--plan", "nope.yaml"], "a given plan is not solved"),
])
def test_cli_real_size_misuse_is_one_line_exit_2(capsys, argv, message, tmp_path):
    if "nope.yaml" in argv:
        (tmp_path / "nope.yaml").write_text("fc1: RR = RR x RR\n")
        argv = [str(tmp_path / "nope.yaml") if a == "nope.yaml" else a for a in argv]
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1, err


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit", "resnet", "swin"])
def test_every_zoo_models_real_size_is_its_tiny_build_at_another_size(name):
    """The zoo's realistic sizes (hidden 4096, 4096 tokens, batch 8) keep the tiny build's graph,
    node for node, so `shardverify plan zoo:NAME --cost-size real` maps its plan (the figures,
    verified, are in docs/real_size.md)."""
    pytest.importorskip("transformers", reason="the HF model zoo needs the models extra")
    from shardverify.plan.hf_zoo import hf_model, real_size

    model, inputs = hf_model(name)
    same_structure(capture_model(model, inputs, "export").graph, capture_real(real_size(name)))


def test_a_zoo_models_sizes_are_checked_before_anything_is_built():
    from shardverify.errors import InvalidArgument
    pytest.importorskip("transformers", reason="the HF model zoo needs the models extra")
    from shardverify.plan.hf_zoo import real_size

    with pytest.raises(InvalidArgument, match=r"unknown size\(s\) \['width'\]"):
        real_size("llama", {"width": 8})
    with pytest.raises(InvalidArgument, match="hidden=100 must be a multiple of 128"):
        real_size("llama", {"hidden": 100})
    with pytest.raises(InvalidArgument, match="declares no real size"):
        real_size("nope")
    # Swin's tiny build pads its patches to whole windows: a real size whose windows tile exactly would
    # be another graph (no crop), refused before the model is built
    with pytest.raises(InvalidArgument, match="56x56 patches, which 7x7 windows tile exactly"):
        real_size("swin", {"seq": 3136}).build()


class _Cast(torch.nn.Module):
    """A cast torch.export records as ``_assert_tensor_metadata`` (dtype only) and ``to``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).to(torch.float32) * 2


def test_a_dtype_assertion_checks_each_shard_without_gathering_it():
    """An export's ``_assert_tensor_metadata`` checking the dtype holds for each rank's shard: the
    batch-split plan runs it on the shard, no all-gather before it (at the real size, one of a whole
    activation before each of Llama's norms), and verifies."""
    result = verify_plan(_Cast(), (torch.randn(8, 8),), (2,), capture="export", data_parallel=True)
    assert result.passed, result.summary()
    asserts = [n for n in result.plan.nodes if n.node.startswith("_assert_tensor_metadata")]
    assert asserts and not [r for n in asserts for r in n.reshards if r.steps]


SPEC = """\
name: block_at_size
model:
  factory: shardverify.plan.zoo.transformer_block
  kwargs: {d_model: 32, n_heads: 4, d_hidden: 64}
inputs: {x: [8, 16, 32]}
mesh: [2]
plans:
  solver: solver
cost_size:
  kwargs: {d_model: 4096, n_heads: 32, d_hidden: 16384}
  inputs: {x: [8, 4096, 4096]}
"""


def test_a_plan_specs_cost_size_solves_its_plans_at_that_size(tmp_path, capsys):
    """`cost_size:` in a plan spec: the generated test's solved plans and `shardverify plan SPEC`
    cost at that size (export capture implied) and verify the mapped plan on the spec's build."""
    from shardverify.plan.spec import build_spec_model, parse_plan_spec, spec_cost_size, spec_plan
    from shardverify.spec.loader import load_yaml

    path = tmp_path / "block_at_size.yaml"
    path.write_text(SPEC)
    spec = parse_plan_spec(load_yaml(str(path)))
    assert spec.capture == "export" and dict(spec.cost_size)["inputs"] == (("x", (8, 4096, 4096)),)
    where = dict(spec.where)["factory"]
    module, inputs = build_spec_model(spec.factory, spec.kwargs, spec.inputs, where=where)
    real = spec_cost_size(spec.factory, spec.kwargs, spec.cost_size, where)
    _, coverage = spec_plan(module, inputs, (2,), "solver", capture=spec.capture, cost_size=real)
    assert {"matmul", "matmul_1"} <= set(coverage.sharded)
    assert main(["plan", str(path)]) == 0
    assert "costed at the real size (shardverify.plan.zoo.transformer_block at d_model=4096" in capsys.readouterr().out


@pytest.mark.parametrize("text, message", [
    ("cost_size: {inputs: {x: [8, 0]}}", "expected a shape of positive integers"),
    ("cost_size: real", "a factory's cost_size is {kwargs"),
    ("cost_size: {kwargs: {d_model: 64}}", "inputs"),
    ("capture: fx\ncost_size: {inputs: {x: [8, 64, 64]}}", "capture export"),
])
def test_a_bad_cost_size_is_named_at_its_line(tmp_path, text, message):
    from shardverify.errors import SpecError
    from shardverify.plan.spec import parse_plan_spec
    from shardverify.spec.loader import load_yaml

    path = tmp_path / "bad.yaml"
    path.write_text(SPEC.split("cost_size:")[0] + text + "\n")
    with pytest.raises(SpecError, match=message):
        parse_plan_spec(load_yaml(str(path)))


def test_a_float32_gradient_is_held_to_the_rounding_of_its_terms():
    """A gradient computed through float32 nodes: an element that cancels to near zero keeps the
    rounding of its terms (2e-7 of the tensor's largest, as the batch-split real-size Llama plan's
    RMSNorm gradients on (2,2)), which the elementwise float32 bound alone calls a mismatch; an
    error the size of the values (a missing reduction) is still one."""
    from shardverify.plan.compare import precisions
    from shardverify.verify.tolerance import SummedTolerance, max_error as mismatch_error

    expected = torch.tensor([5854.7, -4824.7, 1e-3], dtype=torch.float64)
    rounded = expected + torch.tensor([0.0, 0.0, 1.2e-3], dtype=torch.float64)
    tolerance = precisions(capture_model(_Cast(), (torch.randn(4, 8),), "export").graph).backward
    assert isinstance(tolerance, SummedTolerance)
    assert mismatch_error(rounded, expected, tolerance) is None
    assert mismatch_error(rounded, expected, Tolerance(tolerance.rtol, tolerance.atol)) is not None
    assert mismatch_error(expected * 2, expected, tolerance) is not None
    assert mismatch_error(expected + torch.tensor([0.0, 0.0, 0.5], dtype=torch.float64), expected, tolerance)


def test_an_integer_cost_input_needs_no_value_range(tmp_path, monkeypatch, capsys):
    """--cost-input's values are never drawn (the model at that size is captured on fake tensors):
    an id tensor is given by dtype and shape alone, where --input's ids need their range."""
    from shardverify.errors import InvalidArgument
    from shardverify.plan.inputs import parse_input

    assert parse_input("ids=int64[8,512]", "--cost-input", drawn=False).dtype == torch.int64
    with pytest.raises(InvalidArgument, match="needs its value range"):
        parse_input("ids=int64[8,512]")
    (tmp_path / "lookup.py").write_text(
        "import torch\n\n\nclass Lookup(torch.nn.Module):\n"
        "    def __init__(self, vocab, width):\n        super().__init__()\n"
        "        self.emb, self.out = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, width)\n\n"
        "    def forward(self, ids):\n        return self.out(self.emb(ids))\n\n\n"
        "def make(vocab=64, width=16):\n    return Lookup(vocab, width)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))   # the current folder goes on it for the factory
    try:
        code = main(["plan", "lookup.make", "--input", "ids=int64[4,8]:0..64", "--cost-input", "ids=int64[8,512]",
                     "--cost-kwarg", "width=256", "--mesh", "2"])
    finally:
        sys.modules.pop("lookup", None)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "costed at the real size" in out and out.startswith("PASS: ")
