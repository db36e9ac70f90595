"""A DTensor repro is built from typed values only (shardverify/features/dtensor/repro.py) and what runs is
one fixed program reading its case as data (shardverify/features/dtensor/repro_runner.py): a stored
finding's words never become code, and a case or a stored finding with a bad field is refused in
one line. The tests that start torchrun are marked dist (run with AUTO_PARALLEL=1)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shardverify.features.dtensor.confirm import confirm_classes, run_on_gloo
from shardverify.features.dtensor.repro import RUNNER
from shardverify.features.dtensor.run import CaseResult, rebuild_case, rebuild_repro
from shardverify.features.dtensor.verdicts import Finding
from shardverify.spec.catalogue import load_op_specs

pytestmark = pytest.mark.slow   # DTensor repros run on gloo processes

ROOT = Path(__file__).resolve().parent.parent
CASE = "torch.cumsum-dim_-1"
WRONG = (("input", "[R, R, S0]"),)    # cumsum(x, -1) with its last dim sharded on (4,): silently wrong


def _payload(marker: Path) -> str:
    """Text that runs `open(marker, 'w')` if it is ever pasted into source: closing quotes of both
    kinds, line ends of every kind Python or str.splitlines knows, and an encoding comment whose
    UTF-7 would turn `+AAo-` into a line break."""
    run = f"open({str(marker)!r}, 'w').close()"
    return "\n".join([f'x"""', run, '"""', f"x'''\r{run}\r'''", f"\x0c{run}\u2028{run}\x85{run}",
                      "# -*- coding: utf-7 -*-", f"+AAo-{run}", f"{{run}}\\\n{run}"])


def _finding(marker: Path, mesh=(4,), layouts=WRONG, case=CASE) -> Finding:
    """A stored silent finding of cumsum whose every string field but the ones naming its
    combination carries the payload."""
    text = _payload(marker)
    return Finding("cumsum", case, mesh, layouts, (("input", text),), "silent-wrong", "forward", text, text, text,
                   text, text, culprit=text)


@pytest.fixture(scope="module")
def cumsum():
    return load_op_specs(ROOT, None, ["cumsum"])[0]


def _runner():
    """The fixed program, loaded as a module (its main part runs only as a script)."""
    spec = importlib.util.spec_from_file_location("repro_runner_under_test", RUNNER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_stored_findings_words_never_become_code(cumsum, tmp_path):
    """Every string field of a stored finding planted with code behind closing quotes: the repro
    script still compiles, holds the words as comments only, and running it runs none of them."""
    marker = tmp_path / "MARKER"
    script = rebuild_repro(cumsum, _finding(marker))
    assert not script.startswith("# no repro"), script
    compile(script, "repro.py", "exec")
    lines = script.splitlines()
    assert all(not line.startswith("+AAo-") for line in lines) and "coding" not in "\n".join(lines[:2])
    planted = [line for line in lines if "MARKER" in line]
    assert planted and all(line.startswith("# ") for line in planted), planted
    path = tmp_path / "repro.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # torch alone
    done = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert not marker.exists()
    assert done.returncode == 1 and '"status": "wrong"' in done.stdout, done.stdout + done.stderr


def test_the_case_is_data_the_runner_validates_field_by_field(cumsum, tmp_path, monkeypatch, capsys):
    """The case holds typed values (no text of the finding); each field the runner reads is
    checked, and a bad one is named in one line."""
    case = rebuild_case(cumsum, _finding(tmp_path / "MARKER"))
    assert isinstance(case, dict) and "MARKER" not in json.dumps(case)
    runner = _runner()
    assert runner.checked(copy.deepcopy(case))["world"] == 4
    bad = {
        "call.target": ("call", "target", "os.system"),
        "a dotted name under torch or operator": ("call", "target", "builtins.eval"),
        "a tensor function of torch": ("call", "target", "torch.save"),
        "an op that takes no file name": ("call", "target", "torch.ops.aten.from_file"),
        "mesh": (None, "mesh", ["2", 2]),
        "inputs[0].role": ("inputs", 0, {"role": "__class__"}),
        "unknown tag": ("call", "args", [{"code": "open('x', 'w')"}]),
        "operands[0].placements[0]": ("operands", 0, {"placements": [["Shard(0); import os"]]}),
    }
    for needle, (outer, key, value) in bad.items():
        broken = copy.deepcopy(case)
        if outer is None:
            broken[key] = value
        elif isinstance(key, int):
            broken[outer][key].update(value)
        else:
            broken[outer][key] = value
        with pytest.raises(runner.BadCase, match=needle.replace("(", r"\(").replace("[", r"\[")):
            runner.checked(broken)
    # run as torchrun runs it (as a script, on case.json): one verdict line with status error, exit status 2
    (tmp_path / "case.json").write_text(json.dumps({**case, "mesh": "2x2"}))
    monkeypatch.setattr(sys, "argv", [str(RUNNER), str(tmp_path / "case.json")])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(RUNNER), run_name="__main__")
    out = capsys.readouterr().out
    verdicts = [line for line in out.splitlines() if line.startswith("VERDICT ")]
    assert stop.value.code == 2 and len(verdicts) == 1, out
    assert json.loads(verdicts[0][8:])["status"] == "error" and "mesh" in verdicts[0]


@pytest.mark.parametrize("field, value, needle", [
    ("mesh", ("2", 2), "the stored finding's mesh"),
    ("mesh", (10 ** 6,), "the stored finding's mesh"),
    ("layouts", (("input", 3),), "the stored finding's layouts"),
    ("case", "torch.cumsum-nope", "has no case"),
])
def test_a_stored_finding_with_a_bad_field_is_an_error_of_one_line(cumsum, tmp_path, field, value, needle):
    """Confirmed from a store: the class is an error naming the field, nothing runs, no traceback."""
    marker = tmp_path / "MARKER"
    finding = _finding(marker, **{field: value})
    result = CaseResult("cumsum", CASE, (4,), 5, 5, findings=[finding])
    found = confirm_classes([result], [cumsum], tmp_path / "store", root=ROOT)[finding.key()]
    assert found.status == "error" and needle in found.detail and "\n" not in found.detail, found.detail
    assert not marker.exists()


@pytest.mark.dist
def test_a_planted_finding_is_confirmed_on_gloo_and_runs_nothing_of_its_words(cumsum, tmp_path, monkeypatch):
    """--confirm of the planted finding: the class is confirmed (cumsum is wrong there), nothing
    of its words ran, and torchrun's torchelastic_* folders went with the run's own folder."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    # torch's inductor cache stays where it is: a process that first asks for it under this
    # TMPDIR (this one, or a child inheriting it) would make it here, not a leftover of the run
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", cache_dir())
    monkeypatch.setenv("TMPDIR", str(tmp_path))   # where torchrun's processes would leave them
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    marker = tmp_path / "MARKER"
    finding = _finding(marker, mesh=(2,))   # two ranks show it as four do, at half the processes' start-up
    result = CaseResult("cumsum", CASE, (2,), 5, 5, findings=[finding])
    found = confirm_classes([result], [cumsum], tmp_path / "store", root=ROOT)[finding.key()]
    assert found.status == "confirmed" and "(2 of 2 ranks)" in found.detail, found.output
    assert not marker.exists()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["store"], left


