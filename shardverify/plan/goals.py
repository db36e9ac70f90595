"""What a plan must do besides costing least, as constraints on a problem's options that any
solver reads: the memory limit, and the :class:`~shardverify.plan.model.PlanGoals` (at least so
many sharding options chosen, every shardable weight sharded by one of its takers, data
parallelism's ruled-out options). A goal no choice can meet is refused here, before a solver runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import fx

from shardverify.errors import StrategyError
from shardverify.plan.coverage import shards
from shardverify.plan.graph import operand_producer, parameter_names
from shardverify.plan.model import PlanGoals
from shardverify.plan.problem import PlanProblem

__all__ = ["PlanInfeasible", "AtLeast", "RuledOut", "Requirements", "requirements"]


class PlanInfeasible(StrategyError):
    """No choice of strategies fits the memory limit or meets the plan's goals."""


@dataclass(frozen=True)
class AtLeast:
    """At least ``count`` of ``options`` ((node, option index), ...; one listed twice counts twice) chosen."""

    name: str
    options: tuple[tuple[str, int], ...]
    count: int


@dataclass(frozen=True)
class RuledOut:
    """None of ``node``'s ``options`` (indices) chosen."""

    name: str
    node: str
    options: tuple[int, ...]


@dataclass(frozen=True)
class Requirements:
    memory_limit: int | None = None     # bytes per device, the chosen options' declared memory summed
    at_least: tuple[AtLeast, ...] = ()
    ruled_out: tuple[RuledOut, ...] = ()

    def admit(self, problem: PlanProblem, chosen: Mapping[str, int]) -> bool:
        """Whether ``chosen`` (node -> option index) meets every requirement."""
        if self.memory_limit is not None and problem.memory(chosen) > self.memory_limit:
            return False
        if any(chosen[rule.node] in rule.options for rule in self.ruled_out):
            return False
        return all(sum(chosen[node] == k for node, k in need.options) >= need.count for need in self.at_least)


def _weight_of(node: fx.Node, data, params: dict[str, str]) -> str | None:
    """The parameter an operand is (a module parameter, or a parameter's get_attr node), by the
    name ``named_parameters()`` gives it; None for an activation or a buffer."""
    if data.locator.kind == "param":
        weight = f"{node.target}.{data.locator.key}"
    else:
        producer = operand_producer(node, data.locator)
        weight = str(producer.target) if producer is not None and producer.op == "get_attr" else ""
    return params.get(weight)


def _operand_options(problem: PlanProblem):
    """(node, option index, operand data, its sharding spec) for every input operand of every
    option: what the plan shapes below constrain."""
    by_name = {n.name: n for n in problem.nodes}
    for name, options in problem.choices.items():
        for k, (strategy, _) in enumerate(options):
            for data in strategy.inputs if strategy is not None else ():
                yield by_name[name], k, data, strategy.get_sharding_spec_by_name(data.name)


def _weight_takers(problem: PlanProblem) -> dict[str, list[tuple[str, int]]]:
    """Weight (a parameter's get_attr node, or a module parameter) -> the options that lay it out
    sharded; weights no option shards are left out."""
    params = parameter_names(problem.graph)   # a tied weight is one weight, whichever name reaches it
    takers: dict[str, list[tuple[str, int]]] = {}
    for node, k, data, spec in _operand_options(problem):
        weight = _weight_of(node, data, params)
        if spec.dim_partition and weight is not None:
            takers.setdefault(weight, []).append((node.name, k))
    return takers


def _not_data_parallel(problem: PlanProblem) -> dict[str, list[int]]:
    """Node name -> the options a data-parallel plan rules out: those laying a weight out sharded,
    and, on every node that carries the batch, those whose output does not keep dim 0 split over
    every mesh axis. A node carries the batch when a model input or a node carrying it feeds it
    and one of its strategies keeps the split (a node that cannot, a loss or a fallback, ends the
    batch's path: what follows is the solver's choice)."""
    params = parameter_names(problem.graph)
    every_axis = tuple(range(len(problem.mesh.shape)))

    def splits_batch(strategy) -> bool:
        spec = strategy.get_sharding_spec_by_name(strategy.outputs[0].name)
        return tuple(sorted(dict(spec.dim_partition).get(0, ()))) == every_axis

    ruled_out: dict[str, list[int]] = {}

    def rule_out(name: str, k: int) -> None:
        found = ruled_out.setdefault(name, [])
        if k not in found:
            found.append(k)

    for node, k, data, spec in _operand_options(problem):
        if spec.dim_partition and _weight_of(node, data, params) is not None:
            rule_out(node.name, k)
    for node in problem.nodes:     # a weight held sharded (FSDP) is not data parallelism either
        if node.op == "get_attr":
            for k, (strategy, _) in enumerate(problem.choices[node.name]):
                if strategy is not None and shards(strategy):
                    rule_out(node.name, k)
    carrying: set[str] = set()
    for node in problem.nodes:
        if node.op == "placeholder":
            carrying.add(node.name)
            continue
        options = [(k, strategy) for k, (strategy, _) in enumerate(problem.choices[node.name]) if strategy is not None]
        if not any(n.name in carrying for n in node.all_input_nodes) or \
                not any(splits_batch(strategy) for _, strategy in options):
            continue
        carrying.add(node.name)
        for k, strategy in options:
            if not splits_batch(strategy):
                rule_out(node.name, k)
    return ruled_out


def requirements(problem: PlanProblem, memory_limit: int | None = None, goals: PlanGoals = PlanGoals()) -> Requirements:
    """The constraints ``memory_limit`` and ``goals`` put on ``problem``'s choices; a goal no choice
    meets raises :class:`PlanInfeasible` naming why."""
    mesh = problem.mesh.shape
    at_least: list[AtLeast] = []
    if goals.min_sharded:
        shardable = tuple((name, k) for name, options in problem.choices.items()
                          for k, (strategy, _) in enumerate(options) if shards(strategy))
        available = sum(1 for options in problem.choices.values() if any(shards(s) for s, _ in options))
        if available < goals.min_sharded:
            raise PlanInfeasible(f"min_sharded={goals.min_sharded}, but only {available} node(s) of the model have a "
                                 f"strategy that shards on mesh {mesh}")
        at_least.append(AtLeast("min_sharded", shardable, goals.min_sharded))
    if goals.shard_weights:
        at_least += [AtLeast(f"shard_weight_{index}", tuple(takers), 1)
                     for index, takers in enumerate(_weight_takers(problem).values())]
    ruled: list[RuledOut] = []
    if goals.data_parallel:
        for name, ruled_out in _not_data_parallel(problem).items():
            if len(ruled_out) == len(problem.choices[name]):
                raise PlanInfeasible(f"data_parallel: node {name!r} has no strategy that keeps the batch (dim 0) "
                                     f"split over every mesh axis with its weights replicated on mesh {mesh}")
            ruled.append(RuledOut(f"data_parallel_{name}", name, tuple(ruled_out)))
    return Requirements(memory_limit, tuple(at_least), tuple(ruled))
