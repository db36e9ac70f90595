"""The Markdown reports of `shardverify audit --markdown [--dtensor]`: one row per op and mesh,
and the DTensor comparison's disagreements with who the numerical check says is right."""

from __future__ import annotations

from collections import Counter

from shardverify.features.dtensor.propagation import Disagreement, DTensorReport
from shardverify.features.audit.report import markdown_report
from shardverify.features.dtensor.propagation_report import dtensor_markdown
from shardverify.features.audit.run import CaseAudit, Finding


def _row(case: str, mesh: tuple[int, ...], offered: int, valid: int, accepted: int = 0, masked: int = 0) -> CaseAudit:
    row = CaseAudit("mm", case, mesh, offered=offered, valid=valid, covered=offered - masked, masked=masked)
    row.accepted = [Finding("missing", f"line {i}", accepted="specs/mm.yaml:9: a reason") for i in range(accepted)]
    return row


def test_the_audit_report_has_one_row_per_op_and_mesh_summed_over_cases():
    rows = [_row("a", (4,), 2, 3, 1), _row("b", (4,), 2, 2), _row("a", (2, 2), 5, 9, 4, masked=1)]
    lines = markdown_report(rows).splitlines()
    assert "| mm | 4 | 2 | 4 | 5 | 4 | 0 | 0 | 0 | 1 | 0 |" in lines
    assert "| mm | 2x2 | 1 | 5 | 9 | 4 | 1 | 0 | 0 | 4 | 0 |" in lines
    assert "- 5 x specs/mm.yaml:9: a reason" in lines


def test_the_dtensor_report_counts_agreements_and_names_who_is_right():
    agreeing = DTensorReport("mm", "a", (4,), Counter({"agree: same output": 3, "agree: invalid": 2,
                                                       "DTensor error": 1, "DTensor output strided": 2,
                                                       "not expressible in DTensor": 4}))
    wrong = Disagreement("dtensor-error", "input=[R, S01]", "[R, S01]", "error: RuntimeError: no", "shardverify")
    claims = Disagreement("dtensor-wrong", "input=[S0, S0]", "invalid (no layout)", "[R, R]", "shardverify")
    disagreeing = DTensorReport("mm", "a", (2, 2), Counter({"agree: same output": 1, "DTensor error": 1,
                                                            "DTensor wrong": 1}), [wrong, claims], note="")
    text = dtensor_markdown([agreeing, disagreeing])
    lines = text.splitlines()
    assert "| mm | 4 | 8 | 3 | 2 | 0 | 1 | 2 | 4 |  |" in lines
    assert "| mm | 2x2 | 3 | 1 | 0 | 2 | 0 | 0 | 0 |  |" in lines
    assert "- 1 x DTensor raises on a valid combination (shardverify right in 1), e.g." in lines
    assert any(line.startswith("- 1 x DTensor runs a combination that is invalid without communication")
               for line in lines)
    assert "`input=[R, S01]`" in text and "DTensor `error: RuntimeError: no`" in text


def test_markdown_with_dtensor_prints_both_tables(capsys):
    from pathlib import Path

    from shardverify.cli.main import main

    repo = Path(__file__).resolve().parents[1]
    code = main(["audit", "relu", "--root", str(repo), "--mesh", "4", "--markdown", "--dtensor"])
    out = capsys.readouterr().out
    assert code == 0
    audit_table, _, dtensor_table = out.partition("DTensor comparison")
    assert any(line.startswith("| relu | 4 | ") for line in audit_table.splitlines())
    rows = [line for line in dtensor_table.splitlines() if line.startswith("| relu | 4 | ")]
    assert len(rows) == 1 and rows[0].split(" | ")[5] == "0", rows   # relu: no disagreement
