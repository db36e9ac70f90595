"""Code generation: determinism, write-only-when-changed, --check (stale, missing, orphan),
validate-all-then-write, the CLI, and injection attempts through every string field."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest

from shardverify.cli import generate_cmd, list_cmd
from shardverify.cli.main import main
from shardverify.cli.catalogue import KINDS
from shardverify.spec.kinds import spec_kinds
from shardverify.codegen.generate import HEADER_MARK, generate, is_generated
from shardverify.spec.loader import load_yaml_text
from shardverify.spec.op_kind import render_op_spec
from shardverify.spec.op import parse_op_spec
from shardverify.codegen.render import Renderer, py_dotted, py_identifier, py_literal
from shardverify.errors import InvalidArgument, SpecError
from shardverify.strategies.generators.registry import register_generator
from shardverify.strategies.rules.sources import parse_rule

REPO = Path(__file__).resolve().parents[1]
OUTPUTS = ("generated_tests/test_linear.py", "generated_tests/test_sum.py",
           "shardverify/strategies/handlers/generated/linear.py", "shardverify/strategies/handlers/generated/sum.py")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A temporary repository root holding a copy of the op specs (no other kinds)."""
    (tmp_path / "specs").mkdir()
    for name in ("linear.yaml", "sum.yaml"):
        shutil.copy(REPO / "specs" / name, tmp_path / "specs" / name)
    return tmp_path


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="shardverify")
    sub = parser.add_subparsers(required=True)
    generate_cmd.add_parser(sub)
    list_cmd.add_parser(sub)
    args = parser.parse_args(list(argv))
    return args.func(args)


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """(inode, mtime_ns, bytes) of every file under the generated folders."""
    found = {}
    for folder in ("generated_tests", "shardverify"):
        for path in sorted((root / folder).rglob("*")) if (root / folder).exists() else ():
            if path.is_file():
                stat = path.stat()
                found[path.relative_to(root).as_posix()] = (stat.st_ino, stat.st_mtime_ns, path.read_bytes())
    return found


# ----------------------------------------------------------------------- generation

def test_generate_writes_every_output_with_header(root):
    changes = generate(root)
    assert set(OUTPUTS) <= {c.path for c in changes}
    assert {c.status for c in changes} == {"missing"}
    for rel in [c.path for c in changes]:
        text = (root / rel).read_text()
        spec = "specs/linear.yaml" if "linear" in rel else "specs/sum.yaml"
        first, second = text.splitlines()[:2]
        assert first == f"{HEADER_MARK} from {spec}: DO NOT EDIT."
        assert "shardverify generate" in second and spec in second
        compile(text, rel, "exec")


def test_output_matches_the_committed_files(root):
    """The committed generated files are what the committed specs produce."""
    for change in generate(root):
        rel = change.path
        assert (root / rel).read_text() == (REPO / rel).read_text(), f"{rel} is stale: run `shardverify generate`"


def test_generate_is_deterministic_and_writes_only_when_changed(root):
    generate(root)
    before = snapshot(root)
    assert generate(root) == []
    assert snapshot(root) == before           # same inodes, mtimes and bytes: nothing rewritten
    # changing one spec rewrites exactly that spec's outputs
    sum_spec = root / "specs" / "sum.yaml"
    sum_spec.write_text(sum_spec.read_text().replace("    - [4]\n", "    - [4]\n    - [1, 2]\n"))
    changes = generate(root)
    rewritten = ["generated_tests/test_sum.py", "generated_tests/test_sum_audit.py"]   # meshes of both
    assert sorted((c.path, c.status) for c in changes) == [(rel, "stale") for rel in rewritten]
    after = snapshot(root)
    for rel, state in before.items():
        if rel not in rewritten:
            assert after[rel] == state, rel
    assert after["generated_tests/test_sum.py"][1:] != before["generated_tests/test_sum.py"][1:]
    assert "(1, 2), id='torch.sum-dim_0.2-keepdim_False-mesh1x2')" in (root / "generated_tests/test_sum.py").read_text()


def test_rendering_twice_gives_the_same_bytes():
    spec = parse_op_spec(load_yaml_text((REPO / "specs/sum.yaml").read_text(), "specs/sum.yaml"))
    assert render_op_spec(spec, Renderer()) == render_op_spec(spec, Renderer())


