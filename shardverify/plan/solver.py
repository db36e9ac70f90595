"""The plan solver: one strategy per node minimising declared compute + communication +
resharding seconds, under an optional per-device memory limit.

It is an integer linear program solved by CBC through PuLP (pinned in pyproject.toml; the
wheel bundles the CBC binary, so it runs offline). Why an ILP and not dynamic programming:
models are DAGs, not chains (a residual add consumes two branches, attention feeds q, k, v
from one input), and the memory limit couples every node; an exact DP needs a chain and no
global constraint. The formulation is the usual one (as in Alpa/ColossalAI): a binary
``x[n, s]`` per node and strategy, summing to 1 per node; for an edge whose two ends both
have a choice, continuous ``y[e, sp, sc] >= 0`` with ``sum_sc y = x[p, sp]`` and
``sum_sp y = x[c, sc]`` (so ``y`` is 1 exactly on the chosen pair) carries the resharding cost.
"""

from __future__ import annotations

from collections.abc import Mapping

import pulp
from torch import fx

from shardverify.errors import StrategyError
from shardverify.sharding.mesh import DeviceMesh
from shardverify.plan.build import assemble_plan
from shardverify.plan.coverage import shards
from shardverify.plan.graph import (deferrable, deferred_saving, edge_targets, make_reshard, node_layouts,
                                    node_options, operand_producer, parameter_names)
from shardverify.plan.model import FLOP_RATE, Plan, PlanGoals
from shardverify.sharding.strategy import ShardingStrategy

__all__ = ["solve_plan", "PlanInfeasible"]


class PlanInfeasible(StrategyError):
    """No choice of strategies fits the memory limit."""


def _own_cost(option, flop_rate: float, mesh: DeviceMesh) -> float:
    strategy, deferred = option
    if strategy is None:
        return 0.0
    saving = deferred_saving(strategy, deferred, mesh) if deferred else 0.0
    return strategy.compute_cost.total / flop_rate + strategy.communication_cost.total - saving


def _variants(strategies, defer: bool) -> list:
    """(strategy, deferred axes) options of a node: each strategy as declared and, with
    ``defer``, also with its output left partial for the resharding to reduce."""
    if not strategies:
        return [(None, ())]
    found = []
    for strategy in strategies:
        found.append((strategy, ()))
        if defer and deferrable(strategy):
            found.append((strategy, deferrable(strategy)))
    return found


def _weight_of(node: fx.Node, data, params: dict[str, str]) -> str | None:
    """The parameter an operand is (a module parameter, or a parameter's get_attr node), by the
    name ``named_parameters()`` gives it; None for an activation or a buffer."""
    if data.locator.kind == "param":
        weight = f"{node.target}.{data.locator.key}"
    else:
        producer = operand_producer(node, data.locator)
        weight = str(producer.target) if producer is not None and producer.op == "get_attr" else ""
    return params.get(weight)


def _operand_options(graph_module: fx.GraphModule, choices: dict, x: dict):
    """(node, option variable, operand data, its sharding spec) for every input operand of every
    option: what the plan shapes below constrain."""
    by_name = {n.name: n for n in graph_module.graph.nodes}
    for name, opts in choices.items():
        for var, (strategy, _) in zip(x[name], opts):
            for data in strategy.inputs if strategy is not None else ():
                yield by_name[name], var, data, strategy.get_sharding_spec_by_name(data.name)


def _weight_takers(graph_module: fx.GraphModule, choices: dict, x: dict) -> dict[str, list]:
    """Weight (a parameter's get_attr node, or a module parameter) -> the option variables that
    lay it out sharded; weights no option shards are left out."""
    params = parameter_names(graph_module)   # a tied weight is one weight, whichever name reaches it
    takers: dict[str, list] = {}
    for node, var, data, spec in _operand_options(graph_module, choices, x):
        weight = _weight_of(node, data, params)
        if spec.dim_partition and weight is not None:
            takers.setdefault(weight, []).append(var)
    return takers


def _not_data_parallel(graph_module: fx.GraphModule, choices: dict, x: dict, mesh: DeviceMesh) -> dict[str, list]:
    """Node name -> the option variables a data-parallel plan rules out: those laying a weight out
    sharded, and, on every node that carries the batch, those whose output does not keep dim 0
    split over every mesh axis. A node carries the batch when a model input or a node carrying
    it feeds it and one of its strategies keeps the split (a node that cannot, a loss or a
    fallback, ends the batch's path: what follows is the solver's choice)."""
    params = parameter_names(graph_module)
    every_axis = tuple(range(len(mesh.shape)))

    def splits_batch(strategy) -> bool:
        spec = strategy.get_sharding_spec_by_name(strategy.outputs[0].name)
        return tuple(sorted(dict(spec.dim_partition).get(0, ()))) == every_axis

    ruled_out: dict[str, list] = {}

    def rule_out(name: str, var) -> None:
        found = ruled_out.setdefault(name, [])
        if not any(var is other for other in found):
            found.append(var)

    for node, var, data, spec in _operand_options(graph_module, choices, x):
        if spec.dim_partition and _weight_of(node, data, params) is not None:
            rule_out(node.name, var)
    carrying: set[str] = set()
    for node in graph_module.graph.nodes:
        if node.op == "placeholder":
            carrying.add(node.name)
            continue
        opts = [(var, strategy) for var, (strategy, _) in zip(x[node.name], choices[node.name]) if strategy is not None]
        if not any(n.name in carrying for n in node.all_input_nodes) or \
                not any(splits_batch(strategy) for _, strategy in opts):
            continue
        carrying.add(node.name)
        for var, strategy in opts:
            if not splits_batch(strategy):
                rule_out(node.name, var)
    return ruled_out


