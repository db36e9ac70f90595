"""The solver seam: a new solver is one class of the Solver shape (here a brute-force one for
tiny graphs, written in this module and nowhere else), and a plan solves and verifies with it;
it agrees with CBC on the cheapest cost, goals and memory limit included."""

from __future__ import annotations

import itertools

import pytest

from shardverify.plan import PlanGoals, PlanInfeasible, make_plan, node_options, solve_plan, verify_plan
from shardverify.plan.capture_model import capture_model
from shardverify.plan.goals import Requirements
from shardverify.plan.problem import PlanProblem
from shardverify.plan.spec import build_spec_model
from shardverify.sharding.mesh import DeviceMesh


class Exhaustive:
    """Every combination of options, the cheapest admitted one (ties: the first met). Tiny graphs only."""

    name = "exhaustive"

    def __init__(self) -> None:
        self.tried = 0

    def solve(self, problem: PlanProblem, needs: Requirements) -> dict[str, int]:
        names = list(problem.choices)
        best, best_seconds = None, float("inf")
        for pick in itertools.product(*(range(len(problem.choices[n])) for n in names)):
            chosen = dict(zip(names, pick))
            self.tried += 1
            if needs.admit(problem, chosen):
                seconds = problem.seconds(chosen)
                if seconds < best_seconds:
                    best, best_seconds = chosen, seconds
        if best is None:
            raise PlanInfeasible(f"none of {self.tried} combinations fits the memory limit and goals")
        return best


def _chain():
    return build_spec_model("shardverify.plan.zoo.linear_chain", (("d_in", 16), ("d_hidden", 32), ("d_out", 16)),
                            (("x", (8, 16)),))


def test_a_new_solver_plans_and_verifies():
    module, inputs = _chain()
    solver = Exhaustive()
    result = verify_plan(module, inputs, (2, 2), solver=solver)
    assert result.passed, result.summary()
    assert solver.tried > 100     # it did choose: fc1 and fc2 have many options each
    cbc = make_plan(module, inputs, (2, 2))
    assert result.plan.cost.total == pytest.approx(cbc.cost.total, rel=1e-12)


@pytest.fixture(scope="module")
def chain_problem():
    """The chain's captured graph and its options on (2, 2), classified once for the tests below."""
    module, inputs = _chain()
    graph = capture_model(module, tuple(inputs), "fx").graph
    mesh = DeviceMesh((2, 2))
    return graph, mesh, node_options(graph, mesh)


@pytest.mark.parametrize("goals", [PlanGoals(shard_weights=True), PlanGoals(data_parallel=True),
                                   PlanGoals(min_sharded=2)], ids=["shard_weights", "data_parallel", "min_sharded"])
def test_goals_reach_every_solver(chain_problem, goals):
    graph, mesh, options = chain_problem
    plan = solve_plan(graph, mesh, options=options, goals=goals, solver=Exhaustive())
    assert plan.cost.total == pytest.approx(solve_plan(graph, mesh, options=options, goals=goals).cost.total, rel=1e-12)
    assert plan.cost.total > solve_plan(graph, mesh, options=options).cost.total   # the goal cost something


def test_a_memory_limit_no_plan_fits_is_refused_by_every_solver(chain_problem):
    graph, mesh, options = chain_problem
    for solver in (Exhaustive(), None):
        with pytest.raises(PlanInfeasible, match="memory"):
            solve_plan(graph, mesh, memory_limit=1, options=options, solver=solver)