@pytest.mark.dist
def test_a_run_on_gloo_leaves_no_torchelastic_folder(tmp_path, monkeypatch):
    """torchrun makes a torchelastic_* folder in the temporary folder of every run and left it."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    # torch's inductor cache stays where it is: a process that first asks for it under this
    # TMPDIR (this one, or a child inheriting it) would make it here, not a leftover of the run
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", cache_dir())
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    output, timed_out, _ = run_on_gloo({}, 1, timeout=120, program="print('ran', flush=True)\n")
    assert not timed_out and "ran" in output, output
    assert list(tmp_path.iterdir()) == []


def test_a_store_whose_finding_holds_its_own_mesh_is_said_in_one_line(tmp_path, capsys):
    """A stored finding carries no mesh of its own (its case's is used): one planted there with code
    ended `--confirm` in a traceback (int() of it for the confirmation's file name); the planted
    layouts pick no combination, so the class is an error of one line and nothing runs."""
    from shardverify.cli.main import main

    marker = tmp_path / "MARKER"
    shipped = sorted((ROOT / "results" / "dtensor").glob("torch-*/cumsum.4.limit0.*.json"))[0]
    store = tmp_path / "store" / shipped.parent.name
    store.mkdir(parents=True)
    document = json.loads(shipped.read_text())
    planted = 0
    for result in document["results"].values():
        for finding in result["findings"]:
            if finding["class"] == "silent-wrong":
                finding["mesh"] = [f"4); open({str(marker)!r}, 'w'); (4"]
                finding["layouts"] = {role: f'{text}"""; open({str(marker)!r}, "w")'
                                      for role, text in finding["layouts"].items()}
                planted += 1
    assert planted
    (store / shipped.name).write_text(json.dumps(document))
    code = main(["dtensor", "cumsum", "--root", str(ROOT), "--mesh", "4", "--from-json", str(tmp_path / "store"),
                 "--limit", "0", "--confirm"])
    out, err = capsys.readouterr()
    assert code in (0, 1) and "Traceback" not in out + err, err[-2000:]
    errors = [line for line in out.splitlines() if line.startswith("  [error] cumsum")]
    assert len(errors) == 1 and "no repro: no combination" in errors[0], out[-2000:]
    assert not marker.exists()
