"""docs/upstream/: one page per DTensor bug, each with a torch-only repro that `shardverify
dtensor --upstream` re-runs in this process on the installed torch, saying which are fixed."""

from __future__ import annotations

from pathlib import Path

import torch

from shardverify.cli.main import main
from shardverify.features.dtensor.upstream import load_reports

ROOT = Path(__file__).resolve().parent.parent


def test_every_upstream_report_still_reproduces_on_the_installed_torch(capsys):
    reports = load_reports(ROOT / "docs" / "upstream")
    assert {r.name for r in reports} >= {"conv2d-runtime-redistribution", "cumsum-negative-dim",
                                         "select-backward-negative-dim", "flatten-backward", "view-strided-shard",
                                         "einsum-strided-shard", "embedding-mask-axis-order"}
    assert all("shardverify" not in r.script for r in reports)     # torch alone
    assert main(["dtensor", "--upstream", "--root", str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert "ERROR" not in out
    if torch.__version__.startswith("2.13."):   # the version the pages were written on: every bug present
        assert out.count("still wrong  ") == len(reports) and "FIXED" not in out


def _page(folder: Path, name: str, body: str) -> None:
    (folder / f"{name}.md").write_text(f"# {name}\n\n## Repro\n\n```python\n{body}\n```\n")


def test_a_fixed_report_is_said_fixed_and_a_broken_one_is_an_error(tmp_path, capsys):
    _page(tmp_path, "fixed", "import sys\nprint('rank 0: right')\nsys.exit(0)")
    _page(tmp_path, "wrong", "import sys\nsys.exit(1)")
    _page(tmp_path, "broken", "raise ValueError('no such placement')")
    assert main(["dtensor", "--upstream", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FIXED        fixed" in out and "still wrong  wrong" in out and "ERROR        broken" in out
    assert "ValueError: no such placement" in out and "1 error, 1 fixed, 1 still wrong" in out
    (tmp_path / "nothing.md").write_text("# no repro here\n")
    assert main(["dtensor", "--upstream", str(tmp_path)]) == 2
    assert "nothing.md: no repro" in capsys.readouterr().err
