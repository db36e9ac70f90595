"""The accepted file by root cause, each finding's culprit and severity, and the gate that
watches every known DTensor fault (shardverify/features/dtensor/accepted.py, rootcause.py, gate.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from shardverify.cli.main import main
from shardverify.features.dtensor.accepted import load_accepted
from shardverify.features.dtensor.execute import _first_mismatch
from shardverify.features.dtensor.gate import gone_causes, run_repros
from shardverify.features.dtensor.report import new_classes, silent_restated
from shardverify.features.dtensor.rootcause import culprit_of, fine_key, severity_of
from shardverify.features.dtensor.run import CaseResult
from shardverify.features.dtensor.verdicts import Finding
from shardverify.errors import SpecError
from shardverify.verify.tolerance import Tolerance

ROOT = Path(__file__).resolve().parent.parent
CUSTOM = ROOT / "tests" / "dtensor_custom"
KEY = "cumsum forward input=S(2)"
CULPRIT = "forward rule of aten.cumsum.default (forward)"


def _finding(detail="output 0 [S(2)]: rank 0 differs from the reference (max abs error 3.1)", culprit=CULPRIT,
             op="cumsum", klass="silent-wrong") -> Finding:
    return Finding(op, "c", (4,), (("input", "[R, R, S0]"),), (("input", "[S(2)]"),), klass, "forward", detail,
                   "aten.cumsum.default: rule runs locally -> [S(2)]", "", "none", "",
                   culprit=f"{culprit}: inputs [S(2)] -> output [S(2)]" if culprit else "")


def _results(*findings) -> list[CaseResult]:
    return [CaseResult(f.op, "c", (4,), 1, 1, findings=[f]) for f in findings]


def _file(tmp_path, body: str, name="accepted.yaml") -> Path:
    path = tmp_path / name
    path.write_text("torch: 2.13.0\naccepted:\n" + body)
    return path


ENTRY = f"""  - slug: cumsum-negative-dim
    reason: the scan rule does not normalise a negative dim
    culprits: ["{CULPRIT}"]
    severity: [wrong values]
    classes: 1
    keys: ["{KEY}"]