def solve_plan(graph_module: fx.GraphModule, mesh: DeviceMesh, memory_limit: int | None = None,
               flop_rate: float = FLOP_RATE,
               options: Mapping[str, list[ShardingStrategy] | None] | None = None,
               defer_reductions: bool = True, goals: PlanGoals = PlanGoals()) -> Plan:
    """The cheapest plan by declared cost; ``memory_limit`` bounds the summed declared memory
    (bytes per device) of the chosen strategies. With ``defer_reductions`` a strategy's AFTER
    all-reduce may be left to the resharding (a reduce-scatter when the consumer shards).
    ``goals``: what the plan must do besides costing least (:class:`PlanGoals`)."""
    options = node_options(graph_module, mesh) if options is None else options
    nodes = list(graph_module.graph.nodes)
    choices = {n.name: _variants(options[n.name], defer_reductions) for n in nodes}
    problem = pulp.LpProblem("shardverify_plan", pulp.LpMinimize)
    x = {name: [pulp.LpVariable(f"x_{i}_{k}", cat="Binary") for k in range(len(opts))]
         for i, (name, opts) in enumerate(choices.items())}
    objective = []
    memory = []
    for name, opts in choices.items():
        problem += pulp.lpSum(x[name]) == 1, f"one_{name}"
        for var, (strategy, deferred) in zip(x[name], opts):
            objective.append(_own_cost((strategy, deferred), flop_rate, mesh) * var)
            if strategy is not None:
                memory.append(strategy.memory_cost.total.total * var)
    for c_index, node in enumerate(nodes):
        c_opts = choices[node.name]
        # cost[p][(sp, sc)] summed over the operands fed by producer p
        costs: dict[str, dict[tuple[int, int], float]] = {}
        for sc, (strategy, _) in enumerate(c_opts):
            for operand, producer, index, target in edge_targets(node, strategy, mesh):
                for sp, (source_strategy, deferred) in enumerate(choices[producer.name]):
                    source = node_layouts(producer, source_strategy, mesh, deferred)
                    cost = make_reshard(node, operand, producer, source, target, mesh, index).cost
                    table = costs.setdefault(producer.name, {})
                    table[(sp, sc)] = table.get((sp, sc), 0.0) + cost
        for p_index, (producer, table) in enumerate(costs.items()):
            p_opts = choices[producer]
            if len(p_opts) == 1 or len(c_opts) == 1:
                for (sp, sc), cost in table.items():
                    var = x[node.name][sc] if len(p_opts) == 1 else x[producer][sp]
                    objective.append(cost * var)
                continue
            y = {(sp, sc): pulp.LpVariable(f"y_{c_index}_{p_index}_{sp}_{sc}", lowBound=0)
                 for sp in range(len(p_opts)) for sc in range(len(c_opts))}
            for sp in range(len(p_opts)):
                problem += pulp.lpSum(y[sp, sc] for sc in range(len(c_opts))) == x[producer][sp]
            for sc in range(len(c_opts)):
                problem += pulp.lpSum(y[sp, sc] for sp in range(len(p_opts))) == x[node.name][sc]
            objective += [cost * y[key] for key, cost in table.items() if cost]
    problem += pulp.lpSum(objective)
    if memory_limit is not None:
        problem += pulp.lpSum(memory) <= memory_limit, "memory"
    min_sharded = goals.min_sharded
    if min_sharded:
        shardable = [var for name, opts in choices.items() for var, (strategy, _) in zip(x[name], opts)
                     if shards(strategy)]
        available = sum(1 for opts in choices.values() if any(shards(s) for s, _ in opts))
        if available < min_sharded:
            raise PlanInfeasible(f"min_sharded={min_sharded}, but only {available} node(s) of the model have a "
                                 f"strategy that shards on mesh {mesh.shape}")
        problem += pulp.lpSum(shardable) >= min_sharded, "min_sharded"
    if goals.shard_weights:
        for index, takers in enumerate(_weight_takers(graph_module, choices, x).values()):
            problem += pulp.lpSum(takers) >= 1, f"shard_weight_{index}"
    if goals.data_parallel:
        for name, ruled_out in _not_data_parallel(graph_module, choices, x, mesh).items():
            if len(ruled_out) == len(x[name]):
                raise PlanInfeasible(f"data_parallel: node {name!r} has no strategy that keeps the batch (dim 0) "
                                     f"split over every mesh axis with its weights replicated on mesh {mesh.shape}")
            problem += pulp.lpSum(ruled_out) == 0, f"data_parallel_{name}"
    status = problem.solve(pulp.PULP_CBC_CMD(msg=0))
    if pulp.LpStatus[status] != "Optimal":
        if memory_limit is not None:
            raise PlanInfeasible(f"no plan fits the memory limit of {memory_limit} bytes per device on mesh "
                                 f"{mesh.shape} (solver status {pulp.LpStatus[status]})")
        raise StrategyError(f"the plan solver ended with status {pulp.LpStatus[status]}")
    chosen = {}
    for name, opts in choices.items():
        best = max(range(len(opts)), key=lambda k: x[name][k].value() or 0.0)
        chosen[name] = opts[best]
    return assemble_plan(graph_module, mesh, chosen, flop_rate)
