"""The benchmark scripts are not timed in tests, but they must keep importing and parsing
their arguments as the package changes under them, and CI must run each one's quick mode
(.ci/run runs ``--quick`` of every ``benchmarks/bench_*.py``: a figure it cannot measure fails CI)."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("bench_*.py"))


def test_there_are_benchmarks():
    assert BENCHMARKS, "benchmarks/ has no bench_*.py script"


def test_every_script_in_benchmarks_is_one_ci_runs():
    """CI's step globs bench_*.py: a script named otherwise would be forgotten."""
    scripts = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
    assert scripts == BENCHMARKS, f"not named bench_*.py, so CI skips: {sorted(set(scripts) - set(BENCHMARKS))}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'for script in benchmarks/bench_*.py' in ci and '"$script" --quick' in ci, \
        ".ci/run no longer runs every benchmark's --quick mode"


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_script_starts(script):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
    assert "--quick" in done.stdout, f"{script.name} has no --quick mode for CI"


def test_a_localtensormode_left_entered_by_a_cut_dtensor_layout_is_undone(monkeypatch):
    """bench_verify cuts a DTensor layout over its budget wherever it is, past a hard limit: cut
    inside LocalTensorMode's enter or exit, the mode stayed entered, and every tensor the rest of
    the run made (the bare op's, the fresh-processes baseline's) was a LocalTensor."""
    import torch
    from torch.distributed._local_tensor import LocalTensorMode

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_verify

    depths = bench_verify._mode_stacks()
    LocalTensorMode(4).__enter__()     # entered, never exited: what a cut in __enter__ leaves
    try:
        assert type(torch.zeros(2)).__name__ == "LocalTensor"
    finally:
        bench_verify._restore_mode_stacks(depths)
    assert bench_verify._mode_stacks() == depths
    assert type(torch.zeros(2)) is torch.Tensor and torch.zeros(2).tolist() == [0.0, 0.0]


