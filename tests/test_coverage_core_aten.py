"""`shardverify coverage --core-aten`: every Core ATen overload of the pinned torch is listed with
its spec, a stated reason or "no spec yet", none silently missing; a stale reasons file is an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardverify.cli.main import main
from shardverify.features.coverage.core_aten import NO_SPEC, REASON, SERVED, catalogue, core_overloads
from shardverify.errors import SpecError

ROOT = Path(__file__).resolve().parent.parent


def test_every_core_overload_is_listed_once_with_its_status(capsys):
    assert main(["coverage", "--core-aten", "--json", "--root", str(ROOT)]) == 0
    report = json.loads(capsys.readouterr().out)
    listed = [o["overload"] for p in report["packets"] for o in p["overloads"]]
    core = [name for names in core_overloads().values() for name in names]
    assert sorted(listed) == sorted(core) and len(set(listed)) == len(listed)
    totals = report["totals"]
    assert totals["all"]["packets"] == len(core_overloads()) >= 160
    assert sum(totals[k]["overloads"] for k in (SERVED, REASON, NO_SPEC)) == totals["all"]["overloads"]
    by_name = {o["overload"]: o for p in report["packets"] for o in p["overloads"]}
    assert by_name["aten.neg.default"]["specs"] == ["specs/neg.yaml"]
    assert by_name["aten.nonzero.default"]["status"] == REASON
    assert "data-dependent" in by_name["aten.nonzero.default"]["reason"]


def test_the_text_report_ends_with_the_totals(capsys):
    assert main(["coverage", "--core-aten", "--root", str(ROOT)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"{len(core_overloads())} packets" in last and "accounted for" in last


@pytest.mark.parametrize("entry, message", [
    ("[aten.not_an_op.default]", "is not a Core ATen overload"),
    ("[aten.neg.default]", "served by specs/neg.yaml"),
    ("[aten.nonzero.default, aten.nonzero.default]", "listed twice"),
])
def test_a_stale_reasons_file_is_an_error_naming_its_line(tmp_path, entry, message):
    path = tmp_path / "core_aten.yaml"
    path.write_text(f"unverifiable:\n  - reason: because\n    overloads: {entry}\n")
    with pytest.raises(SpecError, match=message) as info:
        catalogue([("specs/neg.yaml", ("torch.ops.aten.neg.default",))], path)
    assert "core_aten.yaml:3" in str(info.value)
