"""Several plans of one model on one mesh made from one capture, one account of the nodes'
strategies and one cost problem (plan.verify.plans_with_coverage), and the session's plans made
that way (pytest_plugin.made_plans): the same plans as made one by one, each error in its place."""

from __future__ import annotations

import pytest

from shardverify.errors import ShardVerifyError, SpecError
from shardverify.plan import verify as plan_verify
from shardverify.plan.model import PlanGoals
from shardverify.plan.spec import GOALS, build_spec_model
from shardverify.plan.verify import plan_with_coverage, plans_with_coverage
from shardverify.pytest_plugin import made_plans

FACTORY = "shardverify.plan.zoo.linear_chain"
KWARGS = (("d_in", 16), ("d_hidden", 32), ("d_out", 16))
INPUTS = (("x", (8, 16)),)
GIVEN = {"fc1": "RS01 = RR x RS01", "fc2": "RR = RS01 x S01R"}
ASKED = [(None, PlanGoals()), (None, GOALS["data_parallel"]), (None, GOALS["shard_weights"]), (GIVEN, PlanGoals())]


def _chain():
    return build_spec_model(FACTORY, KWARGS, INPUTS)


def _same(made, alone) -> None:
    plan, coverage = made
    want_plan, want_coverage = alone
    assert plan.choices() == want_plan.choices()
    assert plan.cost == want_plan.cost
    assert [n.reshards for n in plan.nodes] == [n.reshards for n in want_plan.nodes]
    assert coverage.lines(show=100) == want_coverage.lines(show=100)


def test_plans_made_together_are_the_plans_made_one_by_one():
    module, inputs = _chain()
    made = plans_with_coverage(module, inputs, (2, 2), ASKED, capture="fx")
    assert len(made) == len(ASKED)
    for found, (plan, goals) in zip(made, ASKED):
        module, inputs = _chain()
        _same(found, plan_with_coverage(module, inputs, (2, 2), plan, goals=goals, capture="fx"))
    # the goals differ: data parallel shards the batch, the solver's own plan need not
    assert made[1][0].choices() != made[2][0].choices()


def test_one_capture_one_derivation_and_one_cost_problem_serve_every_plan(monkeypatch):
    calls = {"capture": 0, "classify": 0, "problem": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(plan_verify, "capture_model", counted("capture", plan_verify.capture_model))
    monkeypatch.setattr(plan_verify, "classify_nodes", counted("classify", plan_verify.classify_nodes))
    monkeypatch.setattr(plan_verify.PlanProblem, "of", counted("problem", plan_verify.PlanProblem.of))
    module, inputs = _chain()
    made = plans_with_coverage(module, inputs, (2, 2), ASKED[:3], capture="fx")   # the three goals
    assert not any(isinstance(found, BaseException) for found in made)
    assert calls == {"capture": 1, "classify": 1, "problem": 1}


def test_a_plan_that_cannot_be_made_is_its_error_and_the_others_are_made():
    module, inputs = _chain()
    made = plans_with_coverage(module, inputs, (2, 2), [(None, PlanGoals()), ({"fc9": "RR = RR x RR"}, PlanGoals())],
                               capture="fx")
    assert not isinstance(made[0], BaseException)
    assert isinstance(made[1], ShardVerifyError) and "fc9" in str(made[1])


@pytest.fixture
def fresh_session(monkeypatch):
    """made_plans with nothing made yet in this process, and a counter of the models it builds."""
    monkeypatch.setattr(made_plans, "_MADE", {})
    built = []
    real = made_plans._make

    def make(*args, **kwargs):
        built.append(args[4])   # the plans asked together
        return real(*args, **kwargs)

    monkeypatch.setattr(made_plans, "_make", make)
    return built


WHERE_BAD = ("specs/plans/chain.yaml", 9, "plans.bad")
BAD = (("fc9", "RR = RR x RR"),)


def _ask(plan, where=None, together=()):
    return made_plans.session_plan(FACTORY, KWARGS, INPUTS, (2, 2), plan, where_plan=where, together=together)


@pytest.mark.parametrize("with_folder", [False, True], ids=["in-process", "session-folder"])
def test_a_session_makes_the_plans_of_a_mesh_together_and_keeps_each(fresh_session, monkeypatch, tmp_path,
                                                                     with_folder):
    if with_folder:
        monkeypatch.setenv(made_plans.PLANS_ENV, str(tmp_path))
    else:
        monkeypatch.delenv(made_plans.PLANS_ENV, raising=False)
    together = ["solver", "data_parallel", BAD]
    solver = _ask("solver", together=together)
    assert fresh_session == [["solver", "data_parallel", BAD]]
    data_parallel = _ask("data_parallel", together=together)   # made with the solver's: nothing built again
    assert fresh_session == [["solver", "data_parallel", BAD]]
    module, inputs = _chain()
    _same(data_parallel, plan_with_coverage(module, inputs, (2, 2), goals=GOALS["data_parallel"], capture="fx"))
    assert _ask("solver", together=together) is solver
    if with_folder:   # the two made are saved for the other workers, the one that failed is not
        assert len(list(tmp_path.glob("*.pickle"))) == 2
    # the plan that failed is made again when asked, alone, and its error names its spec field
    with pytest.raises(SpecError) as raised:
        _ask(BAD, WHERE_BAD, together=together)
    assert fresh_session[-1] == [BAD]
    assert "fc9" in str(raised.value) and "chain.yaml" in str(raised.value)


def test_the_plan_asked_raises_its_own_error_even_when_made_with_others(fresh_session, monkeypatch):
    monkeypatch.delenv(made_plans.PLANS_ENV, raising=False)
    with pytest.raises(SpecError) as raised:
        _ask(BAD, WHERE_BAD, together=["solver", BAD])
    assert fresh_session == [[BAD, "solver"]]
    assert "plans.bad" in str(raised.value) or "chain.yaml:9" in str(raised.value)
    _ask("solver", together=["solver", BAD])   # made with it, though the asked plan failed
    assert fresh_session == [[BAD, "solver"]]
