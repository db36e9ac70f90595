"""A plan put together from one choice per node (the user's plan file, or the solver's
pick): each node's strategy, the reshards its operands need, the costs summed."""

from __future__ import annotations

from collections.abc import Mapping

from torch import fx

from shardverify.errors import StrategyError
from shardverify.sharding.mesh import DeviceMesh
from shardverify.plan.graph import (deferrable, deferred_saving, edge_targets, element_layout, make_reshard,
                                    node_layouts, node_options, replicated_choice)
from shardverify.plan.model import FLOP_RATE, NodePlan, Plan, PlanCost
from shardverify.sharding.strategy import ShardingStrategy

__all__ = ["build_plan", "assemble_plan"]


def _parse_choice(value, node: str, where: str) -> tuple[str, bool]:
    """A plan entry: a strategy name, or ``{strategy: NAME, defer: true}`` to leave the
    strategy's AFTER all-reduce to the resharding that follows."""
    if isinstance(value, str):
        return value, False
    if isinstance(value, Mapping) and set(value) <= {"strategy", "defer"} and isinstance(value.get("strategy"), str):
        return value["strategy"], bool(value.get("defer", False))
    raise StrategyError(f"{where}: node {node!r}: expected a strategy name or {{strategy: NAME, defer: BOOL}}, "
                        f"got {value!r}")


def build_plan(graph_module: fx.GraphModule, mesh: DeviceMesh, choice: Mapping[str, object],
               options: Mapping[str, list[ShardingStrategy] | None] | None = None,
               flop_rate: float = FLOP_RATE, where: str = "plan") -> Plan:
    """The plan for ``choice`` (node name -> strategy name). A node with strategies that
    ``choice`` omits takes its fully replicated strategy."""
    options = node_options(graph_module, mesh) if options is None else options
    known = set(options)
    unknown = sorted(set(choice) - known)
    if unknown:
        raise StrategyError(f"{where}: no node named {unknown}; nodes are {sorted(known)}")
    chosen: dict[str, ShardingStrategy | None] = {}
    for node in graph_module.graph.nodes:
        found = options[node.name]
        if node.name in choice:
            if found is None:
                raise StrategyError(f"{where}: node {node.name!r} has no strategies (it runs replicated); "
                                    f"leave it out of the plan")
            wanted, defer = _parse_choice(choice[node.name], node.name, where)
            names = [s.name for s in found]
            if wanted not in names:
                raise StrategyError(f"{where}: node {node.name!r} has no strategy {wanted!r}; "
                                    f"its strategies are {names}")
            strategy = found[names.index(wanted)]
            if defer and not deferrable(strategy):
                raise StrategyError(f"{where}: node {node.name!r}: strategy {wanted!r} has no AFTER sum "
                                    f"all-reduce of its output to defer")
            chosen[node.name] = (strategy, deferrable(strategy) if defer else ())
        elif found is not None:
            chosen[node.name] = (replicated_choice(found), ())
            if chosen[node.name][0] is None:
                raise StrategyError(f"{where}: node {node.name!r} is not in the plan and has no fully "
                                    f"replicated strategy to default to; pick one of {[s.name for s in found]}")
        else:
            chosen[node.name] = (None, ())
    return assemble_plan(graph_module, mesh, chosen, flop_rate)


def assemble_plan(graph_module: fx.GraphModule, mesh: DeviceMesh,
                  chosen: Mapping[str, tuple[ShardingStrategy | None, tuple[int, ...]]],
                  flop_rate: float = FLOP_RATE) -> Plan:
    """The plan for ``chosen``: node name -> (strategy or None, deferred all-reduce axes)."""
    layouts = {}
    nodes = []
    compute = communication = resharding = 0.0
    memory = 0
    for node in graph_module.graph.nodes:
        strategy, deferred = chosen[node.name]
        reshards = tuple(make_reshard(node, operand, producer, layouts[producer.name], target, mesh, index)
                         for operand, producer, index, target in edge_targets(node, strategy, mesh))
        element = element_layout(node, layouts)
        layouts[node.name] = element if element is not None else node_layouts(node, strategy, mesh, deferred)
        nodes.append(NodePlan(node.name, strategy, reshards, deferred))
        resharding += sum(r.cost for r in reshards)
        if strategy is not None:
            compute += strategy.compute_cost.total / flop_rate
            communication += strategy.communication_cost.total
            if deferred:
                communication -= deferred_saving(strategy, deferred, mesh)
            memory += strategy.memory_cost.total.total
    return Plan(tuple(mesh.shape), tuple(nodes), PlanCost(compute, communication, resharding, memory), flop_rate)
