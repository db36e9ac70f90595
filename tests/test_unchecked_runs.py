"""No pass without a check: a run that sharded nothing, or that a time budget cut short, says so
and is no pass unless the user asks for a pass on a sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardverify.cli.main import main

REPO = Path(__file__).resolve().parents[1]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.mark.parametrize("command", ["verify", "audit"])
@pytest.mark.parametrize("mesh", ["1", "1,1"])
def test_a_mesh_of_one_rank_is_refused_in_one_line(capsys, command, mesh):
    """On one rank nothing is sharded and no collective runs: every strategy "passed"."""
    code, out, err = run(capsys, command, "sum", "--mesh", "4", "--mesh", mesh, "--root", str(REPO))
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"error: --mesh {mesh} has one rank: nothing is sharded on it, so nothing "
                                        "would be checked; give a mesh of 2 or more ranks"]


def test_a_plan_on_a_mesh_of_one_rank_is_refused_in_one_line(capsys):
    code, out, err = run(capsys, "plan", "shardverify.plan.zoo.linear_chain", "--input", "8,32", "--mesh", "1")
    assert code == 2 and "--mesh 1 has one rank: nothing is sharded on it" in err
    assert len(err.strip().splitlines()) == 1 and "PASS" not in out


def _saved(tmp_path: Path, note: str) -> Path:
    """A saved `dtensor --json` run whose one case the budget cut after 3 of 10 combinations."""
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"results": [
        {"op": "sum", "case": "c", "mesh": [4], "combinations": 10, "executed": 3,
         "counts": {"agrees": 2, "too-slow": 1}, "note": note, "seconds": 0.1, "findings": []}]}))
    return saved


CUT = "DTensor took over 20 s of CPU time on input=[R]; the case's other 7 chosen combination(s) not executed"


def test_a_run_the_budget_cut_short_says_what_it_skipped_and_is_no_pass(capsys, tmp_path):
    accepted = str(REPO / "specs/dtensor/accepted.yaml")
    code, out, _ = run(capsys, "dtensor", "--from-json", str(_saved(tmp_path, CUT)), "--accepted", accepted)
    assert code == 1 and out.startswith("FAIL  ") and "PASS" not in out
    assert "8 combination(s) skipped by the time budget" in out        # the slow one and the 7 after it
    assert "not checked: sum c on [4]: 8 combination(s) skipped by the time budget" in out
    code, out, _ = run(capsys, "dtensor", "--from-json", str(_saved(tmp_path, CUT)), "--accepted", accepted,
                       "--sample-passes")
    assert code == 0 and out.startswith("PASS  ") and "8 combination(s) skipped by the time budget" in out


def test_a_slow_last_combination_is_still_one_skipped(capsys, tmp_path):
    code, out, _ = run(capsys, "dtensor", "--from-json", str(_saved(tmp_path, "")), "--accepted",
                       str(REPO / "specs/dtensor/accepted.yaml"))
    assert code == 1 and "1 combination(s) skipped by the time budget" in out


def test_an_op_spec_listing_a_mesh_of_one_rank_is_refused_naming_it(capsys, tmp_path):
    (tmp_path / "specs").mkdir()
    text = (REPO / "specs/sum.yaml").read_text()
    assert "  meshes:\n    - [2, 2]\n    - [4]\n" in text
    (tmp_path / "specs" / "sum.yaml").write_text(text.replace("    - [4]\n", "    - [1, 1]\n", 1))
    code, out, err = run(capsys, "list", "--root", str(tmp_path))
    assert code == 2 and "field 'verify.meshes[1]': mesh [1, 1] has one rank: nothing is sharded on it" in out + err
