"""A rank error is actionable: every failing rank is listed and a failure inside the op says
what reached it (each operand's layout, local shard, actions, and the shape it arrived with)."""

from __future__ import annotations

import pytest

from shardverify import DeviceMesh
from shardverify.strategies.for_node import strategies_for_node
from shardverify.backends import SimulatedBackend
from shardverify.errors import RankError, RankTimeout
from shardverify.strategies.generators.common import memory_cost
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.sharding.strategy import CommPattern
from shardverify.spec.case import InputDecl, ModuleDecl, OpCase
from shardverify.verify.engine import _error_mismatches, verify_strategy

LINEAR = OpCase(op="linear", target="torch.nn.Linear", inputs=(InputDecl("input", (4, 16, 32)),),
                module=ModuleDecl("torch.nn.Linear", (32, 16), (("bias", False),)))


@pytest.fixture(scope="module")
def mesh4():
    with SimulatedBackend(DeviceMesh((4,)), timeout=30) as backend:
        yield backend


def input_sharded_on_the_contracted_dim(backend):
    """A strategy whose weight is split on its output dim (the input stays whole) with the
    input's contracted dim claimed sharded too: the local shapes no longer multiply."""
    graph_module, node_name = LINEAR.build()
    base = next(s for s in strategies_for_node(graph_module, node_name, backend.mesh)
                if str(s.get_sharding_spec_by_name("weight")) == "[S0, R]"
                and any(a.pattern is CommPattern.IDENTITY_FWD_ALLREDUCE_BWD for a in s.communication_actions))
    specs = dict(base.sharding_specs)
    name = base.inputs[0].name
    specs[name] = ShardingSpec.from_partition(backend.mesh.shape, specs[name].tensor_shape, {2: (0,)})
    return base.replace(name="contracted dim sharded", sharding_specs=tuple(specs.items()),
                        memory_cost=memory_cost(base.operands, specs)), name


def test_a_failure_inside_the_op_lists_every_rank_with_what_reached_the_op(mesh4):
    broken, name = input_sharded_on_the_contracted_dim(mesh4)
    result = verify_strategy(mesh4, LINEAR, broken)
    errors = [m for m in result.mismatches if m.kind == "error"]
    assert [m.rank for m in errors] == [0, 1, 2, 3]
    report = result.report()
    assert "mat1 and mat2 shapes cannot be multiplied (64x8 and 32x4)" in report
    assert (f"{name}: layout [R, R, S0] of (4, 16, 32) -> local shard (4, 16, 8), then "
            "IDENTITY_FWD_ALLREDUCE_BWD over mesh axes (0,) -> reached the op as (4, 16, 8) float32") in report
    assert "weight: layout [S0, R] of (16, 32) -> local shard (4, 32), no actions" in report
    assert "every rank fails alike" in report
    assert "the same failure as rank 0" in report


def test_every_failure_a_backend_reports_is_listed():
    first, second = RankError(1, "boom"), RankError(3, "bang")
    error = RankError(1, "boom")
    error.failures = (first, second)
    found = _error_mismatches(error, (0, 1, 2, 3))
    assert [(m.rank, "bang" in m.detail) for m in found] == [(1, False), (3, True)]


def test_a_timeout_names_each_waiting_rank():
    found = _error_mismatches(RankTimeout((0, 2), 5.0), (0, 1, 2, 3))
    assert [m.rank for m in found] == [0, 2]
