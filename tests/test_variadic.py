"""A variadic operand (``elements: all``): every element of a list argument is an operand of one
role, however many the call passes (torch.cat, torch.stack). Each element takes its own layout,
the rule's options naming the role name them all, and a call passing a count of tensors the
grid never held is outside the grid (verified where it is met)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardverify.backends.simulated import SimulatedBackend
from shardverify.errors import HandlerError, SpecError
from shardverify.sharding.mesh import DeviceMesh
from shardverify.spec.case import CallArg, InputDecl, OpCase
from shardverify.spec.loader import load_yaml_text
from shardverify.spec.op import parse_op_spec
from shardverify.strategies.for_node import strategies_for_node
from shardverify.verify.on_demand import OnDemandVerifier
from shardverify.strategies.handlers.base import OperandDecl
from shardverify.strategies.handlers.serving import handler_for_node, outside_grid
from shardverify.verify.engine import verify_case

CAT = (Path(__file__).resolve().parents[1] / "specs" / "cat.yaml").read_text()


def _case(target: str, count: int, shape=(6, 5), dim=1) -> OpCase:
    names = tuple(f"t{k}" for k in range(count))
    return OpCase(op=target.rsplit(".", 1)[-1], target=target, inputs=tuple(InputDecl(n, shape) for n in names),
                  params=(("dim", dim),), positional=(CallArg("list", names),))


@pytest.mark.parametrize("old, new, fragment", [
    ("{kind: input, index: 0, elements: all}", "{kind: input, index: 0, elements: some}", "'elements' takes 'all'"),
    ("{kind: input, index: 0, elements: all}", "{kind: input, index: 0, element: 0, elements: all}", "without 'element'"),
    ("output: {kind: output}", "output: {kind: output, elements: all}", "'elements: all' needs a required input"),
    ("tensors: [2, 3]", "tensors: [2, true]", "how many tensors the call passes"),
])
def test_bad_variadic_declarations_are_one_line_errors(old, new, fragment):
    assert CAT.count(old) == 1
    with pytest.raises(SpecError) as info:
        parse_op_spec(load_yaml_text(CAT.replace(old, new), "specs/cat.yaml"))
    assert fragment in str(info.value) and str(info.value).startswith("specs/cat.yaml:")


def test_the_grid_expands_a_variadic_operand_into_as_many_list_elements_as_its_count():
    spec = parse_op_spec(load_yaml_text(CAT, "specs/cat.yaml"))
    counts = {len(case.inputs) for _, case in spec.op_cases()}
    assert counts == {2, 3}
    case = next(c for i, c in spec.op_cases() if "tensors_3" in i)
    assert case.positional[0] == CallArg("list", ("tensors_0", "tensors_1", "tensors_2"))


def _offered(case: OpCase, mesh_shape):
    """The rule's strategies at a call outside the grid, as generated (before any verification)."""
    graph_module, name = case.build()
    return strategies_for_node(graph_module, name, DeviceMesh(mesh_shape), on_demand=lambda call: call.strategies)


def test_a_cat_of_four_tensors_is_served_element_by_element_and_outside_the_grid_count():
    graph_module, name = _case("torch.cat", 4).build()
    node = next(n for n in graph_module.graph.nodes if n.name == name)
    handler = handler_for_node(node, graph_module)
    assert "passes tensors=4; the rule was verified for tensors in {2, 3}" in outside_grid(handler, node, graph_module)
    with pytest.raises(HandlerError, match="strict grid binding"):
        strategies_for_node(graph_module, name, DeviceMesh((2,)))
    offered = _offered(_case("torch.cat", 4), (2,))
    assert offered[0].name.count(" x ") == 3           # four input layouts
    assert any("+P0" in s.name and s.name.count("+P0") == 4 for s in offered)   # all four a partial sum together
    assert sum("Pmax" in s.name for s in offered) == 4    # a partial max of one tensor at a time


@pytest.mark.parametrize("target, dim", [("torch.cat", -1), ("torch.stack", 1)])
def test_four_tensors_verify_on_an_uneven_mesh(target, dim):
    backend = SimulatedBackend(DeviceMesh((4,)))
    try:
        case = _case(target, 4, (6, 5), dim)
        results = verify_case(backend, case, list(_offered(case, (4,))))
    finally:
        backend.close()
    assert len(results) >= 10 and all(r.passed for r in results), [r.report() for r in results if not r.passed]


def test_a_variadic_operand_is_an_input_with_an_index():
    with pytest.raises(HandlerError, match="variadic"):
        OperandDecl("tensors", "output", variadic=True)


def test_an_empty_block_whose_backward_leaves_an_input_without_gradient_is_not_offered():
    """scaled_dot_product_attention on an empty batch gives its mask no gradient: the rank holding
    it would skip the mask's resharding backward (an all_gather its peers wait in: a tiny T5 of
    batch 2 hung under data_parallel on (2, 2)). Batch 2 over 4 ranks is not offered with a mask;
    over 2 ranks (no empty block) it is."""
    names = ("q", "k", "v", "m")
    shapes = ((2, 2, 4, 8),) * 3 + ((2, 2, 4, 4),)
    case = OpCase(op="sdpa", target="torch.nn.functional.scaled_dot_product_attention",
                  inputs=tuple(InputDecl(n, s, "float64") for n, s in zip(names, shapes)))
    graph_module, name = case.build()
    with OnDemandVerifier(cache_dir=None) as verifier:   # T5's additive float mask: the grid drew a bool one
        batch_over_4 = [s for s in strategies_for_node(graph_module, name, DeviceMesh((4,)), on_demand=verifier)
                        if s.name.startswith("S0R")]
        batch_over_2 = [s for s in strategies_for_node(graph_module, name, DeviceMesh((2,)), on_demand=verifier)
                        if s.name.startswith("S0R")]
    assert not batch_over_4 and batch_over_2
