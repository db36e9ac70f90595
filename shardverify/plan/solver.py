"""The plan solver's seam: a :class:`Solver` picks one option per node of a
:class:`~shardverify.plan.problem.PlanProblem` under its
:class:`~shardverify.plan.goals.Requirements`, minimising the problem's declared seconds
(compute + communication + resharding); :func:`solve_plan` poses the problem, asks the solver and
assembles the plan from its pick. CBC (:mod:`shardverify.plan.cbc`) is the default; a new solver
is one module with a class of this shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from torch import fx

from shardverify.errors import StrategyError
from shardverify.plan.build import assemble_plan
from shardverify.plan.cbc import CBC
from shardverify.plan.goals import PlanInfeasible, Requirements, requirements
from shardverify.plan.device import NOMINAL, DeviceProfile
from shardverify.plan.model import Plan, PlanGoals
from shardverify.plan.workload import Workload
from shardverify.plan.problem import PlanProblem
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.strategy import ShardingStrategy

__all__ = ["Solver", "solve_plan", "solve_problem", "PlanInfeasible", "DEFAULT_SOLVER"]


class Solver(Protocol):
    """Picks one option per node: ``solve`` returns node name -> option index (into
    ``problem.choices[node]``) for every node, the cheapest by ``problem.seconds`` it finds among
    those ``needs.admit``; it raises :class:`PlanInfeasible` when none is admitted."""

    name: str

    def solve(self, problem: PlanProblem, needs: Requirements) -> Mapping[str, int]: ...


DEFAULT_SOLVER: Solver = CBC()


def solve_problem(problem: PlanProblem, memory_limit: int | None = None, goals: PlanGoals = PlanGoals(),
                  solver: Solver | None = None) -> Plan:
    """``solver``'s plan (CBC's when None) for ``problem`` under ``memory_limit`` and ``goals``."""
    solver = DEFAULT_SOLVER if solver is None else solver
    needs = requirements(problem, memory_limit, goals)
    ruled_out: dict[str, set[int]] = {}
    for rule in needs.ruled_out:
        ruled_out.setdefault(rule.node, set()).update(rule.options)
    if memory_limit is not None and (least := problem.least_memory(ruled_out)).memory > memory_limit:
        admitted = " the goals admit" if ruled_out else ""
        raise PlanInfeasible(f"no plan fits the memory limit of {memory_limit / 2 ** 30:.4g} GiB per device on mesh "
                             f"{problem.mesh.shape}: the least any choice of layouts{admitted} holds is "
                             f"{least.memory / 2 ** 30:.4g} GiB ({least.weights / 2 ** 30:.4g} GiB of it weights with "
                             f"their gradients and optimizer state, every weight held as split as "
                             f"{'the goals let it' if ruled_out else 'it divides'}) "
                             f"for {problem.workload.label}; more devices, --recompute, a smaller batch or "
                             f"less optimizer state would lower it")
    picked = solver.solve(problem, needs)
    missing = [name for name in problem.choices if name not in picked]
    if missing:
        raise StrategyError(f"solver {solver.name!r} chose no option for node(s) {missing[:5]}")
    return assemble_plan(problem, {name: problem.choices[name][picked[name]] for name in problem.choices})


def solve_plan(graph_module: fx.GraphModule, mesh: DeviceMesh, memory_limit: int | None = None,
               device: DeviceProfile = NOMINAL,
               options: Mapping[str, list[ShardingStrategy] | None] | None = None,
               defer_reductions: bool = True, goals: PlanGoals = PlanGoals(), solver: Solver | None = None,
               workload: Workload = Workload()) -> Plan:
    """The cheapest plan by declared cost; ``memory_limit`` bounds the summed declared memory
    (bytes per device) of the chosen strategies. With ``defer_reductions`` a strategy's AFTER
    all-reduce may be left to the resharding (a reduce-scatter when the consumer shards).
    ``goals``: what the plan must do besides costing least (:class:`PlanGoals`)."""
    problem = PlanProblem.of(graph_module, mesh, options, device, defer_reductions, workload)
    return solve_problem(problem, memory_limit, goals, solver)
