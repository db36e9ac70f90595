"""A named spec is read alone: the folder's other specs are checked against it by their claims
(name and targets, read from the text: shardverify/spec/claims.py), and only a spec whose claim
may conflict is parsed. The conflicts found, and the files generated, are those of reading the
whole folder."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

import shardverify.spec.catalogue as catalogue
from shardverify.cli.catalogue import KINDS
from shardverify.cli.main import build_parser, main
from shardverify.codegen.generate import generate
from shardverify.errors import SpecError
from shardverify.spec.claims import Claim, read_claim
from shardverify.spec.catalogue import load_op_specs, spec_folder_sources

REPO = Path(__file__).resolve().parents[1]
MM = (REPO / "specs" / "mm.yaml").read_text()
#: an op spec that parses but for one bad grid value: invalid, with its targets plain to read
BROKEN = MM.replace("op: mm", "op: broken").replace(
    "targets: [torch.mm, torch.Tensor.mm, torch.ops.aten.mm.default]", "targets: [torch.addmm]").replace(
    "{shape: [8, 16]}", "{shape: [8, -16]}")


def _claim(tmp_path: Path, text: str, name_key: str = "op") -> Claim | None:
    path = tmp_path / "spec.yaml"
    path.write_bytes(text.encode("utf-8"))
    return read_claim(path, "specs/spec.yaml", name_key)


def test_every_spec_of_the_checkout_claims_what_it_parses_to():
    """Every spec file shows its claim plainly, and every op spec's claim is its parsed name and
    targets, in order."""
    folder = spec_folder_sources(REPO)
    claims = {source.path: read_claim(source.path, source.display, source.kind.name_key) for source in folder}
    assert [source.display for source in folder if claims[source.path] is None] == []
    ops = [source for source in folder if source.kind.name == "op"]
    for spec in load_op_specs(REPO, None, []):
        source = next(s for s in ops if s.display == spec.source)
        assert claims[source.path] == Claim(spec.name, tuple(t.name for t in spec.targets)), source.display


@pytest.mark.parametrize("text, claim", [
    ("# a comment\nop: mm  # the op\ntargets: [torch.mm,   # first\n    torch.Tensor.mm,]\nverify: {}\n",
     Claim("mm", ("torch.mm", "torch.Tensor.mm"))),
    ("op: sum\ntargets:\n  - torch.sum\n\n  # between\n  - torch.Tensor.sum\noperands: {}\n",
     Claim("sum", ("torch.sum", "torch.Tensor.sum"))),
    ("op: sum\ntargets:\n- torch.sum\n- torch.Tensor.sum\n", Claim("sum", ("torch.sum", "torch.Tensor.sum"))),
    ("---\r\nop: mm\r\ntargets: [torch.mm]\r\n", Claim("mm", ("torch.mm",))),
    ("\ufeffop: 'mm'\ntargets:\n  - target: torch.ops.aten.mm.default\n    args: {input: 0}\n  - \"torch.mm\"\n",
     Claim("mm", ("torch.ops.aten.mm.default", "torch.mm"))),
    ("op: mm\nverify: {}\n", Claim("mm", ())),
])
def test_a_claim_is_read_from_the_plain_forms(tmp_path, text, claim):
    assert _claim(tmp_path, text) == claim


@pytest.mark.parametrize("text", [
    '"targets": [torch.mm]\nop: mm\n',                  # a quoted key: parsed in full
    "op: mm\ntargets: [torch.mm,\ntorch.add]\n",       # a flow list going on at column 0
    "op: mm\ntargets: [torch.mm]\ntargets: [torch.add]\n",
    "op: mm\ntargets: [torch.mm\n",
    "op: mm\ntargets:\n  - torch.mm\n    - torch.add\n",
    "op: mm\ntargets: torch.mm\n",
    "op: [mm]\ntargets: [torch.mm]\n",
    "op: null\ntargets: [torch.mm]\n",
    "targets: [torch.mm]\n",                           # no name
    "- op: mm\n  targets: [torch.mm]\n",               # not a mapping
    "  op: mm\n  targets: [torch.mm]\n",               # indented: not read
    "op: mm\ntargets: [*mm]\n",
    "op: mm\ntargets: [torch.no_such_op]\n",
    "op: mm\ntargets: [antigravity.fly]\n",            # not under torch: never imported
    "op: mm\u2028targets: [torch.mm]\n",
    "op: mm\ntargets: [torch.mm]\n...\n",
])
def test_a_claim_not_shown_plainly_is_none(tmp_path, text):
    assert _claim(tmp_path, text) is None
    assert "antigravity" not in sys.modules


def test_a_link_or_a_non_file_has_no_claim(tmp_path):
    (tmp_path / "real.yaml").write_text(MM)
    (tmp_path / "link.yaml").symlink_to(tmp_path / "real.yaml")
    assert read_claim(tmp_path / "real.yaml", "real.yaml", "op") is not None
    assert read_claim(tmp_path / "link.yaml", "link.yaml", "op") is None
    (tmp_path / "folder.yaml").mkdir()
    assert read_claim(tmp_path / "folder.yaml", "folder.yaml", "op") is None


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A repository root whose specs/ holds mm.yaml, sum.yaml, a broken spec and a plan spec."""
    specs = tmp_path / "specs"
    (specs / "plans").mkdir(parents=True)
    for name in ("mm.yaml", "sum.yaml", "linear.yaml"):
        shutil.copy(REPO / "specs" / name, specs / name)
    (specs / "broken.yaml").write_text(BROKEN)
    (specs / "plans" / "broken_plan.yaml").write_text("name: broken_plan\nmodel: {factory: nowhere}\n")
    return tmp_path


