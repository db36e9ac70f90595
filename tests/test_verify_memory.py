"""The memory check measures the real local tensors: their element size and whether they
are module state (parameters, buffers), not what the strategy declares about its operands."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardverify import DeviceMesh
from shardverify.strategies.for_node import strategies_for_node
from shardverify.backends import SimulatedBackend
from shardverify.strategies.generators.common import memory_cost
from shardverify.sharding.strategy import OperationDataType
from shardverify.spec.case import InputDecl, ModuleDecl, OpCase
from shardverify.verify.engine import verify_strategy

LINEAR = OpCase(op="linear", target="torch.nn.Linear", inputs=(InputDecl("input", (4, 16)),),
                module=ModuleDecl("torch.nn.Linear", (16, 32), (("bias", False),)))


@pytest.fixture(scope="module")
def mesh2():
    with SimulatedBackend(DeviceMesh((2,)), timeout=30) as backend:
        yield backend


def strategy(backend):
    graph_module, node_name = LINEAR.build()
    return strategies_for_node(graph_module, node_name, backend.mesh)[0]


def lying(base, role: str, **changes):
    """``base`` with one operand's description changed and memory figures recomputed to
    match the lie, so only the real tensors can tell."""
    operands = tuple(dataclasses.replace(d, **changes) if d.role == role else d for d in base.operands)
    specs = dict(base.sharding_specs)
    return base.replace(name=f"{base.name} [{role} {changes}]", operands=operands,
                        memory_cost=memory_cost(operands, specs))


def test_the_honest_strategy_passes(mesh2):
    assert verify_strategy(mesh2, LINEAR, strategy(mesh2)).passed


def test_declaring_float16_on_a_float32_input_is_caught(mesh2):
    base = strategy(mesh2)
    result = verify_strategy(mesh2, LINEAR, lying(base, "input", dtype=torch.float16))
    memory = [m for m in result.mismatches if m.kind == "memory"]
    assert {m.rank for m in memory} == {0, 1}, result.report()
    assert "declared torch.float16 but the tensor is torch.float32" in memory[0].detail
    declared = lying(base, "input", dtype=torch.float16).memory_cost.fwd.activation
    assert declared < base.memory_cost.fwd.activation
    assert f"local shards hold {base.memory_cost.fwd.activation} + " in memory[0].detail


def test_declaring_a_parameter_as_an_activation_is_caught(mesh2):
    result = verify_strategy(mesh2, LINEAR, lying(strategy(mesh2), "other", type=OperationDataType.ARG))
    memory = [m for m in result.mismatches if m.kind == "memory"]
    assert memory and "parameter bytes, local shards hold" in memory[0].detail
