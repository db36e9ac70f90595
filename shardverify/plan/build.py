"""A plan put together from one choice per node (the user's plan file, or the solver's
pick): each node's strategy, the reshards its operands need, the costs summed."""

from __future__ import annotations

from collections.abc import Mapping

from torch import fx

from shardverify.errors import StrategyError
from shardverify.sharding.mesh import DeviceMesh
from shardverify.plan.graph import deferrable, edge_targets, element_layout, node_layouts, replicated_choice
from shardverify.plan.device import NOMINAL, DeviceProfile
from shardverify.plan.model import NodePlan, Plan, PlanCost
from shardverify.plan.problem import Option, PlanProblem
from shardverify.plan.workload import Workload
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
               device: DeviceProfile = NOMINAL, where: str = "plan",
               removed: Mapping[str, Mapping[str, str]] | None = None, workload: Workload = Workload()) -> Plan:
    """The plan for ``choice`` (node name -> strategy name). A node with strategies that
    ``choice`` omits takes its fully replicated strategy. ``removed``: node -> (strategy -> its first
    mismatch) of the strategies its rule yields that verification at the call took away, so a plan
    naming one is told why it is gone."""
    problem = PlanProblem.of(graph_module, mesh, options, device, workload=workload)
    options = problem.options
    known = set(options)
    unknown = sorted(set(choice) - known)
    if unknown:
        raise StrategyError(f"{where}: no node named {unknown}; nodes are {sorted(known)}")
    chosen: dict[str, Option] = {}
    for node in graph_module.graph.nodes:
        found = options[node.name]
        if node.name in choice:
            if found is None:
                raise StrategyError(f"{where}: node {node.name!r} has no strategies (it runs replicated); "
                                    f"leave it out of the plan")
            wanted, defer = _parse_choice(choice[node.name], node.name, where)
            names = [s.name for s in found]
            gone = (removed or {}).get(node.name, {})
            if wanted not in names and wanted in gone:
                raise StrategyError(f"{where}: node {node.name!r}: strategy {wanted!r} is one its spec's rule yields, "
                                    f"but it failed when verified at this call ({gone[wanted]}), so it is not "
                                    f"offered; pick one of the strategies that passed: {names}")
            if wanted not in names:
                raise StrategyError(f"{where}: node {node.name!r} has no strategy {wanted!r}; "
                                    f"its strategies are {names}")
            strategy = found[names.index(wanted)]
            if defer and not deferrable(strategy):
                raise StrategyError(f"{where}: node {node.name!r}: strategy {wanted!r} has no AFTER sum "
                                    f"all-reduce of its output to defer")
            chosen[node.name] = Option(strategy, deferrable(strategy) if defer else ())
        elif found is not None:
            chosen[node.name] = Option(replicated_choice(found))
            if chosen[node.name][0] is None:
                raise StrategyError(f"{where}: node {node.name!r} is not in the plan and has no fully "
                                    f"replicated strategy to default to; pick one of {[s.name for s in found]}")
        else:
            chosen[node.name] = Option(None)
    return assemble_plan(problem, chosen)


def assemble_plan(problem: PlanProblem, chosen: Mapping[str, Option]) -> Plan:
    """The plan for ``chosen`` (node name -> option), costed by the problem's cost function: each
    node's reshards from its producers' layouts as chosen (a tuple element's, its producer's)."""
    mesh = problem.mesh
    layouts: dict = {}
    nodes = []
    compute = communication = resharding = 0.0
    memory = weights = 0
    for node in problem.graph.graph.nodes:
        strategy, deferred = chosen[node.name]
        reshards = tuple(problem.reshard(node, operand, producer, layouts[producer.name], target, index)
                         for operand, producer, index, target in edge_targets(node, strategy, mesh))
        element = element_layout(node, layouts)
        layouts[node.name] = element if element is not None else node_layouts(node, strategy, mesh, deferred)
        nodes.append(NodePlan(node.name, strategy, reshards, deferred))
        resharding += problem.runs(node.name) * sum(r.cost for r in reshards)
        own = problem.own_cost(node.name, chosen[node.name])
        compute += own.compute
        communication += own.communication - own.saving
        memory += own.memory
        weights += own.weights
    return Plan(tuple(mesh.shape), tuple(nodes), PlanCost(compute, communication, resharding, memory, weights),
                problem.device, problem.workload)
