"""A spec names only what may run (issues 47 and 50): factories allowed by what they are, never
denied by name; re-reporting imports nothing; trusted targets matched by object; no module a
target names imported while specs are read; torch's settings refused as targets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from shardverify.cli.main import main
from shardverify.errors import InvalidArgument
from shardverify.spec.allow import call_factory, name_refusal, object_refusal
from shardverify.spec.fields import resolve_target
from shardverify.spec.loader import Node
from shardverify.spec.trust import op_target_refusal

PLAN = "name: evil\nmodel:\n  factory: {factory}\n  kwargs: {kwargs}\ninputs: {{x: [4, 8]}}\nmesh: [2]\nplans:\n  solver: solver\n"


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out + err


@pytest.mark.parametrize("factory, kwargs", [
    ("timeit.timeit", "{{stmt: \"open({marker!r}, 'w').close()\"}}"),
    ("cProfile.run", "{{statement: \"open({marker!r}, 'w').close()\"}}"),
    ("pydoc.pipepager", "{{text: hi, cmd: 'touch {marker}'}}"),
])
def test_a_standard_library_factory_is_refused_before_any_call(tmp_path, capsys, factory, kwargs):
    """Each of these ran the spec's code before (a deny list of modules missed them): refused by
    `list` (reading) and by `plan` (before the import and the call), the rule in the message."""
    marker = tmp_path / "marker"
    (tmp_path / "specs" / "plans").mkdir(parents=True)
    path = tmp_path / "specs" / "plans" / "evil.yaml"
    path.write_text(PLAN.format(factory=factory, kwargs=kwargs.format(marker=str(marker))))
    code, text = _run(capsys, "list", "--root", str(tmp_path))
    assert code == 2 and "evil.yaml:3: field 'model.factory'" in text and "outside the project" in text, text
    code, text = _run(capsys, "plan", str(path), "--backend", "simulated")
    assert code == 2 and "torch.nn.Module class" in text and "SHARDVERIFY_TRUSTED_TARGETS" in text, text
    with pytest.raises(InvalidArgument, match="outside the project"):
        call_factory(factory, {"cmd": f"touch {marker}"}, tmp_path)
    assert not marker.exists()


def test_an_alias_in_a_project_module_is_judged_where_it_is_defined(tmp_path, monkeypatch):
    """`from pydoc import pipepager` in the project's own module: the name passes, the object does
    not (defined in pydoc); a project function and a torch.nn.Module class are allowed."""
    marker = tmp_path / "marker"
    (tmp_path / "proj_alias.py").write_text("from pydoc import pipepager\nimport torch\n\n"
                                            "def make():\n    return torch.nn.Linear(2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "proj_alias", raising=False)
    assert name_refusal("proj_alias.make", tmp_path) == ""
    assert isinstance(call_factory("proj_alias.make", {}, tmp_path), torch.nn.Linear)
    with pytest.raises(InvalidArgument, match="defined in 'pydoc'"):
        call_factory("proj_alias.pipepager", {"text": "hi", "cmd": f"touch {marker}"}, tmp_path)
    assert not marker.exists()
    assert object_refusal("torch.nn.Linear", torch.nn.Linear, tmp_path) == ""
    assert "outside the project" in name_refusal("proj_alias.make", tmp_path / "elsewhere")


def test_re_reporting_a_custom_run_imports_nothing(tmp_path, capsys):
    """`dtensor --custom FILE --from-json SAVED` needs none of the custom module; a module that is
    not the spec's own (a standard-library one) is never imported for a run either."""
    marker = tmp_path / "imported"
    (tmp_path / "sv_trap_rules.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    spec = tmp_path / "custom.yaml"
    spec.write_text("op: svtrap::op\nimport: sv_trap_rules\ninputs:\n  x: {dtype: float64}\n"
                    "cases:\n  - {x: [4]}\nmeshes: [[2]]\n")
    saved = tmp_path / "saved.json"
    saved.write_text('{"results": []}')
    code, text = _run(capsys, "dtensor", "--custom", str(spec), "--from-json", str(saved))
    assert not marker.exists() and "sv_trap_rules" not in sys.modules, text
    spec.write_text(spec.read_text().replace("import: sv_trap_rules", "import: antigravity"))
    code, text = _run(capsys, "dtensor", "--custom", str(spec), "--quiet")
    assert code == 2 and "no Python module in the spec's folder" in text and "antigravity" not in sys.modules, text


def test_a_trusted_module_is_matched_by_object(monkeypatch):
    """Trusting torch.nn trusts what torch.nn defines, not torch.save reached through it."""
    monkeypatch.setenv("SHARDVERIFY_TRUSTED_TARGETS", "torch.nn")
    refusal = op_target_refusal("torch.nn.functional.torch.save", torch.save)
    assert "torch.serialization" in refusal, refusal
    with pytest.raises(Exception, match="torch.serialization"):
        resolve_target(Node("torch.nn.functional.torch.save", "specs/evil.yaml", 3, "targets[0]"))
    assert op_target_refusal("torch.nn.modules.linear.Linear", torch.nn.Linear) == ""


def test_a_target_under_a_main_module_is_not_imported():
    """Its argument parser ended `generate --check`: a name under torch is reached by attribute."""
    assert "torch.utils.model_dump.__main__" not in sys.modules
    with pytest.raises(Exception, match="does not resolve"):
        resolve_target(Node("torch.utils.model_dump.__main__.main", "specs/evil.yaml", 3, "targets[0]"))
    with pytest.raises(Exception, match="has no attribute 'model_dump'"):   # not imported by its name either
        resolve_target(Node("torch.utils.model_dump.burn", "specs/evil.yaml", 3, "targets[0]"))
    assert "torch.utils.model_dump.__main__" not in sys.modules
    assert "torch.utils.model_dump" not in sys.modules


@pytest.mark.parametrize("target", ["torch.set_num_threads", "torch.set_flush_denormal", "torch.set_default_dtype",
                                    "torch.manual_seed", "torch.use_deterministic_algorithms"])
def test_torch_settings_are_refused_as_targets(target):
    with pytest.raises(Exception, match="settings or tools|not a tensor op"):
        resolve_target(Node(target, "specs/evil.yaml", 3, "targets[0]"))
    assert resolve_target(Node("torch.sum", "specs/ok.yaml", 3, "targets[0]")) == "torch.sum"
