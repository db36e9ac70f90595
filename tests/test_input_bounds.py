"""No pass without a check, one bound on every input axis, every error one line, and a
case's memory estimated before it runs. Every command runs
in-process; none may print a traceback."""

from __future__ import annotations

import json
import os
import resource
import shutil
from pathlib import Path

import pytest

from shardverify.cli.main import main
from shardverify.errors import SpecError
from shardverify.spec.loader import load_yaml_text, read_regular_file

REPO = Path(__file__).resolve().parents[1]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "[rank0]" not in out + err
    return code, out, err


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "spec.yaml"
    os.mkfifo(path)
    return path


# ---------------------------------------------------------------- item 1: no pass without a check

@pytest.mark.parametrize("budget", ["inf", "nan", "-1"])
def test_dtensor_budget_must_be_finite(capsys, budget):
    with pytest.raises(SystemExit) as stop:
        main(["dtensor", "sum", "--budget", budget])
    assert stop.value.code == 2 and "finite number of seconds" in capsys.readouterr().err


def test_a_dtensor_run_that_executed_nothing_is_not_a_pass(capsys, tmp_path):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"results": [{"op": "big", "case": "c", "mesh": [2], "combinations": 4,
                                              "executed": 0, "counts": {}, "note": "error: MemoryError",
                                              "seconds": 0.1, "findings": []}]}))
    code, out, _ = run(capsys, "dtensor", "--from-json", str(saved), "--accepted", str(REPO / "specs/dtensor/accepted.yaml"))
    assert code == 1 and out.startswith("FAIL  ") and "no combination was executed" in out and "PASS" not in out


# ---------------------------------------------------------------- item 3: a bound on every axis

@pytest.mark.parametrize("argv", [["verify", "sum"], ["audit", "sum"], ["dtensor", "sum"]])
def test_meshes_of_many_size_one_axes_are_refused(capsys, argv):
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--mesh", ",".join(["1"] * 40)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "40 axes in one mesh exceed the limit of 4" in err
    assert "SHARDVERIFY_MAX_MESH_AXES" in err


def test_dtensor_mesh_over_the_rank_limit_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["dtensor", "sum", "--mesh", "65"])
    assert stop.value.code == 2 and "65 ranks in one mesh exceed the limit of 64" in capsys.readouterr().err


def test_plan_mesh_of_many_axes_is_refused(capsys):
    code, _, err = run(capsys, "plan", "shardverify.plan.zoo.linear_chain", "--input", "8,32", "--mesh", "1,1,1,1,1")
    assert code == 2 and "5 axes in one mesh" in err


def test_model_steps_are_bounded():
    from shardverify.features.ddp.spec import parse_model_spec

    text = (REPO / "specs/models/mlp.yaml").read_text().replace("steps: 3", "steps: 1000000000")
    with pytest.raises(SpecError, match=r"mlp.yaml:\d+: field 'steps': 1000000000 optimizer steps .* SHARDVERIFY_MAX_STEPS"):
        parse_model_spec(load_yaml_text(text, "mlp.yaml"))


def test_collective_shapes_are_bounded():
    from shardverify.features.algorithms.spec import parse_collective_spec

    path = sorted((REPO / "specs/collectives").glob("*.yaml"))[0]
    text = path.read_text()
    start = text.index("\nshapes:")
    end = text.index("\n", start + 1)
    text = text[:start] + "\nshapes: [[100000, 100000]]" + text[end:]
    with pytest.raises(SpecError, match="shape \\[100000, 100000\\]: 10000000000 elements in one tensor exceed"):
        parse_collective_spec(load_yaml_text(text, path.name))


def test_special_and_oversized_files_are_refused_without_reading(tmp_path, fifo):
    with pytest.raises(SpecError, match="is a FIFO, not a regular file"):
        read_regular_file(fifo, 100)          # a plain open() would wait for a writer for ever
    with pytest.raises(SpecError, match="is a device, not a regular file"):
        read_regular_file("/dev/zero", 100)
    big = tmp_path / "big.json"
    big.write_bytes(b"0" * 101)
    with pytest.raises(SpecError, match="larger than 100 bytes \\(raise it with X=N\\)"):
        read_regular_file(big, 100, setting="X")


@pytest.mark.parametrize("argv", [
    ["dtensor", "--from-json", "/dev/zero"],
    ["dtensor", "--custom", "{fifo}"],
    ["dtensor", "--accepted", "{fifo}", "sum", "--limit", "1"],
    ["plan", "{fifo}"],
    ["plan", "specs/plans/linear_chain.yaml", "--plan", "{fifo}"],
])
def test_commands_given_a_fifo_or_a_device_refuse_it(capsys, fifo, argv):
    fifo.rename(fifo.with_suffix(".yaml"))
    code, _, err = run(capsys, *[a.format(fifo=fifo.with_suffix(".yaml")) for a in argv])
    assert code == 2 and "not a regular file" in err


# ---------------------------------------------------------------- item 4: every error one line

def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_an_option_param_that_is_not_a_name_is_one_spec_error(capsys, tmp_path):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "sum.yaml").write_text((REPO / "specs/sum.yaml").read_text().replace(
        "reduce_dims_param: dim ", "reduce_dims_param: [[0]] "))
    for argv in (["list"], ["generate", "--check"]):
        code, _, err = run(capsys, *argv, "--root", str(tmp_path))
        assert code == 2
        assert "specs/sum.yaml" in err and "reduce_dims_param" in err and "must name a parameter" in err


