"""A method called with its sizes or dims unpacked (``x.permute(0, 2, 1)``, ``x.view(8, 64)``,
``x.reshape(8, 64)``) is served exactly like the tuple form: the same strategies, and each of
them verified numerically on a traced model, forward and backward. Real models call these
methods unpacked (attention heads in ViT: ``x.view(b, n, h, d).permute(0, 2, 1, 3)``)."""

from __future__ import annotations

import pytest
import torch

from shardverify import DeviceMesh, strategies_for_node, trace
from shardverify.backends import SimulatedBackend
from shardverify.plan import run_plan
from shardverify.plan.verify import make_plan

pytestmark = pytest.mark.slow   # every strategy of each call verified

MESH = DeviceMesh((2, 2))
SHAPE = (8, 4, 16)

CALLS = {
    "permute": (lambda x: x.permute(0, 2, 1), lambda x: x.permute((0, 2, 1))),
    "view": (lambda x: x.view(8, 64), lambda x: x.view((8, 64))),
    "reshape": (lambda x: x.reshape(8, 64), lambda x: x.reshape((8, 64))),
    "view_inferred": (lambda x: x.view(-1, 16), lambda x: x.view((-1, 16))),
    "expand": (lambda x: x.expand(2, 8, 4, 16), lambda x: x.expand((2, 8, 4, 16))),
}


class Call(torch.nn.Module):
    """``fn`` applied between two sized pointwise ops, so the call has a producer and a consumer."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return torch.tanh(self.fn(torch.sin(x)))


def _method_node(model: torch.nn.Module):
    graph_module = trace(model, {"x": torch.empty(SHAPE)})
    (node,) = [n for n in graph_module.graph.nodes if n.op == "call_method"]
    return graph_module, node


@pytest.mark.parametrize("form", sorted(CALLS))
def test_unpacked_call_gets_the_strategies_of_the_tuple_call(form):
    unpacked, packed = CALLS[form]
    names = []
    for fn in (unpacked, packed):
        graph_module, node = _method_node(Call(fn))
        names.append(sorted(s.name for s in strategies_for_node(graph_module, node.name, MESH)))
    assert names[0] == names[1]
    assert any("S" in name for name in names[0]), f"{form}: no sharded strategy offered"


@pytest.mark.parametrize("form", sorted(CALLS))
def test_every_strategy_of_an_unpacked_call_verifies(form):
    model = Call(CALLS[form][0])
    graph_module, node = _method_node(model)
    # plans feed every node full values: the strategies taking a partial-sum input are verified
    # by the op suite, and left out of plans (plan coverage counts them)
    strategies = [s for s in strategies_for_node(graph_module, node.name, MESH) if not s.partial_inputs]
    x = torch.randn(SHAPE)
    backend = SimulatedBackend(MESH)
    try:
        for strategy in strategies:
            plan = make_plan(model, (x,), MESH, {node.name: strategy.name})
            result = run_plan(backend, model, (x,), plan)
            assert result.passed, f"{form}, strategy {strategy.name}: {result.summary()}"
    finally:
        backend.close()