def _bench_verify(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_verify

    return bench_verify


def _first_layouts(spec_name: str, mesh_shape: tuple[int, ...]):
    from shardverify.sharding.mesh import DeviceMesh
    from shardverify.spec.catalogue import load_op_specs
    from shardverify.strategies.for_node import strategies_for_node

    mesh = DeviceMesh(mesh_shape)
    _, case = next(iter(load_op_specs(ROOT, None, [spec_name])[0].op_cases()))
    graph_module, node_name = case.build()
    return mesh, case, list(strategies_for_node(graph_module, node_name, mesh))


def test_bench_verify_floor_calls_the_targets_plain_torch_function(monkeypatch):
    """The floor is the case's target in plain torch on each rank's shards: torch.sum with the
    case's params, F.linear on the input and weight blocks (nn.Linear's functional form)."""
    import torch
    import torch.nn.functional as F

    bench_verify = _bench_verify(monkeypatch)
    mesh, case, strategies = _first_layouts("sum", (2, 2))
    layout = bench_verify.settle(bench_verify.plain_calls(case, strategies[0], mesh))
    assert all(call.fn is torch.sum and call.kwargs == dict(case.params) for call in layout.calls)
    mesh, case, strategies = _first_layouts("linear", (2, 2))
    layout = bench_verify.settle(bench_verify.plain_calls(case, strategies[0], mesh))
    for call, shards in zip(layout.calls, layout.shards):
        assert call.fn is F.linear and call.args[2] is None   # the case's Linear has no bias
        assert call.args[0] is shards[("arg", 0)] and call.args[1] is shards[("param", "weight")]


def _project_files_entered(body) -> list[str]:
    """The files of shardverify that any Python frame entered while ``body()`` ran came from
    (some frame must be entered: the op and autograd.grad are torch's Python)."""
    entered = set()
    sys.setprofile(lambda frame, event, arg: entered.add(frame.f_code.co_filename) if event == "call" else None)
    try:
        body()
    finally:
        sys.setprofile(None)
    assert entered, "the body entered no Python frame at all"
    package = str(ROOT / "shardverify")
    return sorted(path for path in entered if path.startswith(package))


def test_bench_verify_floor_body_runs_no_project_code(monkeypatch):
    """Nothing of shardverify runs while the floor's clock runs: every Python frame entered in
    its timed body is torch's (the op itself and autograd.grad) or the body's own."""
    bench_verify = _bench_verify(monkeypatch)
    mesh, case, strategies = _first_layouts("linear", (2, 2))
    layouts, _ = bench_verify.floor_layouts(mesh, [(case, strategies[:4])])
    calls = [call for layout in layouts for call in layout.calls]
    assert _project_files_entered(lambda: bench_verify.floor_body(calls)) == []


def test_bench_verify_least_check_runs_no_project_code(monkeypatch):
    """The least check's timed body is plain torch too: its all-reduces and comparisons included."""
    bench_verify = _bench_verify(monkeypatch)
    mesh, case, strategies = _first_layouts("linear", (2, 2))
    layouts, _ = bench_verify.floor_layouts(mesh, [(case, strategies)])
    least = bench_verify.least_layouts(mesh, layouts)
    assert any(layout.out_groups[0] for layout in least) and any(any(layout.leaf_groups) for layout in least)
    assert _project_files_entered(lambda: bench_verify.least_body(least)) == []


@pytest.mark.parametrize("spec_name", ["sum", "linear"])
def test_bench_verify_ranks_batched_give_each_ranks_values_and_run_no_project_code(monkeypatch, spec_name):
    """The batched floor is every rank's call at once: the vmapped call on the stacked blocks
    gives each rank's output and gradients of its own call, and its timed body is torch's alone;
    on a mesh whose axis of 3 cuts a dim of 4 into ragged blocks those layouts are left out,
    counted, not measured."""
    import torch

    bench_verify = _bench_verify(monkeypatch)
    mesh, case, strategies = _first_layouts(spec_name, (2, 2))
    floors, _ = bench_verify.floor_layouts(mesh, [(case, strategies)])
    made = [bench_verify.batched_layout(layout) for layout in floors]
    assert all(made), [layout.strategy.name for layout, m in zip(floors, made) if m is None]
    for layout, batched in zip(floors[:6], made):
        out, grads = bench_verify._batched_run(batched)
        for rank, call in enumerate(layout.calls):
            own = call.fn(*call.args, **call.kwargs)
            torch.testing.assert_close(out[0][rank], own)
            if call.leaves:
                for mine, theirs in zip(torch.autograd.grad(own, call.leaves, call.grads), grads):
                    torch.testing.assert_close(theirs[rank], mine)
    assert _project_files_entered(lambda: bench_verify.batched_body(made)) == []
    mesh, case, strategies = _first_layouts(spec_name, (2, 3))
    found = bench_verify.batched_ab(mesh, [(case, s) for s in strategies], seconds=0.0, rounds=1)
    assert found["unlike"] > 0 and found["layouts"] > 0 and found["refused"] == 0
    assert found["layouts"] + found["unlike"] == len(strategies)
    assert "left out: %d whose ranks' calls differ" % found["unlike"] in bench_verify.batched_note(found)


@pytest.mark.parametrize("spec_name, collective", [("sum", "out_groups"), ("linear", "leaf_groups")])
def test_bench_verify_least_check_fails_a_layout_without_its_all_reduce(monkeypatch, spec_name, collective):
    """Every layout without a partial input passes the least check as the engine lays it out;
    dropped, a partial output's all-reduce (sum) or a weight gradient's (linear) fails it: the
    least check compares what a check must, so its collectives are real work, not decoration."""
    bench_verify = _bench_verify(monkeypatch)
    mesh, case, strategies = _first_layouts(spec_name, (2, 2))
    layouts, _ = bench_verify.floor_layouts(mesh, [(case, strategies)])
    least = bench_verify.least_layouts(mesh, layouts)
    assert bench_verify.check_least(spec_name, least) == sum(not s.partial_inputs for s in strategies) > 0
    reduced = [layout for layout in least if layout.judged and any(g is not None for g in getattr(layout, collective))]
    assert reduced
    dropped = [layout._replace(**{collective: (None,) * len(getattr(layout, collective))}) for layout in reduced]
    assert not any(bench_verify.least_body(dropped))
    with pytest.raises(bench_verify.Disagreement, match="the least check fails"):
        bench_verify.check_least(spec_name, dropped)


def test_bench_verify_least_check_leaves_the_layouts_the_engine_passes_by_its_budget_unjudged(monkeypatch):
    """At 4x linear's leading dims every float32 layout leaves the default tolerance and passes the
    engine only by its low-precision budget: the least check, which compares at the default
    tolerance, failed them all and ended the bench's default run. Now the engine's notes say which
    layouts passed that way, and the least check judges only the others."""
    from shardverify.backends import SimulatedBackend
    from shardverify.strategies.for_node import strategies_for_node
    from shardverify.verify.engine import verify_case

    bench_verify = _bench_verify(monkeypatch)
    mesh, case, _ = _first_layouts("linear", (2, 2))
    grown = bench_verify.scaled_case(case, 4).case
    graph_module, node_name = grown.build()
    strategies = bench_verify.distinct_layouts(strategies_for_node(graph_module, node_name, mesh))
    layouts, _ = bench_verify.floor_layouts(mesh, [(grown, strategies)])
    with pytest.raises(bench_verify.Disagreement, match="the least check fails"):
        bench_verify.check_least("linear", bench_verify.least_layouts(mesh, layouts))
    with SimulatedBackend(mesh, timeout=120) as simulated:
        results = verify_case(simulated, grown, [layout.strategy for layout in layouts])
    assert all(result.passed for result in results)
    budgeted = bench_verify.budget_passes([(grown, results)])
    assert budgeted and budgeted == {(id(grown), r.strategy) for r in results if "within" in r.note}
    # a note may say other things of a check that passed within the default tolerance: still judged
    seeded = dataclasses.replace(results[0], strategy="seeded", note="checked under seeds 0, 1 so that every two "
                                 "blocks a layout gives differ")
    assert not bench_verify.budget_passes([(grown, [seeded])])
    least = bench_verify.least_layouts(mesh, layouts, budgeted)
    assert bench_verify.check_least("linear", least) == \
        sum(not layout.strategy.partial_inputs and (id(grown), layout.strategy.name) not in budgeted
            for layout in layouts)


def test_bench_verify_measures_a_row_over_its_memory_budget_in_chunks(monkeypatch):
    """At 16x linear's leading dims on (2, 2) the blocks the floor and the least check make before
    their clocks took over 24 GB and the process was killed. A row whose blocks hold more than
    the budget is measured chunk by chunk within it, every layout still measured and judged."""
    from shardverify.backends import SimulatedBackend

    bench_verify = _bench_verify(monkeypatch)
    assert bench_verify.chunked([3, 3, 3, 10, 1], 6) == [[0, 1], [2], [3], [4]]
    mesh, case, strategies = _first_layouts("sum", (2, 2))
    chosen = [(case, bench_verify.distinct_layouts(strategies))]
    with SimulatedBackend(mesh, timeout=120) as simulated:
        whole = bench_verify.measure_row(simulated, mesh, chosen, 0.0, 1)
        budget = int(whole["held_gib"] * 2**30 / 3)
        cut = bench_verify.measure_row(simulated, mesh, chosen, 0.0, 1, memory=budget)
    assert whole["chunks"] == 1 and cut["chunks"] >= 3
    for key in ("layouts", "floor_left_out", "least_judged", "least_budgeted", "runnable"):
        assert cut[key] == whole[key], key
    assert all(cut[f"{phase}_ms"]["min"] > 0 for phase in ("floor", "least", "cold", "warm"))


def test_bench_verify_cold_check_empties_the_engines_tables(monkeypatch):
    """The cold check empties every per-case and per-layout table of the verify engine."""
    bench_verify = _bench_verify(monkeypatch)
    names = {name for name, _ in bench_verify.engine_tables()}
    assert {"reference._REFERENCES", "rank_inputs._BLOCKS", "rank_inputs._PIECES", "rank._GRAD_OUTPUTS",
            "compare._SLICES", "layout._GEOMETRIES", "distinct._SEEDS"} <= names


def test_bench_verify_ab_fails_past_ten_percent(monkeypatch):
    """The A/B's verdict: the floor's body and the loop written out may differ by 10%, no more."""
    bench_verify = _bench_verify(monkeypatch)

    def ab(ratio):
        return {"floor_over_hand": {"min": ratio, "median": ratio}}

    bench_verify.check_agreement("sum", ab(1.09))
    bench_verify.check_agreement("sum", ab(0.91))
    for ratio in (1.11, 0.89):
        with pytest.raises(bench_verify.Disagreement, match="differ by 11%"):
            bench_verify.check_agreement("sum", ab(ratio))


def test_bench_floor_round_runs_no_project_code(monkeypatch):
    """The floor that CI sets the suite's CPU time against is torch and the interpreter alone: no
    Python frame of shardverify is entered in its in-process parts, and its start part is a bare
    interpreter importing torch."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_floor

    assert _project_files_entered(lambda: (bench_floor.python_part(1000), bench_floor.torch_part(3))) == []
    started = []
    monkeypatch.setattr(bench_floor.subprocess, "run", lambda argv, **kwargs: started.append(argv))
    bench_floor.start_part()
    assert started == [[sys.executable, "-c", "import torch"]]


def test_bench_floor_total_is_one_positive_figure_for_ci():
    """.ci/run reads ``--total``'s line as a number of CPU seconds (the suite's CPU time is given in
    floor rounds), so it prints that number alone."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "benchmarks/bench_floor.py --rounds 3 --total" in ci
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_floor.py"), "--rounds", "1", "--total"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) > 0 and len(done.stdout.splitlines()) == 1, done.stdout