"""


def test_a_finding_names_its_culprit_and_severity_and_a_second_fault_under_a_known_key_is_new(tmp_path):
    accepted = load_accepted(_file(tmp_path, ENTRY))
    known = _finding()
    assert culprit_of(known) == CULPRIT and severity_of(known) == "wrong values"
    assert new_classes(_results(known), accepted) == []
    # the same key, another fault: a wrong shape, or another op at fault
    shape = _finding("output 0 [S(2)]: rank 0 holds shape (2, 3), the reference (2, 6)")
    other = _finding(culprit="runtime of aten.cumsum.default (forward)")
    assert severity_of(shape) == "wrong shape"
    assert [fine_key(f) for f in new_classes(_results(shape, other), accepted)] == [
        f"{KEY} [{CULPRIT}; wrong shape]", f"{KEY} [runtime of aten.cumsum.default (forward); wrong values]"]
    # without its attribution the culprit is read from the call's rule: the same
    assert culprit_of(_finding(culprit="")) == CULPRIT


def test_a_low_precision_output_within_a_few_ulps_is_rounding_not_corruption(tmp_path):
    expected = torch.linspace(-3.0, 3.0, 40, dtype=torch.float64)
    rounded = (expected + 0.0015).to(torch.float16)             # ~1 float16 ulp at 3.0 (0.00195)
    said = _first_mismatch({0: rounded}, expected, Tolerance(1e-9, 1e-9))
    assert "float16 ulps of its largest value" in said
    far = _first_mismatch({0: (expected + 0.05).to(torch.float16)}, expected, Tolerance(1e-9, 1e-9))
    assert far and "ulps" not in far
    rounding = _finding(f"output 0 [P(sum)]: {said}")
    assert severity_of(rounding) == "rounding"
    accepted = load_accepted(_file(tmp_path, ENTRY))
    assert new_classes(_results(dataclasses.replace(rounding, op="to_copy")), accepted) == []   # never gated
    restated = silent_restated(_results(_finding(), rounding))
    assert restated.startswith("Silent corruption: 1 combinations in 1 classes") and "rounding and not counted" in restated


@pytest.mark.parametrize("body, message, line", [
    (ENTRY.replace("classes: 1", "classes: 2"), "says 2 classes, but 'keys' lists 1", 7),
    (ENTRY + ENTRY.replace(KEY, "cumsum forward input=S(1)"), "root cause 'cumsum-negative-dim' is listed twice", 9),
    (ENTRY.replace("[wrong values]", "[wrong]"), "a severity is one of", 6),
    (ENTRY.replace("    classes: 1\n", ""), "needs 'classes'", 3),
    (ENTRY.replace("slug: cumsum-negative-dim", "slug: Cumsum Dim"), "a slug is lower-case words", 3),
    (ENTRY.replace("    classes: 1\n", "    classes: 1\n    repros: [../outside.py]\n"), "inside the repository", 8),
    (ENTRY.replace(f'["{KEY}"]', "[]").replace("classes: 1", "classes: 0"), "needs 'repros'", 8),
])
def test_the_loader_checks_every_entry_naming_file_line_and_field(tmp_path, body, message, line):
    with pytest.raises(SpecError, match=message) as raised:
        load_accepted(_file(tmp_path, body))
    assert f"accepted.yaml:{line}" in str(raised.value)


def test_the_projects_accepted_file_loads_one_entry_per_root_cause_with_slugs():
    accepted = load_accepted(ROOT / "specs" / "dtensor" / "accepted.yaml")
    slugs = [c.slug for c in accepted.causes]
    assert all(slugs) and len(set(slugs)) == len(slugs)
    pages = {p.stem for p in (ROOT / "docs" / "upstream").glob("*.md")} - {"README"}
    assert pages <= set(slugs)          # every upstream page is a root cause, watched by its repro
    assert all(accepted.causes[slugs.index(p)].repros for p in pages)


STAND_IN = {"reproduces.py": "import sys\nsys.exit(1)\n", "fixed.py": "print('right now')\n",
            "broken.py": "raise RuntimeError('no such API')\n"}


def test_a_repro_that_stops_reproducing_or_is_missing_fails_the_gate(tmp_path):
    for name, text in STAND_IN.items():
        (tmp_path / name).write_text(text)
    body = ENTRY.replace("    classes: 1\n", "    classes: 1\n    repros: [reproduces.py, fixed.py, broken.py, gone.py]\n")
    runs = run_repros(load_accepted(_file(tmp_path, body)), tmp_path, timeout=60)
    assert [r.status for r in runs] == ["reproduces", "stops reproducing", "error", "missing"]
    assert not runs[0].failed and all(r.failed for r in runs[1:])
    assert "STOPS REPRODUCING (exit 0): fixed upstream? retire the entry" in runs[1].line()
    assert "no such API" in runs[2].line() and "MISSING: no such file" in runs[3].line()
    assert "accepted.yaml:3 (repros)" in runs[3].line()


def test_a_root_cause_whose_classes_are_all_gone_fails_the_gate_and_one_not_run_is_not_judged(tmp_path):
    accepted = load_accepted(_file(tmp_path, ENTRY))
    assert gone_causes(_results(_finding()), accepted) == []
    other_op = _results(dataclasses.replace(_finding(), op="cummax"))
    assert gone_causes(other_op, accepted) == []                 # cumsum not run: not judged
    ran_clean = [CaseResult("cumsum", "c", (4,), 3, 3)]
    [line] = gone_causes(ran_clean, accepted)
    assert line.startswith("root cause cumsum-negative-dim (") and "fixed upstream? retire the entry" in line


def test_removing_any_root_cause_the_gate_watches_fails_it():
    """Over the stored results of the ops CI's gate runs: the project's file passes them, and a
    copy without any one of the root causes found there fails on its classes."""
    from shardverify.cli.catalogue import load_op_specs
    from shardverify.features.dtensor.accepted import Accepted
    from shardverify.features.dtensor.stored_results import stored_results

    ops = ["cumsum", "select", "flatten", "view"]
    specs = load_op_specs(ROOT, None, ops)
    results, _ = stored_results(ROOT / "results" / "dtensor", specs, [(4,), (2, 2), (2, 3)], None, ROOT)
    accepted = load_accepted(ROOT / "specs" / "dtensor" / "accepted.yaml")
    assert new_classes(results, accepted) == [] and gone_causes(results, accepted) == []
    watched = [c for c in accepted.causes if any(k.split(" ")[0] in ops for k in c.keys)]
    assert {"cumsum-negative-dim", "select-backward-negative-dim", "flatten-backward"} <= {c.slug for c in watched}
    for cause in watched:
        rest = tuple(c for c in accepted.causes if c is not cause)
        without = Accepted({k: r for k, r in accepted.reasons.items() if k not in cause.keys}, accepted.torch, rest)
        assert new_classes(results, without), cause.slug


def test_the_command_with_gate_fails_when_a_listed_repro_starts_passing(tmp_path, capsys):
    spec = str(CUSTOM / "row_normalize_bad.yaml")
    (tmp_path / "still.py").write_text(STAND_IN["reproduces.py"])
    (tmp_path / "fixed.py").write_text(STAND_IN["fixed.py"])
    key = "svtest::row_normalize_bad forward x=S(1)"
    entry = f"  - slug: row-normalize-block-sum\n    reason: planted\n    classes: 1\n    repros: [{{}}]\n    keys: [\"{key}\"]\n"
    argv = ["dtensor", "--custom", spec, "--mesh", "4", "--quiet", "--gate", "--root", str(tmp_path), "--accepted"]
    assert main([*argv, str(_file(tmp_path, entry.format("still.py")))]) == 0
    assert "gate: 1 root cause(s) watched on the ops run; 1 of 1 repro(s) reproduce" in capsys.readouterr().out
    assert main([*argv, str(_file(tmp_path, entry.format("fixed.py")))]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL") and "gate: row-normalize-block-sum: fixed.py: STOPS REPRODUCING" in out
