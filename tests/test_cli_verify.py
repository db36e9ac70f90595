"""`shardverify verify`: the verdict first, the table behind -v, --json, the exit status, and
failures that must surface."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardverify import DeviceMesh
from shardverify.strategies.for_node import strategies_for_node
from shardverify.cli import verify_cmd
from shardverify.cli.catalogue import load_op_specs

REPO = Path(__file__).resolve().parents[1]


def cli(*argv: str) -> int:
    """Run the verify subcommand as `shardverify` would (its own parser, nothing else)."""
    parser = argparse.ArgumentParser(prog="shardverify")
    verify_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["verify", *argv])
    return args.func(args)


def test_json_lists_every_case_and_strategy(capsys):
    assert cli("sum", "--mesh", "4", "--json", "--root", str(REPO)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and report["failures"] == 0 and report["backend"] == "simulated"
    spec, = load_op_specs(REPO, None, ["sum"])
    cases = spec.op_cases()
    assert [row["case"] for row in report["rows"]] == [case_id for case_id, _ in cases]
    for row, (_, case) in zip(report["rows"], cases):
        graph_module, node_name = case.build()
        names = [s.name for s in strategies_for_node(graph_module, node_name, DeviceMesh((4,)))]
        assert row["mesh"] == [4] and row["verified"] == len(names) > 0
        assert [check["strategy"] for check in row["checks"]] == names
        assert all(check["passed"] for check in row["checks"])
    assert report["strategies"] == sum(row["verified"] for row in report["rows"])


def test_verbose_adds_one_row_per_case_and_mesh_after_the_verdict(capsys):
    assert cli("sum", "--mesh", "2,2", "--mesh", "4", "--root", str(REPO), "-v") == 0
    out = capsys.readouterr().out.splitlines()
    cases = len(load_op_specs(REPO, None, ["sum"])[0].op_cases())
    assert out[0].startswith("PASS  ") and ", 0 failures  (1 op, " in out[0] and "2 meshes; simulated backend" in out[0]
    header = next(i for i, line in enumerate(out) if line.split()[:2] == ["op", "case"])
    assert header == 2 and out[header].split() == ["op", "case", "mesh", "strategies", "failures", "time"]
    rows = [line.split() for line in out[header + 2:] if line.startswith("sum ")]
    assert len(rows) == 2 * cases
    assert {row[2] for row in rows} == {"2x2", "4"} and {row[4] for row in rows} == {"0"}
    assert f"{sum(int(row[3]) for row in rows):,} strategy checks" in out[0]


def test_a_broken_communication_layer_fails_the_run(capsys, monkeypatch):
    """Gradient hooks that do nothing: exactly the linear strategies that declare a gradient
    hook must fail, be counted in the table, reported in full, and the exit status is 1."""
    from shardverify.sharding.strategy import CommWhere
    from shardverify.verify import rank

    monkeypatch.setattr(rank, "grad_hook_on_ranks", lambda ranks, action, grads: grads)
    assert cli("linear", "--mesh", "4", "--root", str(REPO), "-v") == 1
    out = capsys.readouterr().out
    failures = {row[1]: int(row[4]) for row in map(str.split, out.splitlines()) if row and row[0] == "linear"}
    expected = {}
    for case_id, case in load_op_specs(REPO, None, ["linear"])[0].op_cases():
        graph_module, node_name = case.build()
        expected[case_id] = sum(any(a.where is CommWhere.HOOK for a in s.communication_actions)
                                for s in strategies_for_node(graph_module, node_name, DeviceMesh((4,))))
    assert failures == expected and sum(expected.values()) > 0
    assert "FAILED" in out and "grad of weight" in out and "rank 0" in out
    assert out.startswith("FAIL  ") and f", {sum(expected.values())} failures  (1 op, " in out.splitlines()[0]


def test_a_passing_run_of_several_specs_is_its_verdict_in_a_few_lines(capsys):
    """The verdict first with the run's counts, then one line for the cases that check no sharding
    (max_all's on (4,): every dim reduced to one element), and nothing else: no row per case."""
    assert cli("sum", "max_all", "--mesh", "4", "--root", str(REPO)) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    cases = sum(len(spec.op_cases()) for spec in load_op_specs(REPO, None, ["sum", "max_all"]))
    assert lines[0].startswith("PASS  ") and ", 0 failures  (2 ops, " in lines[0], lines
    assert f" {cases} cases, 1 mesh; simulated backend; " in lines[0]
    assert lines[1] == ("note: only the replicated strategy exists for 6 cases on their mesh, so no sharding was "
                        "checked there: see -v")
    assert len(lines) <= 10 and len(lines) == 2 and err == ""


def _rows(replicated_only: int, failing: int, errors: int = 0, warned: int = 0) -> list:
    from shardverify.cli.verify_rows import Row
    from shardverify.verify.report import CheckResult, Mismatch

    def result(case: str, passed: bool) -> CheckResult:
        wrong = () if passed else (Mismatch("values", 1, "output", actual_shape=(2,), max_abs_err=0.5,
                                            max_rel_err=1.0, rtol=1e-5, atol=1e-6, dtype="float32"),)
        return CheckResult("op", case, "S0 -> S0", (4,), "simulated", "float32", wrong)

    rows = [Row("sum", f"sum-{i}", (4,), verified=1, results=[result(f"sum-{i}", True)]) for i in range(50)]
    rows += [Row("var", f"var-{i}", (4,), verified=1, results=[result(f"var-{i}", True)],
                 torch_warnings={"var(): degrees of freedom is <= 0.": 2, **({"other": 1} if i % 2 else {})})
             for i in range(warned)]
    rows += [Row("max_all", f"max-{i}", (4,), verified=1, warning="only the replicated strategy exists",
                 results=[result(f"max-{i}", True)]) for i in range(replicated_only)]
    rows += [Row("broken", f"broken-{i}", (2, 2), error="RuntimeError: no", failures=1) for i in range(errors)]
    rows += [Row("wrong", f"wrong-{i}", (2, 2), verified=2, failures=1,
                 results=[result(f"wrong-{i}", True), result(f"wrong-{i}", False)]) for i in range(failing)]
    return rows


def test_the_short_report_stays_short_however_many_cases_check_no_sharding():
    from shardverify.cli.verify_summary import summary_lines

    reports = [summary_lines(_rows(n, 0, warned=n), "simulated", 98.0) for n in (0, 1, 36, 5000)]
    assert [len(lines) for lines in reports] == [1, 3, 3, 3]
    assert reports[0] == ["PASS  50 strategy checks, 0 failures  (1 op, 50 cases, 1 mesh; simulated backend; "
                          "1m38s)"]
    assert reports[3][1].startswith("note: only the replicated strategy exists for 5000 cases on their mesh")
    assert reports[1][2] == "note: torch warned 2 times while checking ('var(): degrees of freedom is <= 0.'): see -v"
    assert reports[3][2] == ("note: torch warned 12,500 times while checking (2 distinct warnings, most often "
                             "'var(): degrees of freedom is <= 0.'): see -v")
    assert summary_lines(_rows(5000, 0, warned=9), "simulated", 1.0, verbose=True)[1:] == []   # -v lists them
    from shardverify.cli.verify_summary import detail_lines

    detail = detail_lines(_rows(2, 0, warned=9))
    assert "  18 x var(): degrees of freedom is <= 0. (var var-0 on mesh (4,), var var-1 on mesh (4,), var var-2 on " \
           "mesh (4,) and 6 more)" in detail


def test_every_failing_case_is_listed_or_counted_with_where_to_see_it():
    from shardverify.cli.verify_summary import detail_lines, summary_lines

    lines = summary_lines(_rows(3, 25, errors=2), "simulated", 3.0)
    assert lines[0] == ("FAIL  103 strategy checks, 27 failures  (4 ops, 80 cases, 2 meshes; simulated backend; "
                        "3.0s)")
    assert lines[1:3] == ["first failure: broken broken-0 on mesh (2, 2): the case could not run",
                          "  RuntimeError: no"]
    assert lines[3].startswith("note: only the replicated strategy exists for 3 cases")
    assert lines[4] == "failing: 27 cases (every report: -v or --json)"
    assert lines[5:7] == ["  broken broken-0 on mesh (2, 2): could not run: RuntimeError: no",
                          "  broken broken-1 on mesh (2, 2): could not run: RuntimeError: no"]
    assert lines[7] == "  wrong wrong-0 on mesh (2, 2): 1 of 2 strategies failed: 'S0 -> S0'"
    assert len(lines) == 5 + 20 + 1 and lines[-1] == "  and 7 more: see -v"
    detail = "\n".join(detail_lines(_rows(3, 25, errors=2)))
    assert all(f"case: wrong-{i}\n" in detail for i in range(25)) and detail.count("could not run") == 0
    assert detail.count(": FAILED: RuntimeError: no") == 2


def test_a_failing_run_starts_with_the_verdict_and_the_first_failure(capsys, monkeypatch):
    """Gradient hooks that do nothing (as above), without -v: FAIL, then the culprit's op, case,
    mesh and strategy, then its rank, tensor and error against the tolerance; every failing case
    listed after; no table."""
    from shardverify.verify import rank

    monkeypatch.setattr(rank, "grad_hook_on_ranks", lambda ranks, action, grads: grads)
    assert cli("linear", "--mesh", "4", "--root", str(REPO), "--json") == 1
    report = json.loads(capsys.readouterr().out)
    failing = [row for row in report["rows"] if row["failures"]]
    assert cli("linear", "--mesh", "4", "--root", str(REPO)) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"FAIL  {report['strategies']} strategy checks, {report['failures']} failures  (1 op, ")
    first = next(check for check in failing[0]["checks"] if not check["passed"])
    assert lines[1] == f"first failure: linear {failing[0]['case']} on mesh (4,), strategy {first['strategy']!r}"
    assert lines[2].startswith("  rank ") and ": grad of " in lines[2] and " exceed rtol=" in lines[2]
    assert lines[3] == f"failing: {len(failing)} cases (every report: -v or --json)"
    assert [line.split(" on mesh")[0] for line in lines[4:]] == [f"  linear {row['case']}" for row in failing]
    assert not any(line.split()[:2] == ["op", "case"] for line in lines)