def test_check_catches_a_hand_edited_file(root, capsys):
    generate(root)
    handler = root / "shardverify/strategies/handlers/generated/sum.py"
    handler.write_text(handler.read_text().replace("generator='rules'", "generator='whole'"))
    assert run_cli("generate", "--check", "--root", str(root)) == 1
    out, err = capsys.readouterr()
    assert "--- a/shardverify/strategies/handlers/generated/sum.py" in out
    assert "-    generator='whole'," in out and "+    generator='rules'," in out
    assert "stale: shardverify/strategies/handlers/generated/sum.py" in err
    assert "'whole'" in handler.read_text()       # --check writes nothing
    assert run_cli("generate", "--root", str(root)) == 0
    assert run_cli("generate", "--check", "--root", str(root)) == 0


def test_check_catches_a_missing_file(root, capsys):
    generate(root)
    (root / "generated_tests/test_linear.py").unlink()
    assert run_cli("generate", "--check", "--root", str(root)) == 1
    out, err = capsys.readouterr()
    assert "--- /dev/null" in out and "+++ b/generated_tests/test_linear.py" in out
    assert "missing: generated_tests/test_linear.py" in err
    assert not (root / "generated_tests/test_linear.py").exists()


def test_check_catches_an_orphan_and_generate_removes_it(root, capsys):
    generate(root)
    (root / "specs/sum.yaml").unlink()
    hand_written = root / "generated_tests/conftest.py"
    hand_written.write_text("# not generated\n")
    assert run_cli("generate", "--check", "--root", str(root)) == 1
    out, err = capsys.readouterr()
    assert "orphan: generated_tests/test_sum.py" in err
    assert "orphan: shardverify/strategies/handlers/generated/sum.py" in err
    assert "conftest.py" not in err                  # no header: not ours
    assert "+++ /dev/null" in out
    assert run_cli("generate", "--root", str(root)) == 0
    assert "removed orphan generated_tests/test_sum.py" in capsys.readouterr().out
    assert not (root / "generated_tests/test_sum.py").exists() and hand_written.exists()
    assert is_generated(root / "generated_tests/test_linear.py") and not is_generated(hand_written)


def test_nothing_is_written_when_any_spec_is_invalid(root, capsys):
    bad = (root / "specs/sum.yaml").read_text().replace("    keepdim: [false, true]", "    keepdim: []")
    (root / "specs/zz_bad.yaml").write_text(bad.replace("op: sum", "op: bad_sum"))
    (root / "specs/zz_worse.yaml").write_text("op: worse\nop: again\n")
    assert run_cli("generate", "--root", str(root)) == 2
    err = capsys.readouterr().err
    assert "error: specs/zz_bad.yaml:" in err and "grid values for 'keepdim' are empty" in err
    assert "error: specs/zz_worse.yaml:2: field 'op': duplicate key 'op'" in err
    assert "2 invalid spec(s); nothing was written" in err
    assert not (root / "generated_tests").exists() and not (root / "shardverify").exists()


def test_two_specs_for_one_op_are_an_error(root):
    (root / "specs/sum2.yaml").write_text((root / "specs/sum.yaml").read_text())
    with pytest.raises(SpecError, match=r"specs/sum2\.yaml: op 'sum' is also defined in specs/sum\.yaml"):
        generate(root)


def test_spec_file_names_are_validated(root):
    shutil.copy(root / "specs/sum.yaml", root / "specs/my sum.yaml")
    with pytest.raises(SpecError, match="spec file names use letters"):
        generate(root)


def test_generate_named_specs_only(root, capsys):
    assert run_cli("generate", "sum", "--root", str(root)) == 0
    out = capsys.readouterr().out
    assert "created generated_tests/test_sum.py" in out
    assert "created shardverify/strategies/handlers/generated/sum.py" in out
    assert "linear" not in out and not (root / "generated_tests/test_linear.py").exists()
    assert run_cli("generate", "nope", "--root", str(root)) == 2
    assert "no spec named 'nope'" in capsys.readouterr().err


def test_list_prints_ops_targets_generators_grids(root, capsys):
    assert run_cli("list", "--root", str(root)) == 0
    out = capsys.readouterr().out
    assert "op sum  (specs/sum.yaml)" in out and "op linear  (specs/linear.yaml)" in out
    assert "torch.sum, torch.Tensor.sum" in out and "rules" in out
    assert "8 point(s): dim[4] x keepdim[2]" in out and "[2, 2] [4] [1, 4]" in out
    assert "69 on [2, 2], bias=False" in out


