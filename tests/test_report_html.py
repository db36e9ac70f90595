"""The HTML pages without a browser: one self-contained file (nothing fetched), names from a run
escaped, the verdict first, a failing strategy's layouts and errors drawn where they are, a plan's
graph with its resharding edges, a DTensor run's classes marked accepted or new."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from shardverify import DeviceMesh
from shardverify.backends import SimulatedBackend
from shardverify.cli.verify_rows import Row
from shardverify.features.dtensor.accepted import Accepted
from shardverify.features.dtensor.run import CaseResult
from shardverify.features.dtensor.verdicts import Finding
from shardverify.features.report.dtensor_page import dtensor_page
from shardverify.features.report.markdown import markdown_html
from shardverify.features.report.page import render, write
from shardverify.features.report.verify_page import verify_page
from shardverify.verify.engine import verify_case
from shardverify.verify.error_map import keep_error_maps

from test_verify_broken import LINEAR, generated, wrong_output_layout

#: anything that would make a browser fetch: a source, a stylesheet, a web font, a remote link
FETCHES = re.compile(r"""\bsrc\s*=|<link\b|@import|url\(\s*(?!['"]?#)|href\s*=\s*(?!['"]?#)""", re.I)


def failing_row() -> tuple[Row, set[int]]:
    """linear on (2, 2) with its output claimed in the wrong layout: only the ranks whose output
    block moved are wrong."""
    mesh = DeviceMesh((2, 2))
    broken, moved = next(iter(wrong_output_layout(generated(LINEAR, mesh), mesh)))
    with keep_error_maps():
        results = verify_case(SimulatedBackend(mesh), LINEAR, [broken])
    return Row("linear", "Linear(16, 32)", (2, 2), 1, 1, 0.5, results=results), moved


def test_a_failing_strategy_is_first_with_its_layouts_and_each_wrong_rank_drawn(tmp_path):
    row, moved = failing_row()
    result, = row.results
    assert not result.passed
    page = verify_page([row], "simulated", 0.5)
    assert page.passed is False and page.culprit.startswith(f"linear: strategy {result.strategy!r}")
    html = render(page)
    assert not FETCHES.search(html)
    for name, _ in result.checked.sharding_specs:
        assert f'aria-label="layout of {name}"' in html
    drawn = {int(r) for r in re.findall(r'aria-label="error of rank (\d+) in output"', html)}
    assert drawn == {m.rank for m in result.mismatches if m.kind == "values" and m.tensor == "output"}
    assert drawn and drawn <= moved
    assert html.index("Failing strategies") < html.index("Every case and mesh")
    write(page, tmp_path / "page.html")
    assert (tmp_path / "page.html").read_text() == html


def test_names_from_a_run_are_text_never_markup():
    row, _ = failing_row()
    row.op, row.case = "<script>alert(1)</script>", 'x" onmouseover="alert(1)'
    html = render(verify_page([row], "simulated", 0.5, title="<b>t</b>"))
    assert "<script>" not in html and 'x" onmouseover' not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "&lt;b&gt;t&lt;/b&gt;" in html


def test_a_passing_run_says_so_and_a_run_that_checked_nothing_does_not_pass():
    assert verify_page([Row("sum", "c", (4,), results=[])], "simulated", 0.1).passed is False
    row, _ = failing_row()
    ok = Row("linear", "c", (2, 2), 1, 0, 0.1,
             results=[r.__class__(r.op, r.case, r.strategy, r.mesh_shape, r.backend, r.dtype) for r in row.results])
    page = verify_page([ok], "simulated", 0.1)
    assert page.passed is True and page.culprit == "" and "Failing strategies" not in render(page)


def finding(case: str, placement: str) -> Finding:
    return Finding("cumsum", case, (4,), (("input", "[S0]"),), (("input", placement),), "silent-wrong", "forward",
                   "output 0: rank 0 differs", "rule runs locally", "", "none", "", repro="import torch\nprint(1)\n")


def test_a_dtensor_page_marks_each_class_accepted_or_new_and_links_it():
    results = [CaseResult("cumsum", "dim_-1", (4,), 5, 5, Counter({"agrees": 3, "silent-wrong": 2}),
                          [finding("dim_-1", "[S(2)]"), finding("dim_-1", "[S(0)]")])]
    old = finding("dim_-1", "[S(2)]").key()
    page = dtensor_page(results, Accepted({old: "cumsum's rule does not normalise a negative dim"}), False, 1.0,
                        "shardverify dtensor cumsum")
    html = render(page)
    assert page.culprit.startswith("new class cumsum forward input=S(0)")
    assert "cumsum&#x27;s rule does not normalise a negative dim" in html and html.count('class="tag fail"') == 1
    anchors = set(re.findall(r'id="(class-[^"]+)"', html))
    assert len(anchors) == 2 and anchors == set(re.findall(r'href="#(class-[^"]+)"', html))
    assert "import torch" in html and not FETCHES.search(html)


def test_markdown_is_escaped_and_links_only_go_to_anchors_or_the_web():
    html = markdown_html("# Head\n\n| a | b |\n|---|---|\n| `<x>` | [y](javascript:alert(1)) |\n\n- [z](#k)\n")
    assert "<h2>Head</h2>" in html and "<code>&lt;x&gt;</code>" in html
    assert "javascript:" in html and 'href="javascript' not in html and '<a href="#k">z</a>' in html



def test_plan_writes_its_page_and_a_folder_for_a_page_is_refused_before_the_run(tmp_path, capsys):
    from shardverify.cli.main import main

    spec = str(Path(__file__).resolve().parents[1] / "specs" / "plans" / "linear_chain.yaml")
    assert main(["plan", spec, "--html", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    page = tmp_path / "deeper" / "plan.html"
    assert main(["plan", spec, "--html", str(page)]) == 0
    out = capsys.readouterr()
    html = page.read_text()
    assert out.out.splitlines()[0].startswith("PASS") and f"report: {page}" in out.err
    assert 'aria-label="the model graph"' in html and "fc1" in html and not FETCHES.search(html)
    assert html.count("<svg") >= 3   # the graph and the layouts of the sharded nodes


def test_a_dtensor_page_shows_each_root_causes_severity_and_a_culprit_it_does_not_list_as_new(tmp_path):
    from shardverify.features.dtensor.accepted import load_accepted

    def silent(placement: str, culprit: str) -> Finding:
        return Finding("cumsum", "dim_-1", (4,), (("input", "[S0]"),), (("input", placement),), "silent-wrong",
                       "forward", "output 0: rank 0 differs from the reference (max abs error 7.3)", "", "", "none", "",
                       culprit=culprit)
    rule = "forward rule of aten.cumsum.default (forward): inputs [S(2)] -> output [S(2)], wrong by 7.3"
    other = "forward rule of aten.add.Tensor (forward): inputs [S(0)] -> output [S(0)], wrong by 1.0"
    results = [CaseResult("cumsum", "dim_-1", (4,), 5, 5, Counter({"agrees": 3, "silent-wrong": 2}),
                          [silent("[S(2)]", rule), silent("[S(0)]", other)])]
    path = tmp_path / "accepted.yaml"
    path.write_text('accepted:\n  - slug: cumsum-negative-dim\n    reason: "the scan rule keeps a negative dim"\n'
                    '    culprits: ["forward rule of aten.cumsum.default (forward)"]\n    severity: [wrong values]\n'
                    '    classes: 2\n    keys: ["cumsum forward input=S(2)", "cumsum forward input=S(0)"]\n')
    html = render(dtensor_page(results, load_accepted(path), False, 1.0, "shardverify dtensor cumsum"))
    causes = html[html.index("Root causes and severity"):html.index("Classes of wrong results")]
    assert "cumsum-negative-dim" in causes and "wrong values" in causes and "wrong shape" in causes
    assert html.count("<b>severity</b>: wrong values (1) (its entry lists: wrong values)") == 2
    assert html.count("<b>root cause</b>: cumsum-negative-dim") == 2
    # the second class's culprit is not its entry's: a second fault under a known key, new
    assert html.count('class="tag fail"') == 1 and "not with this culprit or severity" in html
