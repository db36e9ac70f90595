"""Values a user hands shardverify that would make it do unbounded work, touch storage, echo a
megabyte back, or leave a half-written file: each refused or bounded in one line."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from shardverify.errors import SpecError

REPO = Path(__file__).resolve().parents[1]

MODEL = """\
name: tiny
model:
  layers:
    - {module: torch.nn.Linear, args: [4, 2]}
data:
  input: [8, 4]
  target: [8, 2]
loss: mse
steps: 2
meshes: [[2]]
plans:
  - {accumulate: ACCUMULATE}
"""


def _model_spec(accumulate: str):
    from shardverify.features.ddp.spec import parse_model_spec
    from shardverify.spec.loader import load_yaml_text

    return parse_model_spec(load_yaml_text(MODEL.replace("ACCUMULATE", accumulate), "specs/models/tiny.yaml"))


def test_a_model_plans_micro_batches_are_bounded_naming_accumulate():
    """`accumulate: 1000000000` was accepted: a thousand million forward and backward passes."""
    assert _model_spec("[1, 2048]").plans[-1].options.accumulate == 2048
    with pytest.raises(SpecError) as info:
        _model_spec("1000000000")
    message = str(info.value)
    assert message.startswith("specs/models/tiny.yaml:12") and "accumulate=1000000000 x steps=2" in message
    assert "exceed the limit of 4096" in message and "SHARDVERIFY_MAX_MICRO_BATCHES" in message


def _run(capsys, *argv: str) -> tuple[int, str]:
    from shardverify.cli.main import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out + err


def _op_spec(root: Path, targets: str, name: str = "evil") -> Path:
    """specs/sum.yaml as op ``name`` with other targets, in a root of its own."""
    text = (REPO / "specs" / "sum.yaml").read_text().replace("op: sum", f"op: {name}")
    text = text.replace("  - torch.sum\n  - torch.Tensor.sum\n", targets)
    (root / "specs").mkdir(exist_ok=True)
    path = root / "specs" / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("target", ["torch.ops.inductor.resize_storage_bytes_", "torch.ops.aten.set_.source_Tensor",
                                    "torch.Tensor.resize_", "torch.Tensor.untyped_storage"])
def test_an_op_target_acting_on_storage_is_refused_naming_it(capsys, tmp_path, target):
    """resize_storage_bytes_ frees a tensor's memory under all its views: no value to compare."""
    _op_spec(tmp_path, f"  - {target}\n")
    code, text = _run(capsys, "list", "--root", str(tmp_path))
    assert code == 2 and f"target '{target}'" in text and "a tensor's storage: not a tensor op" in text


def test_an_aten_op_returning_no_tensor_is_refused(capsys, tmp_path):
    _op_spec(tmp_path, "  - torch.ops.aten._assert_async.msg\n")
    code, text = _run(capsys, "list", "--root", str(tmp_path))
    assert code == 2 and "'torch.ops.aten._assert_async.msg' returns no tensor: not a tensor op" in text


@pytest.mark.parametrize("setting, needle", [
    ("os", "'os' cannot be trusted: it lies in "),
    ("torch.nope", "'torch.nope' cannot be trusted: it lies under torch"),
    ("torch.nn, no such", "'no such' is not a dotted module name"),
    ("nosuchmodule_anywhere", "no module 'nosuchmodule_anywhere' can be found"),
])
def test_a_bad_trusted_targets_setting_is_one_error_for_the_run(capsys, monkeypatch, tmp_path, setting, needle):
    """It was one error per spec (and a traceback for a name under torch that does not resolve)."""
    for name in ("one", "two", "three"):
        _op_spec(tmp_path, "  - torch.sum\n", name)
    monkeypatch.setenv("SHARDVERIFY_TRUSTED_TARGETS", setting)
    for command in (["list"], ["generate", "--check"], ["verify", "--mesh", "2"]):
        code, text = _run(capsys, *command, "--root", str(tmp_path))
        assert code == 2 and needle in text, text
        assert text.count("SHARDVERIFY_TRUSTED_TARGETS") == 1 and len(text.strip().splitlines()) == 1, text


