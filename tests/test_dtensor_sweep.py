"""`shardverify dtensor`'s cases as units (dtensor/sweep.py): settled in the serial run's order,
the sweep stores what `run_spec` stores and gives its results, attributions and repros; a case
whose worker died twice is said and left for the next run; a case that raised is stored as the
serial run stores it.  The cluster itself is tested in test_cluster.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli_verify import _without_seconds as without_seconds

from shardverify.backends.units import InProcess, UnitFailed
from shardverify.cli.main import main
from shardverify.features.dtensor.run import run_spec
from shardverify.features.dtensor.sweep import DIED_ON_WORKER, joined, run_case_unit, settle, sweep
from shardverify.features.dtensor.run import CaseResult
from shardverify.features.dtensor.verdicts import Finding
from shardverify.spec.catalogue import load_op_specs

ROOT = Path(__file__).resolve().parents[1]


def stored(folder: Path) -> dict:
    """Every stored file of a results folder, by its path in the folder, without the timings."""
    return {str(path.relative_to(folder)): without_seconds(json.loads(path.read_text()))
            for path in sorted(folder.rglob("*.json"))}


def _finding(case: str, klass: str = "silent-wrong", placements: str = "S(0)", **changes) -> Finding:
    return Finding("cumsum", case, (4,), (("input", "S0"),), (("input", placements),), klass, "forward", "", "", "",
                   "S0", "", **changes)


def test_settle_takes_back_what_a_case_before_had_explained():
    """Two cases found the same class apart: the later one's attribution and repro are taken back,
    a new class in it keeps its own."""
    rendered: set[str] = set()
    first = CaseResult("cumsum", "a", (4,), findings=[_finding("a", culprit="aten.cumsum rule", repro="x")])
    settle(first, {0: ("", "plain runtime")}, 0, rendered)
    assert first.findings[0].culprit == "aten.cumsum rule" and first.findings[0].repro == "x"
    later = CaseResult("cumsum", "b", (4,), findings=[_finding("b", culprit="aten.cumsum rule", repro="y"),
                                                      _finding("b", placements="R", culprit="other", repro="z")])
    settle(later, {0: ("", "plain runtime"), 1: ("", "")}, 0, rendered)
    again, new = later.findings
    assert (again.culprit, again.runtime, again.repro) == ("", "plain runtime", "")
    assert (new.culprit, new.repro) == ("other", "z")


@pytest.mark.slow
def test_the_sweep_stores_and_reports_what_the_serial_run_does(tmp_path):
    """cumsum on (2, 2): its workers attribute and repro the same classes case after case; settled,
    the stored files, the results and each finding's culprit and repro are the serial run's."""
    spec, = load_op_specs(ROOT, None, ["cumsum"])
    serial = run_spec(spec, [(2, 2)], limit=4, store=tmp_path / "serial", root=ROOT)
    made = []

    def counting(*args):
        value = run_case_unit(*args)
        made.append(sum(bool(f.repro) for f in value[0].findings))
        return value

    swept = sweep([spec], [(2, 2)], InProcess(), limit=4, store=tmp_path / "swept", root=ROOT, call=counting)
    assert sum(made) > sum(bool(f.repro) for r in serial for f in r.findings) > 0, "no repro made twice: nothing settled"
    assert stored(tmp_path / "serial") == stored(tmp_path / "swept") != {}
    assert [without_seconds(r.to_json()) for r in serial] == [without_seconds(r.to_json()) for r in swept]
    assert [[(f.culprit, f.runtime, f.repro) for f in r.findings] for r in serial] == \
           [[(f.culprit, f.runtime, f.repro) for f in r.findings] for r in swept]


@pytest.mark.slow
def test_cases_cut_into_chunks_store_and_report_what_the_serial_run_does(tmp_path):
    """A stored sample (--limit 2) says how many combinations each case has; at --limit 6 each case
    then runs as two chunks (4 and 2 combinations), joined and settled into the serial run's."""
    import shutil

    spec, = load_op_specs(ROOT, None, ["cumsum"])
    run_spec(spec, [(2, 2)], limit=2, store=tmp_path / "serial", root=ROOT)
    shutil.copytree(tmp_path / "serial", tmp_path / "swept")
    serial = run_spec(spec, [(2, 2)], limit=6, store=tmp_path / "serial", root=ROOT)
    spans = []

    def counting(*args):
        spans.append(args[9] if len(args) > 9 else None)
        return run_case_unit(*args)

    swept = sweep([spec], [(2, 2)], InProcess(), limit=6, store=tmp_path / "swept", root=ROOT, call=counting, chunk=4)
    assert spans.count((0, 4)) == spans.count((4, 6)) == len(serial) and len(spans) == 2 * len(serial)
    assert stored(tmp_path / "serial") == stored(tmp_path / "swept")
    assert [without_seconds(r.to_json()) for r in serial] == [without_seconds(r.to_json()) for r in swept]
    assert [[(f.culprit, f.runtime, f.repro) for f in r.findings] for r in serial] == \
           [[(f.culprit, f.runtime, f.repro) for f in r.findings] for r in swept]