def test_missing_specs_dir_is_a_clear_error(tmp_path, capsys):
    assert run_cli("generate", "--root", str(tmp_path)) == 2
    assert "no spec folder" in capsys.readouterr().err


def test_generated_handler_registers_the_spec():
    """The committed handler modules (imported through the registry) carry the spec's data."""
    import torch

    from shardverify.strategies.handlers import registered_handlers

    handlers = registered_handlers()
    total, linear = handlers["sum"], handlers["linear"]
    assert total.targets == (torch.sum, torch.Tensor.sum) and total.spec_file == "specs/sum.yaml"
    assert [(p.name, p.index, p.keyword, p.default) for p in total.params] == [
        ("dim", 1, "dim", None), ("keepdim", 2, "keepdim", False)]
    assert dataclasses.replace(total.rule, at="") == parse_rule(
        {"follow": "input", "reduce_dims_param": "dim", "keepdim_param": "keepdim", "linear_in": ["input"],
         "naming": "colossalai"})
    assert total.rule.at == f"specs/sum.yaml:{_line_of('specs/sum.yaml', '  options:')}"
    assert linear.targets == (torch.nn.Linear, torch.nn.functional.linear)
    assert [(o.role, o.kind, o.attribute, o.optional) for o in linear.operands] == [
        ("input", "input", None, False), ("other", "param", "weight", False),
        ("bias", "param", "bias", True), ("output", "output", None, False)]


def _line_of(path: str, start: str) -> int:
    lines = (REPO / path).read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if line.startswith(start))


def test_every_generated_handler_is_its_parsed_spec():
    """What runs is what was parsed: each committed handler holds its spec's declarations and rule
    (the rule's YAML line included) equal to a fresh parse of the spec."""
    from shardverify.spec.catalogue import load_op_specs
    from shardverify.strategies.handlers import registered_handlers

    handlers = registered_handlers()
    specs = load_op_specs(REPO, None, [])
    assert len(specs) == len(handlers) > 150
    for spec in specs:
        handler = handlers[spec.name]
        assert (handler.operands, handler.params, handler.rule) == (spec.operands, spec.params, spec.rule), spec.name
        assert handler.rule.at.startswith(spec.source + ":"), spec.name
        assert [(o, p) for _, o, p in handler.overrides] == [(t.operands, t.params) for t in spec.targets if t.aten]


def test_a_rule_is_parsed_once_per_spec_read(monkeypatch):
    """`verify mm` parses mm's rule once, where it reads the spec; the handler serving the calls
    holds the parsed rule and parses nothing again."""
    from shardverify.strategies.generators import registry

    calls = []
    parse = registry._PARSERS["rules"]
    monkeypatch.setitem(registry._PARSERS, "rules", lambda options: calls.append(dict(options)) or parse(options))
    assert main(["verify", "mm", "--mesh", "2", "--root", str(REPO)]) == 0
    assert calls == [{"einsum": "mk,kn->mn", "linear_in": ("input", "mat2")}]


def test_model_source_refuses_what_it_cannot_rebuild():
    """A generated handler names only frozen dataclasses importable by their name."""
    from shardverify.pysource import py_model
    from shardverify.strategies.declarations import OperandDecl

    assert py_model(OperandDecl("x", "input", 0)).text == "OperandDecl(role='x', kind='input', index=0)"

    @dataclasses.dataclass(frozen=True)
    class Local:
        x: int = 0

    with pytest.raises(InvalidArgument, match="importable"):   # a class local to a function
        py_model(Local(1))
    with pytest.raises(InvalidArgument):
        py_model(object())


def test_every_kind_is_registered_in_catalogue_order():
    assert [kind.name for kind in spec_kinds()] == [kind.name for kind in KINDS] == \
        ["op", "collective", "model", "reshard", "plan"]


# ----------------------------------------------------------------------- injection

def test_render_filters_refuse_unsafe_values():
    assert py_literal(("a'b", 1, None, (0, 2), 1.5)) == "(\"a'b\", 1, None, (0, 2), 1.5)"
    assert py_literal((3,)) == "(3,)"
    for bad in (float("inf"), float("nan"), object(), {1, 2}, b"x"):
        with pytest.raises(InvalidArgument):
            py_literal(bad)
    for bad in ("a b", "x; import os", "class", "", 3, "é"):
        with pytest.raises(InvalidArgument):
            py_identifier(bad)
    for bad in ("torch.sum()", "torch..sum", "torch.sum;x", "torch.class"):
        with pytest.raises(InvalidArgument):
            py_dotted(bad)
    assert py_dotted("torch.nn.Linear") == "torch.nn.Linear"