def test_an_op_without_handler_is_a_failure(tmp_path, capsys):
    """A newcomer's spec that was never generated: the row says why, the exit status is 1."""
    specs = tmp_path / "specs"
    specs.mkdir()
    text = (REPO / "specs" / "sum.yaml").read_text()
    (specs / "nansum.yaml").write_text(text.replace("op: sum", "op: nansum")
                                       .replace("torch.sum\n", "torch.nansum\n").replace("torch.Tensor.sum", "torch.Tensor.nansum"))
    assert cli("--specs-dir", str(specs), "--root", str(tmp_path), "--mesh", "4", "--json") == 1
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False
    assert all(row["error"] and "no handler" in row["error"] and row["failures"] == 1 for row in report["rows"])


def test_bad_arguments_are_named(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli("--mesh", "2,x")
    assert exit_info.value.code == 2 and "mesh shape '2,x' is not a list of positive ints" in capsys.readouterr().err
    assert cli("nosuchop", "--root", str(REPO)) == 2
    assert "no spec named 'nosuchop'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli("--timeout", "0")
    assert "timeout '0' is not a positive number" in capsys.readouterr().err


def _without_seconds(value):
    if isinstance(value, dict):
        return {k: _without_seconds(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [_without_seconds(v) for v in value]
    return value


def test_jobs_give_the_report_of_one_process(capsys):
    """Rows shared among worker processes come back in plan order with every check's result:
    the same document as one process gives, but for the timings."""
    reports = []
    for jobs in ("1", "2"):
        assert cli("sum", "--mesh", "2,2", "--mesh", "4", "--json", "--jobs", jobs, "--root", str(REPO)) == 0
        reports.append(_without_seconds(json.loads(capsys.readouterr().out)))
    assert reports[0] == reports[1] and reports[0]["strategies"] > 0


@pytest.mark.parametrize("argv, early", [(("--jobs", "2"), True), (("--jobs", "1"), False),
                                         (("--jobs", "2", "--backend", "gloo"), False)])
def test_jobs_start_their_workers_forkserver_before_the_specs_are_read(monkeypatch, argv, early):
    """The workers' forkserver imports torch and the engine (seconds, before any worker can
    start): started before the specs are read, that runs on another CPU meanwhile. Only a run
    that shares its rows among workers starts it."""
    from shardverify.cli import verify_jobs

    events = []
    monkeypatch.setattr(verify_jobs, "start_forkserver", lambda ctx, preload: events.append(("forkserver", preload)))
    monkeypatch.setattr(verify_cmd, "checked_op_specs", lambda args, what: events.append(("specs", what)))
    assert cli("sum", *argv, "--root", str(REPO)) == 2    # no specs: a usage error once they are read
    assert events == ([("forkserver", verify_jobs.WORKER_PRELOAD)] if early else []) + [("specs", "verify")]


KILLER = """
import os


class KillsItsProcess:
    \"\"\"A case whose build ends the process that builds it (an op crashing the interpreter).\"\"\"

    def build(self):
        os._exit(3)
"""


def test_a_row_that_kills_its_worker_fails_alone(tmp_path, monkeypatch):
    """Only the row that kills its worker fails, with the reason; the rows in flight beside it
    run again and pass, and every row keeps its place."""
    from shardverify.cli.verify_jobs import verify_rows_in_workers

    (tmp_path / "killer_case.py").write_text(KILLER)
    monkeypatch.syspath_prepend(str(tmp_path))   # the workers get this process's sys.path
    from killer_case import KillsItsProcess

    spec, = load_op_specs(REPO, None, ["sum"])
    (good_id, good), (other_id, other) = spec.op_cases()[:2]
    plan = [("sum", good_id, good, (2,)), ("sum", "killer", KillsItsProcess(), (2,)), ("sum", other_id, other, (2,)),
            ("sum", good_id, good, (4,))]
    rows = verify_rows_in_workers(plan, 2, device=None, timeout=60.0, progress=verify_cmd.Progress(0))
    assert [(r.case, r.mesh) for r in rows] == [(case_id, mesh) for _, case_id, _, mesh in plan]
    killed = rows[1]
    assert killed.failures == 1 and killed.verified == 0
    assert "its worker process died, also when it ran alone" in killed.error and "BrokenProcessPool" in killed.error
    for row in rows[:1] + rows[2:]:
        assert row.error == "" and row.failures == 0 and row.verified > 0, row


WITNESS = """
import os


class Witnessed:
    \"\"\"A case that writes which process builds it, and is otherwise the case it wraps.\"\"\"

    def __init__(self, case, log):
        self.case, self.log = case, log

    def __getattr__(self, name):   # never for dunders: unpickling probes them before __dict__ is set
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["case"], name)

    def build(self):
        with open(self.log, "a") as out:
            out.write(f"{os.getpid()}\\n")
        return self.case.build()
"""


def test_a_cases_rows_go_to_one_worker(tmp_path, monkeypatch):
    """Each case's rows on its meshes are verified by one worker process (which builds the
    case's trace, reference and seeds once for all of them), and still come back in plan order."""
    from shardverify.cli.verify_jobs import verify_rows_in_workers

    (tmp_path / "witness_case.py").write_text(WITNESS)
    monkeypatch.syspath_prepend(str(tmp_path))
    from witness_case import Witnessed

    spec, = load_op_specs(REPO, None, ["sum"])
    logs = {case_id: tmp_path / f"{case_id}.log" for case_id, _ in spec.op_cases()[:2]}
    plan = [("sum", case_id, Witnessed(case, logs[case_id]), mesh)
            for case_id, case in spec.op_cases()[:2] for mesh in ((2,), (4,), (2, 2))]
    rows = verify_rows_in_workers(plan, 2, device=None, timeout=60.0, progress=verify_cmd.Progress(0))
    assert [(r.case, r.mesh) for r in rows] == [(case_id, mesh) for _, case_id, _, mesh in plan]
    assert all(r.error == "" and r.verified > 0 for r in rows), rows
    for case_id, log in logs.items():
        builders = log.read_text().split()
        assert builders and len(set(builders)) == 1, (case_id, builders)


def test_a_case_group_is_the_run_of_its_rows_at_the_queues_front():
    from shardverify.cli.verify_jobs import _next_group

    plan = [("sum", "a", None, (2,)), ("sum", "a", None, (4,)), ("sum", "b", None, (2,)), ("mean", "a", None, (2,)),
            ("mean", "a", None, (4,)), ("sum", "a", None, (2, 2))]
    queue = list(range(len(plan)))
    groups = []
    while queue:
        groups.append(_next_group(plan, queue, {4}))
    assert groups == [[0, 1], [2], [3], [4], [5]]


def test_jobs_are_for_the_simulated_backend(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli("--jobs", "0")
    assert exit_info.value.code == 2
    assert "jobs '0' is not a positive number of processes or 'auto'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli("-j", "many")
    assert "jobs 'many' is not a positive number" in capsys.readouterr().err
    assert cli("sum", "--jobs", "2", "--backend", "gloo", "--root", str(REPO)) == 2
    assert "--jobs 2 shares rows among processes of simulated ranks; the gloo backend" in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal(capsys, monkeypatch):
    """The progress line is drawn in place on a terminal's stderr, and nothing is written to a
    stderr that is not one (a pipe, CI, this test's capture)."""
    assert cli("sum", "--mesh", "4", "--root", str(REPO)) == 0
    assert capsys.readouterr().err == ""
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli("sum", "--mesh", "4", "--root", str(REPO)) == 0
    drawn = terminal.getvalue()
    assert drawn.startswith("\r[") and "/16 " in drawn and "ETA" in drawn and "sum torch.sum-dim_1" in drawn
    assert drawn.endswith("\r") and "\n" not in drawn     # erased before the report, on stdout
    assert capsys.readouterr().out.startswith("PASS  ")


def test_python_dash_m_entry_point(tmp_path):
    """`python -m shardverify verify` works from the CPU default with nothing else running."""
    specs = tmp_path / "specs"
    specs.mkdir()
    shutil.copy(REPO / "specs" / "sum.yaml", specs / "sum.yaml")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "shardverify", "verify", "--specs-dir", str(specs),
                           "--root", str(REPO), "--mesh", "4", "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["passed"] is True


def test_the_command_line_runs_with_the_collector_thresholds_of_a_checking_process():
    """A check's short-lived objects reached the old generation under the default thresholds,
    and full collections took 15% of `shardverify verify` (see shardverify.backends.gc_policy)."""
    script = ("import gc, sys\n"
              "from shardverify.cli.main import main\n"
              "before = gc.get_threshold()\n"
              "try:\n    main(['verify', '--help'])\nexcept SystemExit:\n    pass\n"
              "print(before, gc.get_threshold(), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    from shardverify.backends.gc_policy import CHECKING_THRESHOLDS

    assert done.stderr.strip().splitlines()[-1] == f"(700, 10, 10) {CHECKING_THRESHOLDS}", done.stderr


@pytest.mark.parametrize("given", [None, "0"])
def test_the_command_line_asks_for_huge_pages_for_large_tensors_unless_told_otherwise(given):
    """A fresh 32 MiB copy faulted 8,194 times on 4 KiB pages, 529 on huge ones: most of a check's
    CPU time at large shapes (see shardverify.backends.allocator). A user's own setting stands."""
    from shardverify.backends.allocator import HUGE_PAGES

    script = ("import os, sys\n"
              "from shardverify.cli.main import main\n"
              "try:\n    main(['verify', '--help'])\nexcept SystemExit:\n    pass\n"
              f"print(os.environ.get({HUGE_PAGES!r}), file=sys.stderr)\n")
    env = {k: v for k, v in os.environ.items() if k != HUGE_PAGES} | ({HUGE_PAGES: given} if given else {})
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.stderr.strip().splitlines()[-1] == (given or ("1" if sys.platform == "linux" else "None")), done.stderr
