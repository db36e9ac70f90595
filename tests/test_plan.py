"""Whole-model plans: solver, user plans, planted mistakes that must be caught and named."""

from __future__ import annotations

import itertools
import json
import re
import threading

import pytest
import torch
from torch import nn

from shardverify.cli.main import main
from shardverify.sharding.mesh import DeviceMesh
from shardverify.plan import PlanInfeasible, build_plan, make_plan, node_options, run_plan, solve_plan, verify_plan
from shardverify.plan.recipe import ModelRecipe, traced
from shardverify.plan.spec import build_spec_model
from shardverify.sharding.reshard_plan import ReshardStep
from shardverify.sharding.strategy import CommPattern


def _chain(d_in=16, d_hidden=32):
    return build_spec_model("shardverify.plan.zoo.linear_chain", (("d_in", d_in), ("d_hidden", d_hidden),
                                                                   ("d_out", d_in)), (("x", (8, d_in)),))


def test_wrong_gather_axis_is_named(sv_backend):
    module, inputs = _chain()
    plan = make_plan(module, inputs, (2, 2), {"fc1": "RS0 = RR x RS0", "fc2": "RR = RR x RR"})
    (reshard,) = plan.node("fc2").reshards
    assert reshard.steps == (ReshardStep("all_gather", (0,), (1,)),)
    assert run_plan(sv_backend((2, 2), "simulated"), module, inputs, plan).passed
    wrong = reshard.__class__(**{**reshard.__dict__, "steps": (ReshardStep("all_gather", (1,), (1,)),)})
    result = run_plan(sv_backend((2, 2), "simulated"), module, inputs, plan.replace_node("fc2", reshards=(wrong,)))
    assert not result.passed
    first = result.first_divergence()
    assert (first.node, first.phase) == ("fc2", "forward")
    assert "all_gather(axes=(1,), dim=1)" in result.summary() and "RR = RR x RR" in result.summary()


def test_partial_output_never_reduced_is_named(sv_backend):
    module, inputs = _chain()
    plan = make_plan(module, inputs, (2, 2), {"fc1": "RS01 = RR x RS01", "fc2": "RR = RS01 x S01R"})
    strategy = plan.node("fc2").strategy
    kept = tuple(a for a in strategy.communication_actions if a.pattern is not CommPattern.ALLREDUCE_FWD_IDENTITY_BWD)
    assert len(kept) < len(strategy.communication_actions)
    broken = plan.replace_node("fc2", strategy=strategy.replace(communication_actions=kept))
    result = run_plan(sv_backend((2, 2), "simulated"), module, inputs, broken)
    assert not result.passed and result.first_divergence().node == "fc2"
    assert "RR = RS01 x S01R" in result.summary()


def test_solver_finds_the_cheapest_plan_by_brute_force():
    module, inputs = _chain(64, 256)
    mesh = DeviceMesh((4,))
    gm = traced(ModelRecipe(module, inputs))
    options = node_options(gm, mesh)
    solved = solve_plan(gm, mesh, options=options)
    best = min(build_plan(gm, mesh, {"fc1": a.name, "fc2": b.name}, options).cost.total
               for a, b in itertools.product(options["fc1"], options["fc2"]))
    assert solved.cost.total == pytest.approx(best)


def test_solver_respects_the_memory_limit():
    module, inputs = _chain(64, 256)
    free = make_plan(module, inputs, (2, 2))
    replicated = make_plan(module, inputs, (2, 2), {})
    limit = min(free.cost.memory, replicated.cost.memory) - 1
    tight = make_plan(module, inputs, (2, 2), memory_limit=limit)
    assert tight.cost.memory <= limit
    with pytest.raises(PlanInfeasible, match="memory limit"):
        make_plan(module, inputs, (2, 2), memory_limit=1000)