PAYLOADS = [
    "x'); __import__('os').system('echo pwned') #",
    'x"""\nimport os\nos.system("echo pwned")\n"""',
    "\n\nraise SystemExit('pwned')\n",
    "{{ 7 * 7 }}{% raw %}",
    "\\', __import__('os'), '",
    "x\u2028y\x00z",
]


def _structure(text: str) -> str:
    """The module's AST with every string constant blanked: equal structures mean a value
    changed only string contents, never code."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
    return ast.dump(tree)


RENDERER = Renderer()


def _render(spec_text: str) -> dict[str, str]:
    return render_op_spec(parse_op_spec(load_yaml_text(spec_text, "specs/x.yaml")), RENDERER)


def _strings(text: str) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


SUM = (REPO / "specs/sum.yaml").read_text()
LINEAR = (REPO / "specs/linear.yaml").read_text()

# (spec text, line to replace, replacement with {} for the payload) for fields that must be
# validated names: every payload is a SpecError.
NAME_FIELDS = {
    "op": (SUM, "op: sum", "op: {}"),
    "target": (SUM, "  - torch.sum\n", "  - {}\n"),
    "operand role": (SUM, "  input:\n    kind: input", "  {}:\n    kind: input"),
    "operand kind": (SUM, "    kind: input", "    kind: {}"),
    "operand keyword": (SUM, "    keyword: input", "    keyword: {}"),
    "operand attribute": (LINEAR, "    attribute: weight ", "    attribute: {} "),
    "param name": (SUM, "  dim:\n    index: 1", "  {}:\n    index: 1"),
    "param keyword": (SUM, "    keyword: dim", "    keyword: {}"),
    "generator family": (SUM, "  family: rules", "  family: {}"),
    "option key": (SUM, "    keepdim_param: keepdim", "    {}: keepdim"),
    "option param reference": (SUM, "    keepdim_param: keepdim", "    keepdim_param: {}"),
    "predecessor target": (SUM, "    target: torch.nn.Linear", "    target: {}"),
    "predecessor kwarg name": (SUM, "      bias: false", "      {}: false"),
    "module kwarg name": (LINEAR, "    args: [16, 32]", "    args: [16, 32]\n    kwargs: {{{}: 1}}"),
    "input role": (SUM, "    input:\n      shape", "    {}:\n      shape"),
    "dtype": (SUM, "      dtype: float32", "      dtype: {}"),
    "grid key": (SUM, "    keepdim: [false, true]", "    {}: [false, true]"),
    "count where key": (LINEAR, "        bias: false", "        {}: false"),
    "count target": (LINEAR, "        bias: true\n      count: 131", "        bias: true\n      count: 131\n      target: {}"),
}

FREE_FAMILY = "test_free_options"


@dataclasses.dataclass(frozen=True)
class _FreeOptions:
    """A test-only family's options: any values, naming no parameter or operand."""

    values: tuple = ()
    refs: tuple = ()

    def check_operands(self, operands) -> None:
        pass


register_generator(FREE_FAMILY, parse=lambda options: _FreeOptions(tuple(options.items())))(lambda ctx: [])

# Fields whose strings are data: the payload must reach the output only as a string constant.
LITERAL_FIELDS = {
    "description": (SUM, "description: Sum over dims, following the layout of the producing op.",
                    "description: {}"),
    "param default": (SUM, "    default: null", "    default: {}"),
    # a family whose options are free values (the rules family validates its own at load)
    "option value": (LINEAR.replace("family: rules", f"family: {FREE_FAMILY}"), "    naming: colossalai ",
                     "    naming: {} "),
    "predecessor arg": (SUM, "    args: [16, 32]", "    args: [16, {}]"),
    "predecessor kwarg value": (SUM, "      bias: false", "      bias: {}"),
    "module arg": (LINEAR, "    args: [16, 32]", "    args: [16, {}]"),
    "grid value": (SUM, "    dim: [[0, 2], 1, -1, null]", "    dim: [[0, 2], 1, -1, null, {}]"),
}


