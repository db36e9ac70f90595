"""Advanced indexing (``x[i0, i1]``, ``aten.index.Tensor``) as a derived rule: the equation from
the call's shapes, the lookup into a sharded indexed dim masked like vocab-parallel embedding (a
dropped mask is caught, naming exactly those strategies), the spec's operand order checked at
load, ``x[:, ids]`` (None first in the index list) served, and a grid point that is no call
excluded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardverify.backends.simulated import SimulatedBackend
from shardverify.errors import InvalidArgument, SpecError
from shardverify.plan.coverage import classify_nodes
from shardverify.plan.recipe import ModelRecipe, traced
from shardverify.sharding.mesh import DeviceMesh
from shardverify.spec.loader import load_yaml_text
from shardverify.spec.op import parse_op_spec
from shardverify.strategies.for_node import strategies_for_node
from shardverify.strategies.rules import derive
from shardverify.strategies.rules.notation import Equation
from shardverify.verify.engine import verify_case

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "specs" / "index_tensor.yaml"


def test_the_index_block_takes_the_indexed_dims_place_and_each_indexed_dim_a_factor_of_its_own():
    eq, whole = derive.advanced_index((8, 6, 4), [(0, (4, 1)), (1, (1, 6))], (4, 6, 4))
    assert eq == Equation(((("x0",), ("x1",), ("d2",)), (("b0",), ()), ((), ("b1",))),
                          ((("b0",), ("b1",), ("d2",)),))
    assert whole == set()
    # GPT-2's mask lookup: an int64 [4, 16] indexed by batch ids [4,1,1,1] and positions [1,1,16,1]
    eq, whole = derive.advanced_index((4, 16), [(0, (4, 1, 1, 1)), (1, (1, 1, 16, 1))], (4, 1, 16, 1))
    assert eq.outputs == ((("b0",), (), ("b2",), ()),) and whole == set()


def test_an_indexed_dim_stays_whole_where_a_mask_would_not_line_up_with_the_output():
    # an index of fewer dims than the block: its mask would not cover the block's leading dims
    _, whole = derive.advanced_index((8, 6), [(0, (6,)), (1, (4, 6))], (4, 6))
    assert whole == {"x0", "x1"}
    # indexed dims apart (x[i, :, j]): torch puts the block in front, where the masks line up
    eq, whole = derive.advanced_index((8, 5, 6), [(0, (3,)), (2, (3,))], (3, 5))
    assert eq.outputs == ((("b0",), ("d1",)),) and whole == set()
    # adjacent dims after a full slice (x[:, i]): the block stays in their place, not in front
    eq, whole = derive.advanced_index((8, 6), [(1, (3,))], (8, 3))
    assert eq.outputs == ((("d0",), ("b0",)),) and whole == {"x1"}


@pytest.mark.parametrize("indices, output, fragment", [
    ([(0, (4,)), (1, (3,))], (4,), "do not broadcast"),
    ([(0, (4,))], (5, 6), "gives \\[4, 6\\], the call's output is \\[5, 6\\]"),
    ([(0, (4,)), (0, (4,))], (4, 6), "distinct dims"),
])
def test_calls_the_derivation_cannot_read_are_named(indices, output, fragment):
    with pytest.raises(InvalidArgument, match=fragment):
        derive.advanced_index((8, 6), indices, output)


def _index_case():
    spec = parse_op_spec(load_yaml_text(SPEC.read_text(), str(SPEC)))
    return next(case for case in spec.op_cases() if case[0].endswith("i1_True"))[1]


def test_a_lookup_into_a_sharded_dim_that_forgets_the_mask_is_caught(monkeypatch):
    from shardverify.collectives import patterns

    case = _index_case()
    mesh = DeviceMesh((2, 2))
    lookups = {s.name for s in strategies_for_node(*case.build(), mesh) if s.index_shards}
    assert any(name.startswith("S0S1R x") for name in lookups)     # both indexed dims sharded at once
    backend = SimulatedBackend(mesh)
    try:
        results = verify_case(backend, case)
        assert results and all(r.passed for r in results)
        # every rank keeps the rows its shifted ids land on, also for ids it does not hold
        monkeypatch.setattr(patterns, "zero_outside_shard", lambda output, outside: output)
        failed = [r for r in verify_case(backend, case) if not r.passed]
    finally:
        backend.close()
    assert {r.strategy for r in failed} == lookups
    assert "output" in failed[0].report() and "rank" in failed[0].report()


def test_the_spec_declares_the_index_list_in_order(tmp_path):
    text = SPEC.read_text()
    swapped = text.replace("i0: {kind: input, index: 1, element: 0, optional: true}",
                           "i0: {kind: input, index: 1, element: 1, optional: true}") \
        .replace("i1: {kind: input, index: 1, element: 1, optional: true}",
                 "i1: {kind: input, index: 1, element: 0, optional: true}")
    with pytest.raises(SpecError, match="advanced_index needs the indexed input first, then the index tensors as "
                                        "elements 0, 1, ...") as info:
        parse_op_spec(load_yaml_text(swapped, "specs/index_tensor.yaml"))
    assert info.value.file == "specs/index_tensor.yaml" and info.value.line is not None


class _Lookups(torch.nn.Module):
    """HF's mask idiom (``mask[batch_ids, positions]``) beside a column lookup ``x[:, ids]``."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(x.shape[0])[:, None]
        return x[rows, ids] + x[:, ids]