def test_a_custom_module_that_registers_no_op_is_one_line(capsys, tmp_path):
    """Imported fine but registering nothing: the op's lookup raised a traceback."""
    (tmp_path / "registers_nothing.py").write_text("VALUE = 1\n")
    spec = tmp_path / "custom.yaml"
    spec.write_text((REPO / "tests/dtensor_custom/row_normalize.yaml").read_text()
                    .replace("import: svtest_rules", "import: registers_nothing").replace("svtest::", "unmade::"))
    code, text = _run(capsys, "dtensor", "--custom", str(spec), "--mesh", "4", "--quiet")
    assert code == 2 and len(text.strip().splitlines()) == 1
    assert "custom op unmade::row_normalize: importing 'registers_nothing'" in text
    assert "registered no op unmade::row_normalize" in text


def test_an_output_cut_short_by_a_file_size_limit_leaves_the_old_file_whole(tmp_path, capsys):
    """`dtensor --write` under `ulimit -f` left a truncated page where the old one was. Run in this
    process, the limit lowered for the command alone: Python ignores SIGXFSZ, so a write past the
    limit raises EFBIG here as in a process started under `ulimit -f`."""
    import json
    import resource

    from shardverify.cli.main import main

    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"results": [
        {"op": "sum", "case": f"case{i}", "mesh": [4], "combinations": 9, "executed": 9, "counts": {"agrees": 9},
         "note": "", "seconds": 0.1, "findings": []} for i in range(40)]}))
    page = tmp_path / "page.md"
    page.write_text("the page before\n")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2000, hard))
    try:
        code = main(["dtensor", "--from-json", str(saved), "--accepted", str(REPO / "specs/dtensor/accepted.yaml"),
                     "--write", str(page), "--root", str(REPO)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out, err = capsys.readouterr()
    assert code == 2 and f"error: cannot write {page}: File too large" in err, err
    assert "Traceback" not in out + err
    assert page.read_text() == "the page before\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.md", "run.json"]     # no temporary file left


def test_files_written_whole_replace_a_planted_link_and_never_write_through_it(tmp_path):
    from shardverify.files import write_file_atomic

    outside = tmp_path / "outside.txt"
    outside.write_text("kept")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "page.md").symlink_to(outside)
    write_file_atomic(tmp_path / "out" / "page.md", "new page")
    assert outside.read_text() == "kept" and not (tmp_path / "out" / "page.md").is_symlink()
    assert (tmp_path / "out" / "page.md").read_text() == "new page"


_ALIAS_BOMB = ("[&a [x,x,x,x,x,x,x,x,x], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b], "
               "&d [*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d], &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]]")


@pytest.mark.parametrize("value, needle", [
    (_ALIAS_BOMB, "YAML aliases (*a) are not supported"),
    ("!!python/name:os.system", "YAML tag 'tag:yaml.org,2002:python/name:os.system' is not allowed"),
    ("[" + "1," * 5000 + "1]", "a value of 10003 characters is longer than the limit of 4096"),
])
def test_a_kwarg_value_is_read_as_strictly_as_a_spec(capsys, value, needle):
    """A six-level alias bomb on the command line built 531,441 values before anything looked."""
    code, text = _run(capsys, "plan", "shardverify.plan.zoo.linear_chain", "--input", "8,32", "--kwarg", f"width={value}")
    assert code == 2 and needle in text and len(text.strip().splitlines()) == 1, text
    assert len(text) < 400      # the value is shown cut short, not echoed whole


def test_an_error_about_a_long_data_list_shows_its_start_not_every_value(capsys, tmp_path):
    """A `data:` list of 5,000 values for a 3-element input: the error echoed all of them."""
    text = (REPO / "specs/embedding_bag.yaml").read_text()
    assert "data: [0, 4, 6]" in text
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "embedding_bag.yaml").write_text(text.replace("data: [0, 4, 6]",
                                                                        "data: [" + "1, " * 5000 + "1]"))
    code, out = _run(capsys, "list", "--root", str(tmp_path))
    assert code == 2 and "data must be 3 finite number(s)" in out and "(5001 items)" in out
    assert len(out) < 600, out


def test_a_value_in_a_message_is_cut_short_with_its_length():
    from shardverify.errors import shorten

    assert shorten([1, 2]) == "[1, 2]" and shorten("abc") == "'abc'"
    assert shorten((0.5,) * 10**6) == repr((0.5,) * 40)[:80] + "... (1000000 items)"
    assert shorten("x" * 500) == repr("x" * 80) + "... (500 characters)"