def _inject(field: tuple[str, str, str], value: str) -> str:
    text, old, new = field
    assert text.count(old) == 1, old
    return text.replace(old, new.format(json.dumps(value)))


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("field", sorted(NAME_FIELDS))
def test_injection_into_name_fields_is_rejected(field, payload):
    with pytest.raises(SpecError) as info:
        _render(_inject(NAME_FIELDS[field], payload))
    assert info.value.file == "specs/x.yaml" and info.value.line is not None


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("field", sorted(LITERAL_FIELDS))
def test_injection_into_literal_fields_stays_a_string(field, payload):
    benign = _render(_inject(LITERAL_FIELDS[field], "benign"))
    hostile = _render(_inject(LITERAL_FIELDS[field], payload))
    assert benign.keys() == hostile.keys()
    for path in benign:
        assert _structure(hostile[path]) == _structure(benign[path]), path
    if field != "description":       # the description is documentation only
        assert any(payload in s for path in hostile for s in _strings(hostile[path])), field


def test_spec_file_name_cannot_inject_into_the_header(root):
    shutil.copy(root / "specs/sum.yaml", root / "specs/x\nimport os.yaml")
    with pytest.raises(SpecError, match="spec file names"):
        generate(root)


def test_spec_folder_path_cannot_inject_into_the_header(root, tmp_path_factory):
    outside = tmp_path_factory.mktemp("elsewhere") / "x\nimport os"
    shutil.copytree(root / "specs", outside)
    with pytest.raises(SpecError, match="spec path"):
        generate(root, outside)
    assert not (root / "generated_tests").exists()


def test_module_keyword_set_twice_is_an_error():
    text = LINEAR.replace("    args: [16, 32]", "    args: [16, 32]\n    kwargs: {bias: true}")
    with pytest.raises(SpecError, match="grid key 'bias' sets the module keyword 'bias'") as info:
        _render(text)
    assert info.value.line == text.splitlines().index("    bias: [false, true]          "
                                                      "# an optional operand: present or not (module: bias=...)") + 1


def test_the_generated_runs_cover_every_target_mesh_and_grid_point():
    """Simulated: every case on the smallest mesh (fewest axes, then ranks), every grid point on
    the other 2-D and 1-D ones, one on a 3-D one, the targets in turns; process: every mesh of
    one or two axes and every grid point; between the two every target on a real backend's
    share. The audit tests take the simulated runs over the audit's meshes."""
    from shardverify.spec.op_kind import process_runs, simulated_runs

    spec = parse_op_spec(load_yaml_text((REPO / "specs/scaled_dot_product_attention.yaml").read_text(),
                                         "specs/scaled_dot_product_attention.yaml"))
    cases, meshes = spec.cases(), [tuple(m) for m in spec.verify.meshes]
    points = {repr(c.point) for c in cases}
    simulated = simulated_runs(cases, meshes)
    smallest = min(meshes, key=lambda m: (len(m), math.prod(m)))
    for mesh in meshes:
        ran = [cases[i] for i, m, _ in simulated if m == mesh]
        if mesh == smallest:
            assert len(ran) == len(cases)
        elif len(mesh) == 3:
            assert len(ran) == 1                       # one grid point: the layouts multiply there
        else:
            assert {repr(c.point) for c in ran} == points and len(ran) == len(points)
    assert len({cases[i].target for i, m, _ in simulated if m != smallest}) > 1   # in turns
    assert any(len(m) == 3 for m in meshes)
    process = process_runs(cases, meshes)
    assert {m for _, m, _ in process} == {m for m in meshes if len(m) <= 2}
    assert {repr(cases[i].point) for i, _, _ in process} == points
    assert len({cases[i].target for i, _, _ in process}) > 1          # the targets take turns
    assert {m for _, m, _ in process_runs(cases, [(2, 2, 2)])} == {(2, 2, 2)}   # no smaller mesh: it runs
    spec = parse_op_spec(load_yaml_text((REPO / "specs/conv2d.yaml").read_text(), "specs/conv2d.yaml"))
    cases, audit_file = spec.cases(), REPO / "generated_tests/test_conv2d_audit.py"
    namespace: dict = {"__file__": str(audit_file)}
    exec(audit_file.read_text(), namespace)
    audited = [(p.values[0], p.values[1]) for p in namespace["RUNS"]]
    assert audited == [(cases[i].id, m) for i, m, _ in simulated_runs(cases, spec.audit_meshes)]
