"""A result is compared at the precision the op computes it in: a float64 result computed with a
float32 operand (torch.cov's analytic weights) carries float32 rounding, which float64's tolerance
would call a wrong layout; the comparison takes the least precise input's tolerance instead."""

from __future__ import annotations

import torch

from shardverify import DeviceMesh, trace
from shardverify.backends.simulated import SimulatedBackend
from shardverify.strategies.for_node import strategies_for_node
from shardverify.strategies.handlers.call_values import resolve_operands
from shardverify.strategies.handlers.serving import handler_for_node
from shardverify.verify.engine import verify_case
from shardverify.verify.on_demand import OnDemandVerifier, checkable_case
from shardverify.verify.rank import _computed_in

MESH = DeviceMesh((2, 2))


class WeightedCov(torch.nn.Module):
    def forward(self, x, f, a):
        return torch.cov(x, fweights=f, aweights=a)


def test_a_float64_result_with_a_float32_operand_is_compared_at_float32s_tolerance(tmp_path):
    graph_module = trace(WeightedCov(), {"x": torch.randn(3, 2, dtype=torch.float64),
                                         "f": torch.tensor([1, 2], dtype=torch.int32), "a": torch.rand(2)})
    node = next(n for n in graph_module.graph.nodes if n.op == "call_function")
    handler = handler_for_node(node, graph_module)
    with OnDemandVerifier(cache_dir=tmp_path) as verifier:
        served = strategies_for_node(graph_module, node.name, MESH, on_demand=verifier)
    case = checkable_case(handler, graph_module, node, resolve_operands(handler, node, graph_module))
    with SimulatedBackend(MESH) as backend:
        results = verify_case(backend, case, served)
    assert results and all(r.passed for r in results), results


def test_the_precision_is_the_least_precise_floating_input():
    assert _computed_in(torch.float64, torch.float32) is torch.float32
    assert _computed_in(torch.float32, torch.float64) is torch.float32
    assert _computed_in(torch.float64, None) is torch.float64
    assert _computed_in(torch.complex128, torch.float32) is torch.complex128   # complex: its own
