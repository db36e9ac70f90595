"""`shardverify verify`: the table, --json, the exit status, and failures that must surface."""

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
    spec, = verify_cmd.load_op_specs(REPO, None, ["sum"])
    cases = spec.op_cases()
    assert [row["case"] for row in report["rows"]] == [case_id for case_id, _ in cases]
    for row, (_, case) in zip(report["rows"], cases):
        graph_module, node_name = case.build()
        names = [s.name for s in strategies_for_node(graph_module, node_name, DeviceMesh((4,)))]
        assert row["mesh"] == [4] and row["verified"] == len(names) > 0
        assert [check["strategy"] for check in row["checks"]] == names
        assert all(check["passed"] for check in row["checks"])
    assert report["strategies"] == sum(row["verified"] for row in report["rows"])


def test_table_has_one_row_per_case_and_mesh(capsys):
    assert cli("sum", "--mesh", "2,2", "--mesh", "4", "--root", str(REPO)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["op", "case", "mesh", "strategies", "failures", "time"]
    rows = [line.split() for line in out[2:] if line.startswith("sum ")]
    assert len(rows) == 2 * len(verify_cmd.load_op_specs(REPO, None, ["sum"])[0].op_cases())
    assert {row[2] for row in rows} == {"2x2", "4"} and {row[4] for row in rows} == {"0"}
    assert out[-1].startswith("passed: ") and "0 failure(s)" in out[-1]


def test_a_broken_communication_layer_fails_the_run(capsys, monkeypatch):
    """Gradient hooks that do nothing: exactly the linear strategies that declare a gradient
    hook must fail, be counted in the table, reported in full, and the exit status is 1."""
    from shardverify.sharding.strategy import CommWhere
    from shardverify.verify import rank

    monkeypatch.setattr(rank, "grad_hook_on_ranks", lambda ranks, action, grads: grads)
    assert cli("linear", "--mesh", "4", "--root", str(REPO)) == 1
    out = capsys.readouterr().out
    failures = {row[1]: int(row[4]) for row in map(str.split, out.splitlines()) if row and row[0] == "linear"}
    expected = {}
    for case_id, case in verify_cmd.load_op_specs(REPO, None, ["linear"])[0].op_cases():
        graph_module, node_name = case.build()
        expected[case_id] = sum(any(a.where is CommWhere.HOOK for a in s.communication_actions)
                                for s in strategies_for_node(graph_module, node_name, DeviceMesh((4,))))
    assert failures == expected and sum(expected.values()) > 0
    assert "FAILED" in out and "grad of weight" in out and "rank 0" in out
    assert out.rstrip().splitlines()[-1].startswith("FAILED: ")


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

    spec, = verify_cmd.load_op_specs(REPO, None, ["sum"])
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


def test_progress_only_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal, pipe = Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        progress = verify_cmd.Progress(4, stream)
        progress.step()
        progress.show("sum case")
        progress.close()
    assert "1/4 sum case" in terminal.getvalue() and pipe.getvalue() == ""


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
