"""The CBC solver: a plan problem as an integer linear program, solved by CBC through PuLP
(pinned in pyproject.toml; the wheel bundles the CBC binary, so it runs offline).

Why an ILP and not dynamic programming: models are DAGs, not chains (a residual add consumes
two branches, attention feeds q, k, v from one input), and the memory limit couples every node;
an exact DP needs a chain and no global constraint. The formulation is the usual one (as in
Alpa/ColossalAI): a binary ``x[n, k]`` per node and option, summing to 1 per node; for an edge
whose two ends both have a choice, continuous ``y[e, i, j] >= 0`` over the edge's source and
target classes with ``sum_j y = sum of the source class's x`` and ``sum_i y = sum of the target
class's x`` (so ``y`` is 1 exactly on the chosen pair) carries the resharding cost.
"""

from __future__ import annotations

import shutil
import tempfile

import pulp

from shardverify.errors import StrategyError
from shardverify.plan.goals import PlanInfeasible, Requirements
from shardverify.plan.problem import PlanProblem

__all__ = ["CBC"]


class CBC:
    """The default :class:`~shardverify.plan.solver.Solver`: exact, any graph."""

    name = "cbc"

    def solve(self, problem: PlanProblem, needs: Requirements) -> dict[str, int]:
        choices = problem.choices
        program = pulp.LpProblem("shardverify_plan", pulp.LpMinimize)
        x = {name: [pulp.LpVariable(f"x_{i}_{k}", cat="Binary") for k in range(len(options))]
             for i, (name, options) in enumerate(choices.items())}
        objective: list[tuple[pulp.LpVariable, float]] = []   # (variable, declared seconds)
        memory = []
        for name, options in choices.items():
            program += _equal(((var, 1) for var in x[name]), 1), f"one_{name}"
            for var, option in zip(x[name], options):
                own = problem.own_cost(name, option)
                objective.append((var, own.seconds))
                memory.append((var, own.memory))
        for edge in problem.edges:
            if len(edge.sources) == 1 or len(edge.targets) == 1:      # one end's choice decides the cost
                for i, sps in enumerate(edge.sources):
                    for j, scs in enumerate(edge.targets):
                        cost = edge.costs[i][j]
                        if cost:
                            objective += ([(x[edge.consumer][k], cost) for k in scs] if len(edge.sources) == 1 else
                                          [(x[edge.producer][k], cost) for k in sps])
                continue
            y = {(i, j): pulp.LpVariable(f"y_{edge.position}_{edge.slot}_{i}_{j}", lowBound=0)
                 for i in range(len(edge.sources)) for j in range(len(edge.targets))}
            for i, sps in enumerate(edge.sources):   # the row's y sum to the source class's x
                program += _equal([*((y[i, j], 1) for j in range(len(edge.targets))),
                                   *((x[edge.producer][k], -1) for k in sps)], 0)
            for j, scs in enumerate(edge.targets):
                program += _equal([*((y[i, j], 1) for i in range(len(edge.sources))),
                                   *((x[edge.consumer][k], -1) for k in scs)], 0)
            for i in range(len(edge.sources)):
                for j in range(len(edge.targets)):
                    if edge.costs[i][j]:
                        objective.append((y[i, j], edge.costs[i][j]))
        largest = max((abs(cost) for _, cost in objective), default=0.0)
        scale = _LARGEST / largest if largest else 1.0
        program += _expression((var, cost * scale) for var, cost in objective)
        if needs.memory_limit is not None:
            program += pulp.LpConstraint(_expression(memory), pulp.LpConstraintLE, rhs=needs.memory_limit), "memory"
        for need in needs.at_least:
            program += pulp.LpConstraint(_expression((x[name][k], 1) for name, k in need.options),
                                         pulp.LpConstraintGE, rhs=need.count), need.name
        for rule in needs.ruled_out:
            program += _equal(((x[rule.node][k], 1) for k in rule.options), 0), rule.name
        status = _solve(program)
        if pulp.LpStatus[status] != "Optimal":
            if needs.memory_limit is not None:
                raise PlanInfeasible(f"no plan fits the memory limit of {needs.memory_limit / 2 ** 30:.4g} GiB per "
                                     f"device on mesh {problem.mesh.shape} and meets the plan's goals as well (the "
                                     f"solver's status: {pulp.LpStatus[status]})")
            raise StrategyError(f"the plan solver ended with status {pulp.LpStatus[status]}")
        return {name: max(range(len(options)), key=lambda k: x[name][k].value() or 0.0)
                for name, options in choices.items()}


def _expression(terms) -> pulp.LpAffineExpression:
    """The sum of (variable, coefficient) terms, built at once: PuLP's operators copy an expression
    per term (``lpSum(c * v ...)`` was most of the solve's Python time on a zoo model's problem).
    The same terms, in the same order, as the operators give: a variable's coefficients added up, a
    term whose coefficient is 0 left out."""
    summed: dict = {}
    for var, coefficient in terms:
        if coefficient:
            summed[var] = summed.get(var, 0) + coefficient
    return pulp.LpAffineExpression(summed)


def _equal(terms, rhs: float) -> pulp.LpConstraint:
    return pulp.LpConstraint(_expression(terms), pulp.LpConstraintEQ, rhs=rhs)


#: the objective's largest coefficient once scaled. CBC's tolerances are absolute: on the declared
#: seconds of a tiny build (a whole plan about 1e-3 s, options apart by 1e-6 s) it ended at a plan
#: 0.6% dearer than the optimum and called it optimal (zoo:llama on (2,2), heuristics off)
_LARGEST = 1e4
#: CBC's primal heuristics (the feasibility pump, rounding): on these problems the root LP is
#: almost integral and branch and bound closes it in a few nodes, while the heuristics took 80%
#: of the solve (zoo:llama on (2,2): 12.2 CPU-s with them, 1.9 without, the same optimum);
#: they only find plans sooner, so the optimum and its proof are unchanged
_OPTIONS = ["heur off"]


def _solve(program: pulp.LpProblem) -> int:
    """CBC on ``program``, its model and solution files (``*-pulp.mps``, ``*-pulp.sol``) in a
    folder of their own that is removed however the solve ends: PuLP writes them to TMPDIR and
    deletes them only after a solve that returns, so a stop (Ctrl-C, SIGTERM) left them behind."""
    folder = tempfile.mkdtemp(prefix="shardverify-solver-")
    try:
        solver = pulp.PULP_CBC_CMD(msg=0, options=_OPTIONS)
        solver.tmpDir = folder
        return program.solve(solver)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