def _reads(monkeypatch) -> list[str]:
    """The spec files the catalogue parses from now on."""
    read: list[str] = []
    original = catalogue.load_yaml

    def load_yaml(path, *, display=None):
        read.append(display)
        return original(path, display=display)

    monkeypatch.setattr(catalogue, "load_yaml", load_yaml)
    return read


def test_a_named_spec_is_parsed_alone(root, monkeypatch):
    read = _reads(monkeypatch)
    spec, = load_op_specs(root, None, ["mm"])
    assert spec.name == "mm" and read == ["specs/mm.yaml"]
    read.clear()
    assert generate(root, None, ["mm"], check=True) and read == ["specs/mm.yaml"]


def test_a_broken_spec_elsewhere_stops_neither_generate_nor_verify(root, capsys):
    assert main(["generate", "mm", "--root", str(root)]) == 0
    assert "created shardverify/strategies/handlers/generated/mm.py" in capsys.readouterr().out
    assert main(["verify", "mm", "--specs-dir", str(root / "specs"), "--mesh", "2"]) == 0
    assert main(["generate", "--root", str(root), "--check"]) == 2    # the whole folder: each broken spec named
    err = capsys.readouterr().err
    assert "specs/broken.yaml" in err and "specs/plans/broken_plan.yaml" in err


@pytest.mark.parametrize("rival", [
    MM.replace("op: mm", "op: my_mm").replace("targets: [torch.mm, torch.Tensor.mm, torch.ops.aten.mm.default]",
                                              "targets:\n  - torch.Tensor.mm"),
    MM.replace("op: mm", "op: my_mm").replace("targets: [torch.mm, torch.Tensor.mm, torch.ops.aten.mm.default]",
                                              '"targets": [torch.mm]'),      # read in full: no claim
])
def test_a_rival_for_a_target_is_still_a_conflict(root, rival, monkeypatch):
    (root / "specs" / "rival.yaml").write_text(rival)
    read = _reads(monkeypatch)
    for load in (lambda: generate(root, None, ["mm"], check=True), lambda: load_op_specs(root, None, ["mm"])):
        with pytest.raises(SpecError, match=r"specs/mm\.yaml: field 'targets': target 'torch\.(Tensor\.)?mm' is "
                                            r"already handled by specs/rival\.yaml"):
            load()
    assert set(read) == {"specs/mm.yaml", "specs/rival.yaml"}


def test_a_second_spec_of_the_name_is_still_a_conflict(root):
    (root / "specs" / "mm_again.yaml").write_text(MM.replace(
        "targets: [torch.mm, torch.Tensor.mm, torch.ops.aten.mm.default]", "targets: [torch.inner]"))
    with pytest.raises(SpecError, match=r"specs/mm\.yaml: op 'mm' is also defined in specs/mm_again\.yaml"):
        load_op_specs(root, None, ["mm"])


def test_a_broken_rival_is_left_to_the_whole_folders_check(root):
    """A spec that does not parse conflicts with nothing, as before: named specs are checked
    against the specs that parse; `generate` without SPEC (and CI's --check) names the broken one."""
    (root / "specs" / "broken.yaml").write_text(BROKEN.replace("targets: [torch.addmm]", "targets: [torch.mm]"))
    assert [spec.name for spec in load_op_specs(root, None, ["mm"])] == ["mm"]
    with pytest.raises(SpecError, match="specs/broken.yaml"):
        generate(root, None, [], check=True)


def test_one_spec_generates_what_the_whole_folder_generates_for_it(root):
    (root / "specs" / "broken.yaml").unlink()
    shutil.rmtree(root / "specs" / "plans")
    whole = {change.path: change.new for change in generate(root, None, [], check=True)}
    alone = {change.path: change.new for change in generate(root, None, ["mm"], check=True)}
    assert alone and alone == {path: text for path, text in whole.items() if "mm" in Path(path).name}
    spec, = load_op_specs(root, None, ["mm"])
    assert spec == next(s for s in load_op_specs(root, None, []) if s.name == "mm")


def test_the_parser_of_one_command_is_built_alone():
    def commands(parser):
        return set(parser._subparsers._group_actions[0].choices)

    assert commands(build_parser(["generate", "mm"])) == {"generate"}
    every = {"verify", "generate", "list", "coverage", "explore", "audit", "dtensor", "calibrate", "plan",
             "parallelize"}
    assert commands(build_parser()) == commands(build_parser(["--help"])) == commands(build_parser(["nope"])) == every
    assert [kind.name for kind in KINDS] == ["op", "collective", "model", "reshard", "plan"]
