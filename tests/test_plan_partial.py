"""Partial sums carried between the nodes of a plan: a row-parallel projection's reduction left to
its consumers, residual adds and the loss taking partial-sum inputs, weights taken as partial
sums; the solver choosing such chains; planted mistakes in the carrying caught at the node."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardverify.plan import make_plan, node_options, run_plan, solve_plan, verify_plan
from shardverify.plan.recipe import ModelRecipe, traced
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.reshard_plan import ReshardStep

ADD = "RR+P01 x RR+P01 -> RR | P01 sum"      # both terms partial over both axes, the sum partial too


class TwoBlocks(nn.Module):
    """Two residual MLP blocks and a sum: the shape of a transformer's MLP half."""

    def __init__(self, d: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d, bias=False)
        self.up2, self.down2 = nn.Linear(d, hidden), nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        h = x + self.down(torch.relu(self.up(x)))
        h = h + self.down2(torch.relu(self.up2(h)))
        return h.sum()


# each block: column-parallel up, row-parallel down whose all-reduce is left to the residual add,
# which takes both terms as partial sums and leaves its own reduction to its consumers
CARRIED = {"up": "RS01 = RR x RS01", "relu": "RS01 -> RS01", "down": {"strategy": "RR = RS01 x S01R", "defer": True},
           "add": {"strategy": ADD, "defer": True},
           "up2": "RS01 = RR x RS01", "relu_1": "RS01 -> RS01", "down2": {"strategy": "RR = RS01 x S01R", "defer": True},
           "add_1": {"strategy": ADD, "defer": True}, "sum_1": "[R, R]+P01 -> [] | P01 sum_0"}


def _model():
    torch.manual_seed(0)
    return TwoBlocks(), torch.randn(64, 16)


def test_partial_sums_pass_from_node_to_node(sv_backend):
    model, x = _model()
    result = verify_plan(model, x, (2, 2), CARRIED, backend=sv_backend((2, 2), "simulated"))
    assert result.passed, result.summary()
    plan = result.plan
    steps = {r.producer: r.steps for r in plan.node("add").reshards}
    # the residual stream is full: it is zeroed on all but one rank of each group, no data moves
    assert [s.kind for s in steps["x"]] == ["zero_partial", "zero_partial"]
    assert steps["down"] == ()                                         # handed over as it is
    assert all(not r.steps for r in plan.node("add_1").reshards)     # two partial sums added
    assert all(not r.steps for r in plan.node("sum_1").reshards)     # the loss reduces one number
    (to_up2,) = plan.node("up2").reshards
    assert to_up2.steps == (ReshardStep("all_reduce", (0, 1), (), (64, 16)),)   # a matmul needs it whole
    eager = make_plan(model, (x,), (2, 2), {**CARRIED, "down": "RR = RS01 x S01R", "add": "RR x RR -> RR",
                                             "down2": "RR = RS01 x S01R", "add_1": "RR x RR -> RR",
                                             "sum_1": "[R, R] -> []_0"})
    assert plan.cost.total < eager.cost.total


def test_a_full_value_fed_as_a_partial_sum_is_caught_at_the_node(sv_backend):
    """The residual stream given to the add unzeroed: every rank adds it, four times too much."""
    model, x = _model()
    plan = make_plan(model, (x,), (2, 2), CARRIED)
    reshards = tuple(r.__class__(**{**r.__dict__, "steps": ()}) for r in plan.node("add").reshards)
    result = run_plan(sv_backend((2, 2), "simulated"), model, (x,), plan.replace_node("add", reshards=reshards))
    assert not result.passed
    first = result.first_divergence()
    assert (first.node, first.phase) == ("add", "forward")
    assert ADD in result.summary()


def test_a_reduced_value_taken_as_still_partial_is_caught(sv_backend):
    """The producer reduces after all (its deferral dropped) while the add still takes its output as
    a partial sum: the four ranks' full values are summed again."""
    model, x = _model()
    plan = make_plan(model, (x,), (2, 2), CARRIED)
    result = run_plan(sv_backend((2, 2), "simulated"), model, (x,), plan.replace_node("down", deferred=()))
    assert not result.passed
    assert result.first_divergence().node == "add"


@pytest.mark.dist
@pytest.mark.parametrize("up", ["RR = RS0 x S0R, bias+P0", "RR = RS0 x S0R+P1", "RR = RR+P01 x RR, bias+P01"])
def test_weights_taken_as_partial_sums_on_gloo(sv_backend, up):
    """A module's weight or bias taken as a partial sum: the rank's leaf is the whole weight, zeroed
    on all but one rank of the group for the op; its gradient is the whole gradient on every rank."""
    model, x = _model()
    plan = {"up": up, "down": {"strategy": "RR = RS01 x S01R", "defer": True}, "add": {"strategy": ADD, "defer": True}}
    result = verify_plan(model, x, (2, 2), plan, backend=sv_backend((2, 2), "process"))
    assert result.passed, result.summary()


def _wide():
    torch.manual_seed(0)
    model, x = TwoBlocks(256, 1024), torch.randn(16, 256)
    return model, x, traced(ModelRecipe(model, (x,)))


def test_the_solver_carries_partial_sums_through_the_residual_adds(sv_backend):
    model, x, gm = _wide()
    mesh = DeviceMesh((2, 2))
    options = node_options(gm, mesh)
    plan = solve_plan(gm, mesh, options=options)
    carried = [n.node for n in plan.nodes if n.strategy is not None and n.strategy.partial_inputs]
    assert {"add", "add_1"} <= set(carried), [(n.node, n.strategy_name) for n in plan.nodes]
    full_only = {name: [s for s in found if not s.partial_inputs] if found else found for name, found in options.items()}
    assert plan.cost.total < solve_plan(gm, mesh, options=full_only).cost.total
    result = run_plan(sv_backend((2, 2), "simulated"), model, (x,), plan)
    assert result.passed, result.summary()


def test_without_deferred_reductions_the_solver_offers_no_partial_input():
    """Only a producer's deferred reduction hands a partial sum over as it is; fed from full values,
    a partial input would zero them and reduce after the op, for nothing."""
    _, _, gm = _wide()
    plan = solve_plan(gm, DeviceMesh((2, 2)), defer_reductions=False)
    assert not any(n.strategy is not None and n.strategy.partial_inputs for n in plan.nodes)


def test_partial_max_inputs_are_left_out_of_plans_and_counted():
    """relu is monotone: its partial max and min strategies are verified on their own, but a plan
    carries partial sums only; the coverage says how many it left out."""
    from shardverify.plan.verify import plan_with_coverage

    model, x = _model()
    plan, coverage = plan_with_coverage(model, (x,), (2, 2), CARRIED)
    relu = next(s for s in coverage.statuses if s.node == "relu")
    assert relu.status == "handled" and relu.partial > 0
    assert any(line.startswith("  not considered: ") and "a max or min left unfinished across devices" in line
               for line in coverage.lines())
    options = node_options(traced(ModelRecipe(model, (x,))), DeviceMesh((2, 2)))
    assert all(p.op == "sum" for found in options.values() if found for s in found for p in s.partial_inputs)
    assert any(s.partial_inputs for s in options["add"])
