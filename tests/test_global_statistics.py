"""Data that tells global statistics apart (verify/reference.py's position ramp).

An op that depends on a statistic of its whole input (a histogram's range taken from the data, a
norm, a quantile) computes something else on a rank's block. A rule that lets each rank compute it
on its own block is wrong, and the check must show it on every path a strategy is verified by:
the spec's grid, on demand at a call outside the grid, the audit and the explorer. Drawn values
alone separate such blocks only by chance (a histogram of two blocks whose ranges happen to bin
alike sums to the whole's); the ramp gives every block its own range, scale and balance."""

from __future__ import annotations

import importlib
import json
import types
from pathlib import Path

import pytest
import torch
from torch import fx
from torch.fx.passes.shape_prop import ShapeProp

from shardverify.features import explore
from shardverify.backends import SimulatedBackend
from shardverify.cli.main import main
from shardverify.codegen.render import Renderer
from shardverify.sharding.mesh import DeviceMesh
from shardverify.spec.loader import load_yaml_text
from shardverify.spec.op import parse_op_spec
from shardverify.spec.op_kind import HANDLER_DIR, render_op_spec
from shardverify.strategies.for_node import strategies_for_node
from shardverify.strategies.handlers.base import unregister_handler
from shardverify.verify.engine import verify_case
from shardverify.verify.on_demand import OnDemandVerifier
from shardverify.verify.reference import _profile, _random

REPO = Path(__file__).resolve().parents[1]

#: the shipped histc rule (partial counts), planted at the range torch takes from the data
HISTC = (REPO / "specs" / "histc.yaml").read_text().replace(
    "  explore: false   # the grid's range is the rule's condition; the explorer would draw min = max\n", "").replace(
    "    bins: [4]\n    min: [0]\n    max: [3]\n", "    bins: [3]\n    min: [0]\n    max: [0]\n")

#: each rank normalises its own block of the normalised dim
NORMALIZE = """\
op: planted_normalize
description: test-only; every dim passes its shard, the normalised one included
targets: [torch.nn.functional.normalize]
operands:
  input: {kind: input, index: 0, keyword: input}
  output: {kind: output}
params:
  p: {index: 1, keyword: p, default: 2.0}
  dim: {index: 2, keyword: dim, default: 1}
generator:
  family: rules
  options:
    pointwise: true
verify:
  inputs:
    input: {shape: [4, 6]}
  grid:
    dim: [1]
  meshes: [[2], [2, 2]]
"""

#: each rank takes the quantile of its own block, the blocks' quantiles averaged
QUANTILE = """\
op: planted_quantile
description: test-only; a quantile over a sharded dim as the mean of the blocks' quantiles
targets: [torch.quantile]
operands:
  input: {kind: input, index: 0, keyword: input}
  output: {kind: output}
params:
  q: {index: 1, keyword: q, default: 0.5}
  dim: {index: 2, keyword: dim, default: null}
  keepdim: {index: 3, keyword: keepdim, default: false}
generator:
  family: rules
  options:
    reduce_dims_param: dim
    keepdim_param: keepdim
    reduce_op: avg
verify:
  inputs:
    input: {shape: [4, 6]}
  grid:
    q: [0.5]
    dim: [1]
  meshes: [[2], [2, 2]]
"""


def _register(text: str, name: str):
    """The spec parsed, its handler generated and registered as a shipped spec's is."""
    spec = parse_op_spec(load_yaml_text(text, f"specs/{name}.yaml"))
    code = render_op_spec(spec, Renderer())[f"{HANDLER_DIR}/{spec.name}.py"]
    module = types.ModuleType(f"planted_{spec.name}_handler")
    exec(compile(code, f"planted_{spec.name}_handler.py", "exec"), module.__dict__)  # noqa: S102
    return spec


@pytest.fixture
def planted(request):
    """(spec, its text) of the planted rule named by the parameter; the shipped handler of the
    same op, if any, registered again afterwards."""
    text = {"histc": HISTC, "planted_normalize": NORMALIZE, "planted_quantile": QUANTILE}[request.param]
    spec = _register(text, request.param)
    yield spec, text
    unregister_handler(spec.name)
    if request.param == "histc":
        importlib.reload(importlib.import_module("shardverify.strategies.handlers.generated.histc"))


def _sharded(strategy) -> bool:
    return any(spec.dim_partition for _, spec in strategy.sharding_specs)


def _statistic_dim_sharded(spec, strategy) -> bool:
    """Does the strategy cut the dim the op takes its statistic over (histc: any)?"""
    first = strategy.sharding_specs[0][1]
    return _sharded(strategy) if spec.name == "histc" else 1 in first.partition_dict()


ALL = ["histc", "planted_normalize", "planted_quantile"]