class ResidualMLP(nn.Module):
    """A model no spec ships: a residual add and a ReLU (no handlers: they run replicated)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def test_user_module_under_the_solver_and_a_user_plan(sv_backend):
    model, x = ResidualMLP(), torch.randn(8, 16)
    assert verify_plan(model, x, (2, 2), backend=sv_backend((2, 2), "simulated")).passed
    result = verify_plan(model, x, (2, 2), {"up": "S01R = S01R x RR_0", "down": "S0S1 = S0R x RS1_0"},
                         backend=sv_backend((2, 2), "simulated"))
    assert result.passed, result.summary()


def test_unknown_strategy_names_the_node():
    model, x = ResidualMLP(), torch.randn(8, 16)
    with pytest.raises(Exception, match="node 'up' has no strategy 'nope'"):
        make_plan(model, (x,), (2, 2), {"up": "nope"})


def test_cli_plan_factory_json_and_exit_status(tmp_path, capsys):
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text('fc1: "RS0 = RR x RS0"\nfc2: "RR = RS0 x S0R"\n')
    assert main(["plan", "shardverify.plan.zoo.linear_chain", "--input", "8,32", "--mesh", "4",
                 "--plan", str(plan_file), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True
    # where the CPU time went, phase by phase (the given plan is built, not solved: still a phase)
    seconds = report["cpu_seconds"]
    assert list(seconds) == ["start", "build", "capture", "strategies", "solve", "check", "total"], seconds
    assert all(value >= 0 for value in seconds.values()) and seconds["check"] > 0, seconds
    assert sum(v for k, v in seconds.items() if k != "total") <= seconds["total"] + 1e-6, seconds
    assert main(["plan", "specs/plans/linear_chain.yaml"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PASS") and out.splitlines()[2].startswith("predicted cost: ")
    assert re.search(r"^CPU seconds: start [\d.]+, build [\d.]+, .*total [\d.]+$", out, re.M)


@pytest.mark.dist
def test_user_module_on_gloo(sv_backend):
    model, x = ResidualMLP(), torch.randn(8, 16)
    assert verify_plan(model, x, (2, 2), backend=sv_backend((2, 2), "process")).passed


class TwoProjections(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32, bias=False)
        self.down = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.down(self.up(x))


def test_deferred_reduction_becomes_a_reduce_scatter(sv_backend):
    model, x = TwoProjections(), torch.randn(8, 16)
    plan = {"up": {"strategy": "RR = RS0 x S0R", "defer": True}, "down": "S0S1 = S0R x RS1_0"}
    result = verify_plan(model, x, (2, 2), plan, backend=sv_backend((2, 2), "simulated"))
    assert result.passed, result.summary()
    (reshard,) = result.plan.node("down").reshards
    assert str(reshard.source) == "[R, R] P0"
    assert reshard.steps == (ReshardStep("reduce_scatter", (0,), (0,)),)
    eager = make_plan(model, (x,), (2, 2), {**plan, "up": "RR = RS0 x S0R"})
    assert result.plan.cost.total < eager.cost.total


def test_solver_with_deferral_is_never_worse():
    module, inputs = _chain(64, 256)
    gm = traced(ModelRecipe(module, inputs))
    mesh = DeviceMesh((2, 2))
    options = node_options(gm, mesh)
    with_defer = solve_plan(gm, mesh, options=options)
    without = solve_plan(gm, mesh, options=options, defer_reductions=False)
    assert with_defer.cost.total <= without.cost.total + 1e-12
    assert not any(n.deferred for n in without.nodes)


def test_plan_spec_error_names_file_line_and_plan(tmp_path):
    """Reading the spec builds nothing; making its plan (the generated test, `shardverify plan`)
    finds the misspelt strategy and names the spec's file, line and plan."""
    from shardverify.spec.loader import load_yaml
    from shardverify.errors import SpecError
    from shardverify.plan.spec import build_spec_model, parse_plan_spec, spec_plan

    spec = tmp_path / "bad.yaml"
    spec.write_text("name: bad\nmodel: {factory: shardverify.plan.zoo.linear_chain}\ninputs: {x: [8, 32]}\n"
                    "mesh: [2, 2]\nplans:\n  solver: solver\n  mine: {fc1: nope}\n")
    parsed = parse_plan_spec(load_yaml(str(spec)))
    where = dict(parsed.where)
    module, inputs = build_spec_model(parsed.factory, parsed.kwargs, parsed.inputs, where=where["factory"])
    with pytest.raises(SpecError) as info:
        spec_plan(module, inputs, parsed.meshes[0], dict(parsed.plans)["mine"], where=where["mine"])
    text = str(info.value)
    assert "bad.yaml:7: field 'plans.mine'" in text and "no strategy 'nope'" in text


