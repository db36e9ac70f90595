"""A spec names only what may run: factories and targets allowed by what they are, never
denied by name; re-reporting imports nothing; trusted targets matched by object, the setting
naming modules of the user's own only; no module a target names imported while specs are read;
torch's settings refused as targets."""

from __future__ import annotations

import re
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
    assert code == 2 and "evil.yaml:3: field 'model.factory'" in text and "in no module the user named" in text, text
    code, text = _run(capsys, "plan", str(path), "--backend", "simulated")
    assert code == 2 and "torch.nn.Module class" in text and "SHARDVERIFY_TRUSTED_TARGETS" in text, text
    with pytest.raises(InvalidArgument, match="outside the project"):
        call_factory(factory, {"cmd": f"touch {marker}"}, tmp_path)
    assert not marker.exists()


def test_an_alias_in_a_project_module_is_judged_where_it_is_defined(tmp_path, monkeypatch):
    """`from pydoc import pipepager` in a module of the command line's project: the object is
    judged where it is defined (pydoc), and the module, which imports a command runner, is
    refused as a whole; a function of a plain project module and a torch.nn.Module class are
    allowed."""
    marker = tmp_path / "marker"
    (tmp_path / "proj_alias.py").write_text("from pydoc import pipepager\nimport torch\n\n"
                                            "def make():\n    return torch.nn.Linear(2, 2)\n")
    (tmp_path / "proj_plain.py").write_text("import torch\n\n\ndef make():\n    return torch.nn.Linear(2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "proj_alias", raising=False)
    monkeypatch.delitem(sys.modules, "proj_plain", raising=False)
    assert "runs a process or code" in name_refusal("proj_alias.make", tmp_path)
    assert name_refusal("proj_plain.make", tmp_path) == ""
    assert isinstance(call_factory("proj_plain.make", {}, tmp_path), torch.nn.Linear)
    import proj_alias  # noqa: F401 - imported by the test itself: judged as an object from here on
    with pytest.raises(InvalidArgument, match="defined in 'pydoc'"):
        call_factory("proj_alias.pipepager", {"text": "hi", "cmd": f"touch {marker}"}, tmp_path)
    with pytest.raises(InvalidArgument, match="runs a process or code"):
        call_factory("proj_alias.make", {}, tmp_path)
    assert not marker.exists()
    assert object_refusal("torch.nn.Linear", torch.nn.Linear, tmp_path) == ""
    assert "outside the project" in name_refusal("proj_plain.make", tmp_path / "elsewhere")
    assert "in no module the user named" in name_refusal("proj_plain.make", None)   # a spec's name


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


def test_a_trusted_module_is_matched_by_object(tmp_path, monkeypatch):
    """Trusting a module of the user's trusts what it defines, not torch.save imported into it."""
    (tmp_path / "svops.py").write_text("import torch\nfrom torch import save\n\n\n"
                                       "def double(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "svops", raising=False)
    monkeypatch.setenv("SHARDVERIFY_TRUSTED_TARGETS", "svops")
    refusal = op_target_refusal("svops.save", torch.save)
    assert "torch.serialization" in refusal and "SHARDVERIFY_TRUSTED_TARGETS" in refusal, refusal
    with pytest.raises(Exception, match="torch.serialization"):
        resolve_target(Node("svops.save", "specs/evil.yaml", 3, "targets[0]"))
    assert resolve_target(Node("svops.double", "specs/ok.yaml", 3, "targets[0]")) == "svops.double"
    assert op_target_refusal("torch.nn.modules.linear.Linear", torch.nn.Linear) == ""


@pytest.mark.parametrize("setting", ["torch", "torch.nn", "os", "pickle", "numpy.lib", "shardverify.plan"])
def test_the_setting_names_only_modules_of_the_users_own(monkeypatch, setting):
    """Python's own modules, installed packages (torch among them) and shardverify are no module
    of the user's: the setting cannot name them, so trusting `torch` admits nothing beyond its
    tensor ops (a target under torch needs no setting)."""
    monkeypatch.setenv("SHARDVERIFY_TRUSTED_TARGETS", setting)
    with pytest.raises(Exception, match=f"SHARDVERIFY_TRUSTED_TARGETS: '{re.escape(setting)}' cannot be trusted"):
        resolve_target(Node("torch.sum", "specs/evil.yaml", 3, "targets[0]"))


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


def _project(tmp_path: Path, monkeypatch, marker: Path) -> Path:
    """A project whose tests folder holds a command runner (as the repository's own test helpers
    do) and whose tools module runs one: the shapes of module a spec once reached."""
    runner = ("import subprocess\nimport sys\n\n\ndef {name}(args, cwd='.', timeout=20):\n"
              "    return subprocess.run([sys.executable, *args], cwd=cwd, timeout=timeout)\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "test_e2e_helpers.py").write_text(runner.format(name="_run"))
    (tmp_path / "tests" / "helpers.py").write_text(runner.format(name="run"))
    (tmp_path / "svtools.py").write_text(runner.format(name="run"))
    (tmp_path / "specs" / "plans").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for name in ("tests", "tests.test_e2e_helpers", "tests.helpers", "svtools"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path / "specs" / "plans" / "evil.yaml"


@pytest.mark.parametrize("factory, trusted, rule", [
    ("tests.test_e2e_helpers._run", "", "is a private name ('_run' starts with '_')"),
    ("tests.test_e2e_helpers._run", "tests", "is a private name ('_run' starts with '_')"),
    ("tests.helpers.run", "tests", "lies in a test folder or module ('tests')"),
    ("svtools.run", "", "in no module the user named"),
    ("svtools.run", "svtools", "lies in a module that runs a process or code"),
])
def test_a_plan_factory_that_runs_a_command_is_refused(tmp_path, capsys, monkeypatch, factory, trusted, rule):
    """`factory: tests.test_x._run` with `kwargs: {args: [-c, ...]}` ran a Python command on
    `shardverify plan` (any function of the spec's project was allowed): a private name, a test
    folder's module and a module that runs processes are refused, even when the user's setting
    names their module; a project module no setting names is refused too. One line, the factory
    and the rule named, nothing run."""
    marker = tmp_path / "ran"
    path = _project(tmp_path, monkeypatch, marker)
    monkeypatch.setenv("SHARDVERIFY_TRUSTED_TARGETS", trusted)
    command = f"open({str(marker)!r}, 'w').write('x')"
    path.write_text(PLAN.format(factory=factory, kwargs=f"{{args: ['-c', \"{command}\"], cwd: '.', timeout: 20}}"))
    for argv in (("list", "--root", str(tmp_path)), ("plan", str(path), "--backend", "simulated")):
        code, text = _run(capsys, *argv)
        assert code == 2 and factory in text and rule in text and "never a private name" in text, text
        assert len(text.strip().splitlines()) <= 2, text   # the error, and `list`'s count of invalid specs
    assert not marker.exists()


def test_a_command_line_factory_that_runs_a_process_is_refused(tmp_path, capsys, monkeypatch):
    """A name given on the command line may come from the current folder, but not from a module
    that runs processes, nor a private one."""
    marker = tmp_path / "ran"
    _project(tmp_path, monkeypatch, marker)
    (tmp_path / "svmodels.py").write_text("import torch\n\n\ndef make(width=4):\n    return torch.nn.Linear(width, 4)\n")
    monkeypatch.delitem(sys.modules, "svmodels", raising=False)
    code, text = _run(capsys, "plan", "svtools.run", "--input", "4,4", "--kwarg", "args=[-c, 'print(1)']")
    assert code == 2 and "runs a process or code" in text and "svtools.run" in text, text
    assert name_refusal("svmodels.make", tmp_path) == ""


@pytest.mark.parametrize("target, needle", [
    ("torch.save", "'torch.save' (defined in torch.serialization) is not a tensor op"),
    ("torch.load", "'torch.load' (defined in torch.serialization) is not a tensor op"),
    ("torch.from_file", "takes a file name ('filename')"),
    ("torch.ops.aten.from_file", "takes a file name ('filename')"),
    ("torch.hub.load", "'torch.hub.load' (defined in torch.hub) is not a tensor op"),
])
def test_torchs_file_functions_are_no_tensor_op(monkeypatch, target, needle):
    """SHARDVERIFY_TRUSTED_TARGETS=torch with `targets: [torch.save]` wrote a file: a target
    under torch is allowed only as a tensor op (what it is, not where it lies), and the setting
    cannot widen that (it names modules of the user's own only)."""
    monkeypatch.delenv("SHARDVERIFY_TRUSTED_TARGETS", raising=False)
    with pytest.raises(Exception, match=re.escape(needle)):
        resolve_target(Node(target, "specs/evil.yaml", 3, "targets[0]"))
    assert op_target_refusal("torch.sum", torch.sum) == ""
    monkeypatch.setenv("SHARDVERIFY_TRUSTED_TARGETS", "torch")
    with pytest.raises(Exception, match="'torch' cannot be trusted: it lies under torch"):
        resolve_target(Node(target, "specs/evil.yaml", 3, "targets[0]"))


def test_a_module_class_target_is_one_of_torchs_layers():
    """A torch.nn.Module class is a target where torch.nn (or torch.ao.nn) defines it: a wrapper
    of torch.distributed (FSDP) is not one, whatever path reaches it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    refusal = op_target_refusal("torch.distributed.fsdp.FullyShardedDataParallel", FullyShardedDataParallel)
    assert "not one of torch.nn's layers" in refusal, refusal
    assert op_target_refusal("torch.nn.Linear", torch.nn.Linear) == ""


def test_a_test_folder_is_judged_from_where_its_module_is_imported(tmp_path, monkeypatch):
    """tests/ itself on sys.path (as pytest puts it) is still a test folder; a project that lies
    under a folder named test is not one."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "svhelpers.py").write_text("import torch\n\n\ndef make():\n    return torch.nn.Linear(2, 2)\n")
    project = tmp_path / "test" / "proj"
    project.mkdir(parents=True)
    (project / "svmodels2.py").write_text("import torch\n\n\ndef make():\n    return torch.nn.Linear(2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "tests"))
    monkeypatch.syspath_prepend(str(project))
    for name in ("svhelpers", "svmodels2"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setenv("SHARDVERIFY_TRUSTED_TARGETS", "svhelpers,svmodels2")
    assert "lies in a test folder or module ('tests')" in name_refusal("svhelpers.make", None)
    assert name_refusal("svmodels2.make", None) == ""