def test_the_ramp_gives_every_block_its_own_place():
    ramp = _profile((4, 6))
    assert ramp.shape == (4, 6) and 0 < ramp.min() < ramp.max() < 1
    assert torch.equal(_profile((1, 1)), torch.full((1, 1), 0.5, dtype=torch.float64))
    x = _random((8, 8), torch.float64, torch.Generator().manual_seed(0))
    halves = [x[:4], x[4:], x[:, :4], x[:, 4:]]
    assert halves[0].mean() < halves[1].mean() and halves[2].mean() < halves[3].mean()
    assert halves[0].std() < halves[1].std()
    ids = _random((64,), torch.int64, torch.Generator().manual_seed(0), values=(0, 10))
    assert set(ids.tolist()) == set(range(10))   # ids reach every row wherever they sit
    low = _random((64,), torch.float64, torch.Generator().manual_seed(0), values=(1.0, 3.0))
    assert 1 <= low.min() and low.max() < 3 and low[:32].mean() < low[32:].mean()
    mask = _random((400,), torch.bool, torch.Generator().manual_seed(0))
    assert mask[:200].sum() < mask[200:].sum()


@pytest.mark.parametrize("planted", ALL, indirect=True)
def test_the_grid_fails_every_strategy_that_cuts_the_statistic(planted):
    spec, _ = planted
    for _, case in spec.op_cases():
        for mesh in spec.verify.meshes:
            with SimulatedBackend(DeviceMesh(mesh)) as backend:
                graph_module, node = case.build()
                strategies = strategies_for_node(graph_module, node, backend.mesh)
                results = verify_case(backend, case, strategies)
            cut = [s.name for s in strategies if _statistic_dim_sharded(spec, s)]
            assert cut, (spec.name, mesh)
            verdicts = {r.strategy: r.passed for r in results}
            assert not any(verdicts[name] for name in cut), (mesh, [n for n in cut if verdicts[n]])
            assert all(verdicts[s.name] for s in strategies if not _statistic_dim_sharded(spec, s))


def _captured(fn, shape):
    class Call(torch.nn.Module):
        def forward(self, x):
            return fn(x)

    graph_module = fx.symbolic_trace(Call())
    ShapeProp(graph_module).propagate(torch.randn(shape))
    return graph_module, next(n for n in graph_module.graph.nodes if n.op == "call_function")


CALLS = {"planted_normalize": (lambda x: torch.nn.functional.normalize(x, 1.0, 1), (6, 10)),
         "planted_quantile": (lambda x: torch.quantile(x, 0.25, 1), (8, 12))}


def _served_on_demand(fn, shape, mesh):
    graph_module, node = _captured(fn, shape)
    with OnDemandVerifier(cache_dir=None) as verifier:
        served = strategies_for_node(graph_module, node.name, DeviceMesh(mesh), on_demand=verifier)
        (record,) = verifier.records
    assert record.failed and not record.cached
    return served


@pytest.mark.parametrize("mesh", [(2, 2), (4,)])
def test_on_demand_serves_the_shipped_histogram_whole_where_torch_takes_the_range_from_the_data(mesh):
    """The shipped rule's grid fixes the range; at min = max = 0 (torch takes the range from the
    data) a [5, 5] input over (2, 2) once had every rank's block bin like the whole."""
    served = _served_on_demand(lambda x: torch.histc(x, bins=3, min=0, max=0), (5, 5), mesh)
    assert [s.name for s in served] == ["RR -> R"]


@pytest.mark.parametrize("planted", ["planted_normalize", "planted_quantile"], indirect=True)
@pytest.mark.parametrize("mesh", [(2, 2), (4,)])
def test_on_demand_serves_no_strategy_that_cuts_the_statistic(planted, mesh):
    """A call outside the planted grid (another shape, p or q)."""
    spec, _ = planted
    served = _served_on_demand(*CALLS[spec.name], mesh)
    assert served and not any(_statistic_dim_sharded(spec, s) for s in served), [s.name for s in served]


@pytest.mark.parametrize("planted", ["histc"], indirect=True)
def test_the_audit_finds_the_per_block_histogram_incorrect(planted, tmp_path, capsys):
    _, text = planted
    (tmp_path / "histc.yaml").write_text(text)
    code = main(["audit", str(tmp_path / "histc.yaml"), "--root", str(tmp_path), "--specs-dir", str(tmp_path),
                 "--mesh", "4", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert [f for row in report["rows"] for f in row["incorrect"]]


@pytest.mark.parametrize("planted", ["histc"], indirect=True)
def test_the_explorer_finds_the_per_block_histogram(planted):
    spec, _ = planted
    assert explore.search(spec, examples_count=10, mesh_max_size=2) is not None


def test_a_plan_naming_a_strategy_verification_at_the_call_removed_is_told_why():
    """histc's sharded strategies fail at a call binning over the data's own range; a plan that
    forces one hears that it failed there, with its first mismatch, and which strategies passed."""
    from shardverify import verify_plan
    from shardverify.errors import ShardVerifyError

    class Counts(torch.nn.Module):
        def forward(self, x):
            return torch.histc(x, bins=3, min=0, max=0)

    with pytest.raises(ShardVerifyError, match=r"strategy 'S0R -> R \| P0 sum' is one its spec's rule yields, but it "
                                               r"failed when verified at this call \(rank \d.*pick one of the "
                                               r"strategies that passed: \['RR -> R'\]"):
        verify_plan(Counts(), torch.randn(8, 5), (2,), plan={"histc": "S0R -> R | P0 sum"}, capture="fx")