@pytest.mark.parametrize("text, line, fragment", [
    ("model: {factory: shardverify.plan.zoo.mlp_block, zoo: gpt2}\ninputs: {x: [8, 32]}\nmesh: [2]\n", 2,
     "'factory' (a dotted path) or 'zoo'"),
    ("model: {zoo: gpt5}\nmesh: [2]\n", 2, "no zoo model 'gpt5'; the zoo has gpt2, llama"),
    ("model: {zoo: gpt2}\ninputs: {x: [8, 32]}\nmesh: [2]\n", 3, "a zoo model brings its own inputs"),
    ("model: {zoo: gpt2}\nmeshes: [[2, 2], [4]]\ncapture: jit\n", 4, "capture must be one of fx, export"),
    ("model: {zoo: gpt2}\nmesh: [4]\nmeshes: [[2, 2], [4]]\n", 1, "'mesh' (one mesh shape) or 'meshes'"),
    ("model: {zoo: gpt2}\nmeshes: [[2, 2], [2, 2]]\n", 3, "meshes must be distinct"),
    ("model: {zoo: gpt2}\nmeshes: [[2, 2], [4]]\n", 5, "a plan that names strategies is for one mesh"),
    ("model: {zoo: gpt2}\nmeshes: [[2, 2], [4]]\nsuite_meshes: [[8]]\n", 4, "suite_meshes must name some"),
])
def test_a_plan_spec_of_a_zoo_model_is_read_strictly(tmp_path, text, line, fragment):
    from shardverify.spec.loader import load_yaml
    from shardverify.errors import SpecError
    from shardverify.plan.spec import parse_plan_spec

    spec = tmp_path / "zoo.yaml"
    spec.write_text(f"name: zoo\n{text}plans:\n  mine: {{addmm: RR}}\n" if "names strategies" in fragment else
                    f"name: zoo\n{text}plans:\n  solver: solver\n")
    with pytest.raises(SpecError) as info:
        parse_plan_spec(load_yaml(str(spec)))
    assert info.value.line == line and fragment in str(info.value), str(info.value)


def test_suite_meshes_choose_the_generated_tests_runs_and_nothing_else():
    """A spec's suite_meshes limit the generated test's runs to those meshes; without them every
    mesh runs."""
    from shardverify.spec.loader import load_yaml_text
    from shardverify.plan.spec import parse_plan_spec, process_runs, simulated_runs

    text = "name: zoo\nmodel: {zoo: gpt2}\nmeshes: [[2, 2], [4]]\nplans:\n  solver: solver\n  dp: data_parallel\n"
    every = parse_plan_spec(load_yaml_text(text, "zoo.yaml"))
    share = parse_plan_spec(load_yaml_text(text + "suite_meshes: [[4]]\n", "zoo.yaml"))
    assert simulated_runs(every) == [((2, 2), "solver"), ((2, 2), "dp"), ((4,), "solver"), ((4,), "dp")]
    assert simulated_runs(share) == [((4,), "solver"), ((4,), "dp")] and process_runs(share) == [((4,), "solver")]
    assert share.meshes == every.meshes