def test_a_chunk_after_the_one_the_budget_ended_adds_nothing():
    ended = CaseResult("cumsum", "a", (4,), combinations=9, executed=3, note="the case's other 5 not executed")
    ended.counts.update({"agrees": 2, "too-slow": 1})
    later = CaseResult("cumsum", "a", (4,), combinations=9, executed=4, findings=[_finding("a")])
    later.counts.update({"silent-wrong": 1, "agrees": 3})
    first = CaseResult("cumsum", "a", (4,), combinations=9, executed=2, findings=[_finding("a", placements="R")])
    first.counts.update({"silent-wrong": 1, "agrees": 1})
    found, attributed, warned = joined([(first, {0: ("", "x")}, {"w": 1}), (ended, {}, {"w": 2}), (later, {0: ("", "y")}, {})])
    assert found.executed == 5 and found.counts == {"agrees": 3, "silent-wrong": 1, "too-slow": 1}
    assert len(found.findings) == 1 and attributed == {0: ("", "x")} and found.note == ended.note
    assert warned == {"w": 3}


class _Dies:
    """An engine whose second unit's worker died twice and whose third raised."""

    def run(self, units, done):
        results = []
        for index, unit in enumerate(units):
            if index == 1:
                value = UnitFailed("its worker process died, also when it ran alone: ActorDiedError", died=True)
            elif index == 2:
                value = UnitFailed("RuntimeError: boom", cause=RuntimeError("boom"))
            else:
                value = unit.call(*unit.args)
            results.append(value)
            done(index, value)
        return results


def test_a_case_whose_worker_died_is_said_and_run_again_next_time(tmp_path):
    spec, = load_op_specs(ROOT, None, ["relu"])
    results = sweep([spec], [(2,)], _Dies(), limit=2, store=tmp_path, root=ROOT)
    died, raised = results[1], results[2]
    assert died.executed == 0 and died.note.startswith("error: its worker process died") and DIED_ON_WORKER in died.note
    assert raised.note == "error: RuntimeError: boom"
    (file,) = tmp_path.rglob("*.json")
    saved = json.loads(file.read_text())
    assert died.case not in saved["done"] and raised.case in saved["done"] and results[0].case in saved["done"]
    again = sweep([spec], [(2,)], InProcess(), limit=2, store=tmp_path, root=ROOT)
    assert [r.resumed for r in again] == [True, False, *[True] * (len(again) - 2)]
    assert again[1].executed > 0


def test_jobs_without_a_cluster_and_a_custom_spec_on_one_are_refused(capsys):
    assert main(["dtensor", "relu", "--mesh", "2", "--jobs", "2", "--root", str(ROOT)]) == 2
    assert "--jobs N is the number of Ray workers of --cluster" in capsys.readouterr().err
    custom = str(ROOT / "tests" / "dtensor_custom" / "row_normalize.yaml")
    assert main(["dtensor", "--custom", custom, "--cluster", "local", "--root", str(ROOT)]) == 2
    assert "run --custom without --cluster" in capsys.readouterr().err