@pytest.mark.parametrize("body, needle", [("raise SystemExit(7)\n", "raised SystemExit(7)"),
                                          ("import no_such_module_xyz\n", "ModuleNotFoundError"),
                                          ("1 / 0\n", "ZeroDivisionError: division by zero")])
def test_a_custom_module_that_fails_to_import_is_one_line(capsys, tmp_path, body, needle):
    spec = tmp_path / "op.yaml"
    spec.write_text((REPO / "tests/dtensor_custom/row_normalize.yaml").read_text().replace(
        "import: svtest_rules", "import: svtest_broken_mod"))
    (tmp_path / "svtest_broken_mod.py").write_text(body)
    code, _, err = run(capsys, "dtensor", "--custom", str(spec), "--accepted", str(REPO / "specs/dtensor/accepted.yaml"))
    assert code == 2 and needle in _one_line(err) and "svtest_broken_mod" in err


def test_an_output_file_that_cannot_be_written_loses_no_results(capsys, tmp_path):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"results": [{"op": "sum", "case": "c", "mesh": [2], "combinations": 1,
                                              "executed": 1, "counts": {"agrees": 1}, "note": None,
                                              "seconds": 0.1, "findings": []}]}))
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, out, err = run(capsys, "dtensor", "--from-json", str(saved), "--write", str(blocker / "page.md"),
                         "--accepted", str(REPO / "specs/dtensor/accepted.yaml"))
    assert code == 2 and out.startswith("PASS  ")               # the results are on stdout
    assert str(blocker / "page.md") in _one_line(err)


@pytest.mark.parametrize("text, needle", [("fc1: [unclosed\n", "invalid YAML"), ("- a\n- b\n", "expected a mapping"),
                                          ("fc1: [1]\n", "expected a string")])
def test_a_bad_plan_file_is_one_line_naming_it(capsys, tmp_path, text, needle):
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    code, _, err = run(capsys, "plan", "specs/plans/linear_chain.yaml", "--plan", str(plan))
    line = _one_line(err)
    assert code == 2 and str(plan) in line and needle in line


def test_a_bad_limit_setting_is_reported_once_naming_it(capsys, monkeypatch, tmp_path):
    specs = tmp_path / "specs"
    specs.mkdir()
    for name in ("sum.yaml", "linear.yaml"):
        shutil.copy(REPO / "specs" / name, specs / name)
    monkeypatch.setenv("SHARDVERIFY_MAX_CASE_BYTES", "lots")
    code, _, err = run(capsys, "generate", "--check", "--root", str(tmp_path))
    assert code == 2 and "SHARDVERIFY_MAX_CASE_BYTES" in _one_line(err) and "targets" not in err
    from shardverify.spec.catalogue import InvalidSpecs, load_op_specs

    with pytest.raises(InvalidSpecs) as found:   # the library reports it once too
        load_op_specs(tmp_path, None, [])
    assert len(found.value.errors) == 1


# ---------------------------------------------------------------- a case's memory estimate

BIG = """op: big
description: Tensor.new_ones creating a tensor far larger than its input.
targets: [torch.Tensor.new_ones]
operands:
  input: {kind: input, index: 0}
  output: {kind: output}
params:
  size: {index: 1, keyword: size}
generator:
  family: rules
  options: {whole_tensors: true}
verify:
  explore: false
  inputs:
    input: {shape: [2, 2]}
  grid:
    size:
      - [12000, 12000]
  meshes: [[2]]
"""


def test_a_case_over_the_memory_limit_is_refused_with_its_estimate_before_allocating(capsys, tmp_path, monkeypatch):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs/big.yaml").write_text(BIG)
    monkeypatch.setenv("SHARDVERIFY_MAX_CASE_BYTES", str(4 << 30))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux
    code, out, _ = run(capsys, "verify", "--root", str(tmp_path))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert code == 1 and "refused before it runs" in out
    # 144e6 elements: 1.1 GiB in float64, x 3 copies (reference, 2 ranks) x 2 (values, gradients)
    assert "estimated at 6.4 GiB" in out and "over the limit of 4.0 GiB" in out and "SHARDVERIFY_MAX_CASE_BYTES" in out
    assert grown_mib < 300, f"the refused case still allocated ~{grown_mib:.0f} MiB"


def test_a_plan_of_a_model_without_a_tensor_op_is_not_a_pass(capsys):
    code, _, err = run(capsys, "plan", "torch.nn.Identity", "--input", "4,4", "--mesh", "2")
    assert code == 1 and "no plan node was run" in err


def test_a_custom_case_too_large_to_run_is_not_a_pass(capsys, monkeypatch):
    """Every case refused by its memory estimate: nothing executed, so FAILED (exit 1), never passed."""
    monkeypatch.setenv("SHARDVERIFY_MAX_CASE_BYTES", "1000")
    code, out, _ = run(capsys, "dtensor", "--custom", str(REPO / "tests/dtensor_custom/row_normalize.yaml"),
                       "--mesh", "4", "--quiet", "--accepted", str(REPO / "specs/dtensor/accepted.yaml"))
    assert code == 1 and out.startswith("FAIL  0 layout combinations run on DTensor")
    assert "not checked:" in out and "refused before it runs" in out


def test_a_calibration_file_that_is_a_fifo_is_refused_unread(fifo):
    from shardverify import DeviceMesh
    from shardverify.errors import MeshError

    with pytest.raises(MeshError, match="is a FIFO, not a regular file"):
        DeviceMesh.calibrated((2, 2), fifo)
