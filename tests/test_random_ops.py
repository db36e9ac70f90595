"""Ops that draw random numbers (shardverify/capture/randomness.py): every call of one runs on one
fixed generator state, the reference in the ranks' dtype, so a layout where every rank makes the
whole result matches the single device and one that splits the drawn tensor fails, naming the
rank. Planted here: the rand_like spec with a pointwise rule (every dim passes its shard), which a
rank drawing its block from the start of the stream cannot meet."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardverify import DeviceMesh
from shardverify.backends.simulated import SimulatedBackend
from shardverify.capture.call import call_op
from shardverify.capture.randomness import draws_random, may_draw
from shardverify.features.audit.combinations import offered_strategies
from shardverify.spec.loader import load_yaml_text
from shardverify.spec.op import parse_op_spec
from shardverify.verify.engine import verify_case

ROOT = Path(__file__).resolve().parents[1]
MESH = DeviceMesh((4,))


def _spec(pointwise: bool):
    path = ROOT / "specs" / "rand_like.yaml"
    text = path.read_text(encoding="utf-8")
    if pointwise:
        assert "    whole_tensors: true" in text
        text = text.replace("    whole_tensors: true", "    pointwise: true")
    return parse_op_spec(load_yaml_text(text, str(path)))


def _checked(spec, target: str):
    case = next(case for _, case in spec.op_cases() if case.target == target)
    graph_module, node_name = case.build()
    node = next(n for n in graph_module.graph.nodes if n.name == node_name)
    _, strategies = offered_strategies(spec, graph_module, node, MESH)
    with SimulatedBackend(MESH) as backend:
        return verify_case(backend, case, strategies)


@pytest.mark.parametrize("target", ["torch.rand_like", "torch.ops.aten.randn_like.default"])
def test_a_rule_that_shards_a_drawn_tensor_fails_and_the_whole_one_passes(target):
    planted = {r.strategy: r for r in _checked(_spec(pointwise=True), target)}
    assert planted["RR -> RR"].passed, planted["RR -> RR"]
    sharded = [r for name, r in planted.items() if name != "RR -> RR"]
    assert sharded and not any(r.passed for r in sharded)
    # each rank draws its block's count of numbers from the start of the stream: not its block
    by_rows = planted["S0R -> S0R"]
    assert len({m.rank for m in by_rows.mismatches}) >= 2, by_rows
    assert all(m.tensor == "output" and m.max_abs_err > 0.01 for m in by_rows.mismatches), by_rows
    shipped = _checked(_spec(pointwise=False), target)
    assert [r.strategy for r in shipped] == ["RR -> RR"] and shipped[0].passed


def test_a_drawing_call_runs_on_the_fixed_state_and_leaves_the_callers_as_it_was():
    class Draw(torch.nn.Module):
        def forward(self, x):
            return torch.bernoulli(x), torch.nn.functional.dropout(x, 0.5), torch.nn.functional.dropout(x, 0.0)

    graph_module = torch.fx.symbolic_trace(Draw())
    nodes = {n.name: n for n in graph_module.graph.nodes if n.op == "call_function"}
    assert may_draw(nodes["bernoulli"], None) and draws_random(nodes["dropout"], graph_module)
    assert not draws_random(nodes["dropout_1"], graph_module)   # p=0 draws nothing that matters
    x = {("arg", 0): torch.full((64,), 0.5)}
    torch.manual_seed(7)
    before = torch.get_rng_state()
    first, second = (call_op(nodes["bernoulli"], None, x) for _ in range(2))
    assert torch.equal(first, second) and 0 < int(first.sum()) < 64
    assert torch.equal(torch.get_rng_state(), before)