def test_a_zoo_plan_spec_runs_from_the_plan_command(capsys):
    from shardverify.cli.main import main

    assert main(["plan", "specs/plans/vit.yaml", "--mesh", "4", "--data-parallel", "--strict"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PASS: the plan for specs/plans/vit.yaml on mesh [4] matches the single-device model")
    assert "all 53 ops that compute have verified sharding strategies" in out.splitlines()[3], out


def test_the_simulated_ranks_share_one_single_device_reference(monkeypatch):
    """The ranks (threads) read one recipe and one reference run of it, not a copy each: a plan
    check of a model holds one float64 copy of its weights and gradients, not one per rank."""
    from shardverify.plan import reference

    calls = []
    real = reference.reference_run
    monkeypatch.setattr(reference, "reference_run", lambda recipe: calls.append(recipe) or real(recipe))
    result = verify_plan(ResidualMLP(), torch.randn(8, 16), (2, 2), data_parallel=True)
    assert result.passed, result.summary()
    assert len(calls) == 1


_GATE = threading.Event()


def _held(x):
    """Passes ``x`` through; on a rank's thread, only once ``_GATE`` opens (the capture, on the
    main thread, never waits): a check that cannot finish before its timeout, whatever the load."""
    if threading.current_thread() is not threading.main_thread():
        _GATE.wait(60)
    return x


torch.fx.wrap("_held")


class _HeldMLP(ResidualMLP):
    def forward(self, x):
        return super().forward(_held(x))


def test_the_check_takes_the_time_it_is_given(capsys):
    """A large model's check outlasts the backend's default timeout: verify_plan and `plan
    --timeout` pass a longer one; an impossible one is reported, naming the limit."""
    _GATE.clear()
    try:
        result = verify_plan(_HeldMLP(), torch.randn(8, 16), (2, 2), capture="fx", timeout=0.2)
    finally:
        _GATE.set()   # the abandoned rank threads finish
    assert not result.passed and "did not finish within 0.2s" in result.summary(), result.summary()
    assert verify_plan(_HeldMLP(), torch.randn(8, 16), (2, 2), capture="fx", timeout=600).passed
    with pytest.raises(SystemExit) as info:
        main(["plan", "shardverify.plan.zoo.linear_chain", "--input", "8,32", "--timeout", "soon"])
    assert info.value.code == 2 and "timeout 'soon'" in capsys.readouterr().err


def test_row_parallel_linear_with_bias_post_add(sv_backend):
    model, x = ResidualMLP(), torch.randn(8, 16)
    plan = make_plan(model, (x,), (2, 2), {"up": "RR = RS01 x S01R", "down": "RR = RS01 x S01R"})
    assert plan.node("up").strategy.post_add, "the row-parallel Linear with a bias adds it after the reduce"
    result = run_plan(sv_backend((2, 2), "simulated"), model, (x,), plan)
    assert result.passed, result.summary()


class _Heads(nn.Module):
    """Column-parallel projection, then heads split by a reshape whose shape the model computes
    from its input's shape (x.size(0), x.shape[1], x.dim())."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        y = self.proj(x)
        return y.reshape(x.size(0), x.shape[1], 4, 16 // 4 + 0 * x.dim()).sum()


def test_shape_reads_cost_no_resharding_and_heads_stay_sharded(sv_backend):
    from shardverify.plan.graph import metadata_read
    from shardverify.capture.fx import trace

    module, inputs = _Heads(), (torch.randn(4, 8, 16),)
    plan = make_plan(module, inputs, (2, 2), {"proj": "RS01 = RR x RS01", "reshape": "RRS01 -> RRS01R"})
    reads = [n for n in plan.nodes if n.node.startswith(("size", "getattr", "dim"))]
    assert len(reads) == 3 and all(not n.reshards for n in reads)   # x.shape never gathers anything
    assert all(not r.steps for r in plan.node("reshape").reshards)     # the head shard passes straight in
    assert run_plan(sv_backend((2, 2), "simulated"), module, inputs, plan).passed
    gm = trace(module, meta_args={"x": torch.empty(4, 8, 16, device="meta")})
    values = {n.name: metadata_read(n) for n in gm.graph.nodes if n.name.startswith(("size", "getattr", "dim"))}
    assert values["size"] == 4 and tuple(values["getattr_1"]) == (4, 8, 16) and values["dim"] == 3


def test_a_node_failing_on_one_rank_is_named_with_that_rank_at_once(monkeypatch, sv_backend):
    """A failure on some ranks only (the others wait in the node's collective): reported at once,
    naming the node and the failing rank, not after the backend's timeout as node '?'."""
    import time

    from shardverify.plan import execute
    from shardverify.plan.zoo import mlp_block

    real = execute._run_strategy

    def planted(comm, gm, node, *args, **kwargs):
        if node.name == "fc2" and comm.rank == 1:
            raise RuntimeError("planted: only rank 1 fails here")
        return real(comm, gm, node, *args, **kwargs)

    monkeypatch.setattr(execute, "_run_strategy", planted)
    model, x = mlp_block(d_in=32, d_hidden=64), torch.randn(8, 32)
    plan = make_plan(model, (x,), (2, 2), {"fc1": "RS01 = RR x RS01", "fc2": "RR = RS01 x S01R"})
    start = time.monotonic()
    result = run_plan(sv_backend((2, 2), "simulated"), model, (x,), plan, timeout=30)
    assert time.monotonic() - start < 10
    assert not result.passed
    text = result.summary()
    assert "node 'fc2'" in text and "planted: only rank 1 fails here" in text and "ranks: [1]" in text, text


@pytest.mark.parametrize("stopped", [False, True], ids=["solved", "stopped"])
def test_the_solver_leaves_no_file_in_tmpdir(tmp_path, monkeypatch, stopped):
    """PuLP writes ``*-pulp.mps`` / ``*-pulp.sol`` to TMPDIR and deletes them only after a solve
    that returns: a stop between CBC's run and that deletion (Ctrl-C, SIGTERM) left them."""
    import tempfile

    import pulp

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    # torch's inductor cache stays where it is: a process that first asks for it under this
    # TMPDIR (this one, or a child inheriting it) would make it here, not a leftover of the run
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", cache_dir())
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    written = []
    if stopped:
        def stop_before_deleting(self, *paths):   # CBC has run and written its files: the stop comes now
            written.extend(path for path in paths if __import__("os").path.exists(path))
            raise KeyboardInterrupt
        monkeypatch.setattr(pulp.PULP_CBC_CMD, "delete_tmp_files", stop_before_deleting)
    module, inputs = _chain()
    gm = traced(ModelRecipe(module, inputs))
    mesh = DeviceMesh((2,))
    if stopped:
        with pytest.raises(KeyboardInterrupt):
            solve_plan(gm, mesh, options=node_options(gm, mesh))
        assert any(path.endswith("-pulp.mps") for path in written), written
    else:
        solve_plan(gm, mesh, options=node_options(gm, mesh))
    assert [path.name for path in tmp_path.iterdir() if not path.name.startswith("torchinductor_")] == []


def test_a_plan_check_compares_by_the_one_rule():
    """verify/tolerance's rule: a NaN where the single device has a number is a mismatch (the plan's
    own rule let it pass: NaN compares false with any bound), a NaN where it has NaN is not; the
    float64 default tolerance is the op check's; what differs is verify/report's Mismatch."""
    from shardverify.plan.compare import compare_value
    from shardverify.verify.report import Mismatch
    from shardverify.verify.tolerance import DEFAULT_TOLERANCES

    expected = torch.tensor([1.0, float("nan"), 3.0], dtype=torch.float64)
    found: list = []
    compare_value(found, "forward", 3, "fc1", "output", 1, expected.clone(), expected)
    assert found == []
    compare_value(found, "forward", 3, "fc1", "output", 1, torch.tensor([float("nan")] * 3, dtype=torch.float64),
                  expected, DEFAULT_TOLERANCES[torch.float64])
    (mismatch,) = found
    assert isinstance(mismatch, Mismatch) and (mismatch.phase, mismatch.node, mismatch.order) == ("forward", "fc1", 3)
    assert mismatch.describe() == "rank 1: forward output at node 'fc1': max abs error inf"