def test_a_model_s_lookups_are_served_the_column_lookup_too():
    """``x[:, ids]`` is ``aten.index.Tensor(x, [None, ids])`` (Falcon's and im2col's lookups): the
    grid verifies an index list whose element 0 is None (generated_tests/test_index_tensor.py), as
    it verifies ``x[rows, ids]``."""
    x, ids = torch.randn(4, 8), torch.tensor([[1, 3, 5], [0, 2, 7], [6, 6, 1], [4, 0, 3]])
    graph_module = traced(ModelRecipe(_Lookups(), (x, ids), capture="export"))
    _, statuses = classify_nodes(graph_module, DeviceMesh((2, 2)))
    index = {s.node: s for s in statuses if s.target == "aten.index.Tensor"}
    assert sorted(s.status for s in index.values()) == ["handled", "handled"], statuses
    column = next(n for n in graph_module.graph.nodes if n.name in index and n.args[1][0] is None)
    names = {s.name for s in strategies_for_node(graph_module, column.name, DeviceMesh((2, 2)))}
    # rows pass their shard, the ids' dims theirs; the indexed dim stays whole (the ids' block is not in front)
    assert {"S0R x RR -> S0RR", "RR x S0R -> RS0R", "RR x RR -> RRR"} <= names, names
    assert not any(name.split(" x ")[0].startswith("RS") for name in names), names


def test_a_grid_point_that_is_no_call_is_excluded_and_a_bad_exclusion_is_named():
    spec = parse_op_spec(load_yaml_text(SPEC.read_text(), "specs/index_tensor.yaml"))
    points = {tuple(sorted(case.point)) for case in spec.cases()}
    rest = (("i2", False), ("i3", False))
    assert points == {(("i0", True), ("i1", True)) + rest, (("i0", True), ("i1", False)) + rest,
                      (("i0", False), ("i1", True)) + rest, (("i0", True), ("i1", True), ("i2", True), ("i3", False))}
    assert spec.grid_size() == 4
    bad = SPEC.read_text().replace("- {i0: false, i1: false}", "- {i4: false}")
    with pytest.raises(SpecError, match="'i4' is not a grid key; grid keys: i2, i3, i0, i1") as info:
        parse_op_spec(load_yaml_text(bad, "specs/index_tensor.yaml"))
    assert info.value.field.startswith("verify.exclude")
