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
The pairs are taken by class: an edge's cost depends only on the producer's output layout and
the layout the consumer wants, so options alike in those share one ``y`` (the marginals sum the
class's ``x``), which keeps the program exact with a fraction of the variables.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping

import pulp
from torch import fx

from shardverify.errors import StrategyError
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.reshard_plan import Layout
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


def _fed_as_partial(graph_module: fx.GraphModule, options: Mapping[str, list[ShardingStrategy] | None],
                    mesh: DeviceMesh, defer: bool) -> dict[str, list[ShardingStrategy] | None]:
    """The options worth a choice: a strategy taking a partial-sum input only where some producer
    can hand that partial value over as it is (a deferred reduction, :func:`deferrable`). Fed
    from a full value, it zeroes the value on all but one rank and reduces after the op what the
    same layout without the partial input never needed to; left in, such options would multiply
    the program's variables for nothing. Nodes are taken in graph order (producers first)."""
    partial_out: dict[str, set[Layout]] = {}
    kept: dict[str, list[ShardingStrategy] | None] = {}
    for node in graph_module.graph.nodes:
        found = options.get(node.name)
        if not found:
            kept[node.name] = found
            continue

        def fed(strategy: ShardingStrategy) -> bool:
            wanted = {operand: (producer.name, target) for operand, producer, _, target
                      in edge_targets(node, strategy, mesh)}
            return any(p.operand in wanted and wanted[p.operand][1] in partial_out.get(wanted[p.operand][0], ())
                       for p in strategy.partial_inputs)

        chosen = [s for s in found if not s.partial_inputs or fed(s)] or list(found)
        kept[node.name] = chosen
        if defer:
            partial_out[node.name] = {node_layouts(node, s, mesh, deferrable(s)) for s in chosen if deferrable(s)}
    return kept


def _hashable(layout):
    """A node's output layout as a dict key (a tuple-valued node has a list of them)."""
    return tuple(layout) if isinstance(layout, list) else layout


def _classes(keys: list) -> dict:
    """key -> the indices having it, in first-seen order."""
    found: dict = {}
    for index, key in enumerate(keys):
        found.setdefault(key, []).append(index)
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
    options = _fed_as_partial(graph_module, options, mesh, defer_reductions)
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
    layouts = {n.name: [node_layouts(n, strategy, mesh, deferred) for strategy, deferred in choices[n.name]]
               for n in nodes}
    edge_costs: dict[tuple, float] = {}   # (source, target, dtype) -> seconds: many edges share them

    def edge_cost(node: fx.Node, producer: fx.Node, source, wanted: tuple) -> float:
        total = 0.0
        for operand, index, target in wanted:
            picked = source[index] if index is not None and isinstance(source, list) else source
            key = (_hashable(picked), target, getattr(producer.meta.get("tensor_meta"), "dtype", None))
            if key not in edge_costs:    # (make_reshard names an output that is no single tensor)
                edge_costs[key] = make_reshard(node, operand, producer, source, target, mesh, index).cost
            total += edge_costs[key]
        return total

    for c_index, node in enumerate(nodes):
        c_opts = choices[node.name]
        # producer -> what each option of this node wants of its output: ((operand, element, layout), ...)
        wants: dict[str, list[tuple]] = {}
        feeds: dict[str, fx.Node] = {}
        for sc, (strategy, _) in enumerate(c_opts):
            for operand, producer, index, target in edge_targets(node, strategy, mesh):
                feeds[producer.name] = producer
                wanted = wants.setdefault(producer.name, [()] * len(c_opts))
                wanted[sc] += ((operand, index, target),)
        for p_index, (name, wanted) in enumerate(wants.items()):
            # the edge's cost depends only on the producer's output layout and on what the consumer
            # wants of it: options alike on both are one class (exact, and far fewer variables)
            sources = _classes([_hashable(layout) for layout in layouts[name]])
            targets = _classes(wanted)
            if len(sources) == 1 or len(targets) == 1:      # one end's choice decides the cost
                for sps in sources.values():
                    for t_key, scs in targets.items():
                        cost = edge_cost(node, feeds[name], layouts[name][sps[0]], t_key)
                        if cost:
                            objective += ([cost * x[node.name][k] for k in scs] if len(sources) == 1 else
                                          [cost * x[name][k] for k in sps])
                continue
            y = {(i, j): pulp.LpVariable(f"y_{c_index}_{p_index}_{i}_{j}", lowBound=0)
                 for i in range(len(sources)) for j in range(len(targets))}
            for i, sps in enumerate(sources.values()):
                problem += pulp.lpSum(y[i, j] for j in range(len(targets))) == pulp.lpSum(x[name][k] for k in sps)
            for j, scs in enumerate(targets.values()):
                problem += pulp.lpSum(y[i, j] for i in range(len(sources))) == pulp.lpSum(x[node.name][k] for k in scs)
            for i, sps in enumerate(sources.values()):
                for j, t_key in enumerate(targets):
                    cost = edge_cost(node, feeds[name], layouts[name][sps[0]], t_key)
                    if cost:
                        objective.append(cost * y[i, j])
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
    status = _solve(problem)
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


def _solve(problem: pulp.LpProblem) -> int:
    """CBC on ``problem``, its model and solution files (``*-pulp.mps``, ``*-pulp.sol``) in a
    folder of their own that is removed however the solve ends: PuLP writes them to TMPDIR and
    deletes them only after a solve that returns, so a stop (Ctrl-C, SIGTERM) left them behind."""
    folder = tempfile.mkdtemp(prefix="shardverify-solver-")
    try:
        solver = pulp.PULP_CBC_CMD(msg=0)
        solver.tmpDir = folder
        return problem.solve(solver)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
