"""Hostile and malformed specs: every one ends in a clear error or an inert generated file.

Each case runs `generate`, `generate --check`, `list` (and `verify` where the spec loads)
in-process against a temporary git checkout holding a copy of the real specs and generated
files: the command must not raise (no traceback), must name the problem, and a failing
command must leave `git status` exactly as it was."""

from __future__ import annotations

import ast
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardverify.cli.main import main

REPO = Path(__file__).resolve().parents[1]
SUM = (REPO / "specs" / "sum.yaml").read_text()
GENERATED = ("shardverify/strategies/handlers/generated", "generated_tests")


def git(root: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True,
                          env=env).stdout


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A git checkout with the op specs and their generated files (committed)."""
    (tmp_path / "specs").mkdir()
    for name in ("sum.yaml", "linear.yaml"):
        shutil.copy(REPO / "specs" / name, tmp_path / "specs" / name)
    for folder in GENERATED:
        (tmp_path / folder).mkdir(parents=True)
        for name in ("sum", "linear"):
            prefix = "test_" if folder == "generated_tests" else ""
            shutil.copy(REPO / folder / f"{prefix}{name}.py", tmp_path / folder / f"{prefix}{name}.py")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "base")
    return tmp_path


def run(capsys, *argv: str) -> tuple[int, str]:
    """Run the CLI in-process; any exception escaping it fails the test (it would be a traceback)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out + err


def fails_cleanly(capsys, root: Path, *needles: str, commands=("generate", "check", "list")) -> None:
    """Every command exits 2 (an input error) naming each needle, and leaves git status as it was."""
    before = git(root, "status", "--porcelain", "--untracked-files=all")
    argv = {"generate": ["generate"], "check": ["generate", "--check"], "list": ["list"],
            "verify": ["verify", "--mesh", "2"]}
    for command in commands:
        code, text = run(capsys, *argv[command], "--root", str(root))
        assert code == 2, f"{command}: {text}"
        for needle in needles:
            assert needle in text, f"{command}: {needle!r} not in\n{text}"
        assert git(root, "status", "--porcelain", "--untracked-files=all") == before, command


def spec(root: Path, text: str | bytes, name: str = "evil.yaml") -> Path:
    path = root / "specs" / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def op(text: str = SUM, **replace: str) -> str:
    """sum.yaml renamed to op `evil` with torch.prod targets, then the given replacements."""
    text = text.replace("op: sum", "op: evil").replace("torch.sum", "torch.prod").replace(
        "torch.Tensor.sum", "torch.Tensor.prod").replace("torch.Tensor.prod\n", "torch.Tensor.prod\n", 1)
    for old, new in replace.items():
        assert old.replace("_", " ") in text or old in text, old
        text = text.replace(old if old in text else old.replace("_", " "), new)
    return text


# ---------------------------------------------- group 2: two specs claiming one target

def test_a_second_spec_for_a_handled_target_names_both_files(root, capsys):
    spec(root, SUM.replace("op: sum", "op: mysum"), "mysum.yaml")
    fails_cleanly(capsys, root, "specs/mysum.yaml", "specs/sum.yaml", "torch.sum",
                  commands=("generate", "check", "list", "verify"))


def test_verify_of_one_named_spec_still_checks_the_others(root, capsys):
    spec(root, SUM.replace("op: sum", "op: mysum"), "mysum.yaml")
    code, text = run(capsys, "verify", "mysum", "--root", str(root))
    assert code == 2 and "specs/sum.yaml" in text and "specs/mysum.yaml" in text and "already handled" in text


def test_one_target_under_two_names_is_one_target(root, capsys):
    spec(root, SUM.replace("op: sum", "op: mysum").replace("  - torch.Tensor.sum\n", "")
         .replace("torch.sum", "torch.functional.torch.sum"), "mysum.yaml")
    fails_cleanly(capsys, root, "specs/sum.yaml", "specs/mysum.yaml", "is already handled by",
                  commands=("check",))


def test_a_conflicting_generated_handler_cannot_break_import(root):
    """Written by an older shardverify: a handler claiming torch.sum next to sum.py. Importing
    shardverify still works, `generate --check` reports it, `generate` removes it."""
    bad = (root / GENERATED[0] / "sum.py").read_text().replace("name='sum'", "name='mysum'").replace(
        "specs/sum.yaml", "specs/mysum.yaml")
    shutil.copytree(REPO / "shardverify", root / "shardverify", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "generated"))
    (root / GENERATED[0] / "__init__.py").write_text((REPO / GENERATED[0] / "__init__.py").read_text())
    (root / GENERATED[0] / "mysum.py").write_text(bad)
    script = "import shardverify, sys\nfrom shardverify.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
    env = {**os.environ, "PYTHONPATH": str(root)}

    def cli(*argv):
        done = subprocess.run([sys.executable, "-c", script, *argv, "--root", str(root)], capture_output=True,
                              text=True, env=env, cwd=root, timeout=300)
        assert "Traceback" not in done.stdout + done.stderr, done.stderr
        return done

    checked = cli("generate", "--check")
    assert checked.returncode == 1
    assert "is not registered" in checked.stderr and "already handled" in checked.stderr
    assert "orphan: shardverify/strategies/handlers/generated/mysum.py" in checked.stderr
    fixed = cli("generate")    # its header names specs/mysum.yaml, gone from specs/: removed
    assert fixed.returncode == 0 and "removed orphan shardverify/strategies/handlers/generated/mysum.py" in fixed.stdout
    again = cli("generate", "--check")
    assert again.returncode == 0, again.stderr


# --------------------------------------- group 3: generate never deletes without a reason

def test_an_empty_specs_dir_is_an_error_and_deletes_nothing(root, tmp_path_factory, capsys):
    empty = tmp_path_factory.mktemp("empty")
    for command in (["generate"], ["generate", "--check"], ["list"], ["verify"]):
        code, text = run(capsys, *command, "--root", str(root), "--specs-dir", str(empty))
        assert code == 2 and "no spec files" in text
    assert git(root, "status", "--porcelain", "--untracked-files=all") == ""


def test_a_missing_specs_dir_is_an_error(root, capsys):
    code, text = run(capsys, "generate", "--root", str(root), "--specs-dir", str(root / "nope"))
    assert code == 2 and "no spec folder" in text
    assert git(root, "status", "--porcelain") == ""


def test_another_specs_dir_leaves_files_generated_from_elsewhere(root, tmp_path_factory, capsys):
    other = tmp_path_factory.mktemp("other")
    shutil.copy(root / "specs" / "linear.yaml", other / "linear.yaml")
    code, text = run(capsys, "generate", "--root", str(root), "--specs-dir", str(other))
    assert "removed" not in text
    assert (root / "generated_tests/test_sum.py").exists()
    assert (root / GENERATED[0] / "sum.py").exists()


def test_a_deleted_spec_still_has_its_files_removed(root, capsys):
    (root / "specs" / "sum.yaml").unlink()
    code, text = run(capsys, "generate", "--root", str(root))
    assert code == 0 and "removed orphan generated_tests/test_sum.py" in text


def test_a_renamed_op_removes_the_files_of_its_old_name(root, capsys):
    spec(root, SUM.replace("op: sum", "op: total"), "sum.yaml")
    code, text = run(capsys, "generate", "--root", str(root))
    assert code == 0, text
    assert "removed orphan shardverify/strategies/handlers/generated/sum.py" in text
    assert (root / GENERATED[0] / "total.py").exists()


# ----------------------------------------------- group 4: malformed input, one SpecError

MALFORMED = {
    "nul byte": (op().replace("description:", "description: a\x00b\n_x:"), "U+0000", ":6"),
    "escape char": (op().replace("Sum over", "Sum\x1b[2J over"), "U+001B", ":6"),
    "bidi override": (op().replace("Sum over", "Sum \u202e over"), "U+202E", ":6"),
    "deep flow list": (op().replace("dim: [[0, 2], 1, -1, null]", "dim: " + "[" * 5000 + "]" * 5000),
                       "nests deeper than 32", ""),
    "deep block mapping": ("op: evil\nx:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 60)) + "  " * 60 + "v\n",
                           "nests deeper than 32", ""),
    "5000-digit int": (op().replace("  meshes:", "  seed: " + "9" * 5000 + "\n  meshes:"),
                       "longer than the limit", ""),
    "4000-digit int": (op().replace("  meshes:", "  seed: " + "9" * 4000 + "\n  meshes:"),
                       "does not fit in 64 bits", ""),
    "int beyond 64 bits": (op().replace("    - [4]\n", "    - [4]\n  strategies: [{mesh: [2, 2], count: "
                                        "123456789012345678901234567890}]\n"),
                           "does not fit in 64 bits", ""),
    "300-char op name": (op().replace("op: evil", "op: " + "a" * 300), "at most 64", ":5"),
    "300-char operand": (op().replace("  input:\n    kind", "  " + "b" * 300 + ":\n    kind"), "at most 64", ""),
    "huge string": (op().replace("Sum over dims", "x" * 5000), "longer than the limit", ":6"),
    "not utf-8": (op().encode().replace(b"Sum over", b"Sum \xff over"), "not UTF-8", ":6"),
    "tab indentation": (op().replace("  input:\n    kind", "\tinput:\n    kind"), "invalid YAML", ""),
}


@pytest.mark.parametrize("text, needle, line", MALFORMED.values(), ids=list(MALFORMED))
def test_malformed_specs_are_one_spec_error(root, capsys, text, needle, line):
    spec(root, text)
    fails_cleanly(capsys, root, "specs/evil.yaml" + line, needle)


def test_a_file_over_a_mebibyte_is_refused(root, capsys):
    spec(root, op() + "#" * (1 << 20) + "\n")
    fails_cleanly(capsys, root, "specs/evil.yaml", "larger than")


@pytest.mark.parametrize("target", ["dangling", "loop", "valid"])
def test_any_symlinked_spec_is_an_error(root, capsys, target):
    link = root / "specs" / "evil.yaml"
    if target == "dangling":
        link.symlink_to(root / "specs" / "gone.yaml")
    elif target == "loop":
        link.symlink_to(link)
    else:
        (root.parent / "outside.yaml").write_text(op())
        link.symlink_to(root.parent / "outside.yaml")
    fails_cleanly(capsys, root, "specs/evil.yaml", "symbolic link")


def test_a_directory_named_like_a_spec_is_an_error(root, capsys):
    (root / "specs" / "evil.yaml").mkdir()
    (root / "specs" / "evil.yaml" / "keep").write_text("")
    fails_cleanly(capsys, root, "specs/evil.yaml", "not a regular file")


# ----------------------------------------------------------------------- group 6: limits

def test_a_million_point_grid_is_refused_quickly(root, capsys):
    grid = "".join(f"    k{i}: [{', '.join(str(v) for v in range(10))}]\n" for i in range(6))
    text = op().replace("    dim: [[0, 2], 1, -1, null]\n    keepdim: [false, true]\n", grid)
    text = text.replace("  input:\n    kind: input", "  input:\n    kind: input").replace(
        "  dim:\n    index: 1", "".join(f"  k{i}:\n    index: {i + 3}\n" for i in range(6)) + "  dim:\n    index: 1")
    spec(root, text)
    fails_cleanly(capsys, root, "specs/evil.yaml", "2000000 cases", "exceed the limit of 512",
                  "SHARDVERIFY_MAX_CASES")


def test_a_million_rank_mesh_is_refused(root, capsys):
    spec(root, op().replace("    - [4]\n", "    - [1000000]\n"))
    fails_cleanly(capsys, root, "specs/evil.yaml", "1000000 ranks in one mesh exceed the limit of 64",
                  "SHARDVERIFY_MAX_RANKS")


def test_verify_refuses_a_mesh_beyond_the_limit_as_an_input_error(capsys):
    with pytest.raises(SystemExit) as stop:   # every --mesh is bounded where it is parsed (limits.mesh_problem)
        main(["verify", "sum", "--mesh", "1000000", "--root", str(REPO)])
    assert stop.value.code == 2 and "exceed the limit of 64" in capsys.readouterr().err


def test_a_huge_input_is_refused(root, capsys):
    spec(root, op().replace("shape: [4, 4, 4, 16]", "shape: [100000, 100000, 4, 16]"))
    fails_cleanly(capsys, root, "specs/evil.yaml", "exceed the limit of 16777216",
                  "SHARDVERIFY_MAX_TENSOR_ELEMENTS")


def test_limits_can_be_raised(root, capsys, monkeypatch):
    spec(root, op().replace("    - [4]\n", "    - [128]\n"))
    fails_cleanly(capsys, root, "128 ranks", commands=("check",))
    monkeypatch.setenv("SHARDVERIFY_MAX_RANKS", "256")
    code, text = run(capsys, "generate", "--check", "--root", str(root))
    assert "128 ranks" not in text and "missing: generated_tests/test_evil.py" in text


def test_a_bad_limit_override_is_a_clear_error(root, capsys, monkeypatch):
    monkeypatch.setenv("SHARDVERIFY_MAX_RANKS", "lots")
    fails_cleanly(capsys, root, "SHARDVERIFY_MAX_RANKS", "not a positive integer", commands=("check", "list"))


# ------------------------------------------------ group 5: cases that cannot run

def verify_rows(capsys, root, text):
    spec(root, text)
    code, out = run(capsys, "verify", "--root", str(root), "--mesh", "2", "-v")
    return code, out


def test_a_target_that_cannot_be_traced_is_a_failed_row(root, capsys):
    code, out = verify_rows(capsys, root, op().replace("  - torch.prod\n  - torch.Tensor.prod\n",
                                                       "  - torch.numel\n"))
    assert code == 1
    assert "evil torch.numel-dim_1-keepdim_False on mesh (2,): FAILED:" in out
    assert "unexpected keyword argument 'dim'" in out
    assert "\nsum " in out            # the other specs' rows still ran
    assert git(root, "status", "--porcelain", "--untracked-files=all").strip() == "?? specs/evil.yaml"
    code, out = run(capsys, "list", "--root", str(root))    # listing runs no op: nothing to say of it
    assert code == 0 and "evil" in out and "cannot be built" not in out


def test_a_grid_value_the_op_rejects_is_a_failed_row(root, capsys):
    code, out = verify_rows(capsys, root, op().replace("dim: [[0, 2], 1, -1, null]", "dim: [7, 1]"))
    assert code == 1 and "torch.prod-dim_7" in out and out.startswith("FAIL  ")


def test_a_module_kwarg_the_constructor_rejects_is_a_failed_row(root, capsys):
    text = (REPO / "specs" / "linear.yaml").read_text().replace("op: linear", "op: linear").replace(
        "    args: [16, 32]\n", "    args: [16, 32]\n    kwargs:\n      device: nonsense\n")
    spec(root, text, "linear.yaml")
    code, out = run(capsys, "verify", "--root", str(root), "--mesh", "4", "-v")
    assert code == 1
    assert "torch.nn.Linear-bias_False on mesh (4,): FAILED:" in out and "nonsense" in out
    assert re.search(r"linear +torch.nn.functional.linear-bias_False +4 +\d+ +0 ", out)   # other rows ran
    assert out.startswith("FAIL  ") and "PASS" not in out


# ------------------------------------- already solid: injections, traversal, tags, aliases

REFUSED = {
    "op name with code": (op().replace("op: evil", 'op: "x; import os"'), "Python identifier"),
    "path traversal op": (op().replace("op: evil", "op: ../../etc/passwd"), "Python identifier"),
    "target outside torch": (op().replace("  - torch.prod\n", "  - os.system\n"), "not under 'torch'"),
    "private target": (op().replace("  - torch.prod\n", "  - torch._C._nn\n"), "dotted name"),
    "python tag": (op().replace("description: ", "description: !!python/object/apply:os.system ['true'] #"),
                   "tag"),
    "custom tag": (op().replace("description: ", "description: !evil "), "tag"),
    "alias bomb": ("a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n" + op(), "aliases"),
    "merge key": (op().replace("  input:\n    kind: input\n", "  base: &m {kind: input}\n  input:\n    <<: *m\n"),
                  "alias"),
    "keyword as name": (op().replace("op: evil", "op: import"), "not a keyword"),
    "infinite tolerance": (op().replace("  meshes:", "  tolerance:\n    rtol: .inf\n  meshes:"), "finite number"),
    "NaN tolerance": (op().replace("  meshes:", "  tolerance:\n    atol: .nan\n  meshes:"), "finite number"),
    "NaN grid value": (op().replace("dim: [[0, 2], 1, -1, null]", "dim: [.nan, 1]"), "finite number"),
}


@pytest.mark.parametrize("text, needle", REFUSED.values(), ids=list(REFUSED))
def test_hostile_values_are_refused(root, capsys, text, needle):
    spec(root, text)
    fails_cleanly(capsys, root, "specs/evil.yaml", needle)


def test_injection_through_free_text_stays_an_inert_string(root, capsys):
    payload = '"""; import os; os.system(\'touch pwned\'); x = """'
    spec(root, op().replace("description: Sum over dims, following the layout of the producing op.",
                            "description: " + repr(payload).replace("\\'", "''")))
    code, text = run(capsys, "generate", "--root", str(root))
    assert code == 0, text
    for path in (root / GENERATED[0] / "evil.py", root / "generated_tests" / "test_evil.py"):
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert "os" not in names
    assert not (root / "pwned").exists()


@pytest.mark.parametrize("name", ["../../../etc/passwd", "/etc/passwd", "specs/../../x.yaml"])
def test_path_traversal_in_a_named_spec_is_an_error(root, capsys, name):
    for command in (["generate", name], ["generate", "--check", name], ["verify", name]):
        code, text = run(capsys, *command, "--root", str(root))
        assert code == 2 and "no spec named" in text
    assert git(root, "status", "--porcelain", "--untracked-files=all") == ""


# ------------------------------------------ smaller: shapes that divide no mesh, a warning

def test_a_case_with_only_the_replicated_strategy_is_a_warning(root, capsys):
    """sum.yaml with one-element dims: the Linear before the sum has only its replicated strategy
    on a 2 x 2 mesh (a dim of one element is never split), so the sum has only one too. `verify`
    says so (`list` runs no op)."""
    text = SUM.replace("shape: [4, 4, 4, 16]", "shape: [1, 1, 1, 1]").replace("args: [16, 32]", "args: [1, 1]")
    text = text.replace("    dim: [[0, 2], 1, -1, null]\n    keepdim: [false, true]\n", "    dim: [1]\n    keepdim: [false]\n")
    text = text.replace("    - [4]\n", "    - [4]\n  strategies:\n    - mesh: [2, 2]\n      count: 1\n")
    spec(root, text, "sum.yaml")
    code, out = run(capsys, "verify", "sum", "--root", str(root), "--mesh", "2,2")
    assert code == 0 and out.startswith("PASS  ")
    assert "\nnote: only the replicated strategy exists for 2 cases on their mesh, so no sharding was checked " in out
    code, out = run(capsys, "verify", "sum", "--root", str(root), "--mesh", "2,2", "-v")
    assert "only the replicated strategy exists for 2 cases on their mesh, so no sharding was checked there (" in out
    assert "\n  sum on mesh (2, 2): torch.sum-dim_1-keepdim_False, " in out   # one line per op and mesh


# ------------------------------------- reading a spec runs nothing (op targets, factories)

PLAN = """\
name: evil
model:
  factory: {factory}
  kwargs: {kwargs}
inputs: {{x: [4, 8]}}
mesh: [2]
plans:
  solver: solver
"""


def trap_module(tmp_path: Path, monkeypatch, body: str) -> Path:
    """A module `trap` on sys.path whose import writes the returned marker file (a module of
    that name imported by an earlier test is forgotten), named by the user's setting: a spec
    may name it (spec/allow.py)."""
    marker = tmp_path / "imported"
    (tmp_path / "trap.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n\n{body}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SHARDVERIFY_TRUSTED_TARGETS", "trap")
    monkeypatch.delitem(sys.modules, "trap", raising=False)
    return marker


@pytest.mark.parametrize("target, needle", [
    ("torch.save", "defined in torch.serialization"),
    ("torch.load", "defined in torch.serialization"),
    ("torch.from_file", "takes a file name ('filename')"),
    ("torch.ops.aten.save.default", "takes a file name ('filename')"),
    ("torch.os.system", "defined in posix"),
    ("torch.sys.exit", "defined in sys"),
    ("torch.serialization.pickle.loads", "is not a tensor op"),
    ("torch.compile", "not a tensor op"),
    ("torch.hub.load", "defined in torch.hub"),
])
def test_an_op_target_that_is_no_tensor_op_is_refused_unrun(root, capsys, tmp_path, target, needle):
    """torch.save with a file name in the grid: before, `list` built the case and wrote the file."""
    written = tmp_path / "written.pt"
    text = op().replace("  - torch.prod\n  - torch.Tensor.prod\n", f"  - {target}\n")
    text = text.replace("dim: [[0, 2], 1, -1, null]", f"dim: [{str(written)!r}]")
    spec(root, text)
    fails_cleanly(capsys, root, "specs/evil.yaml", f"target '{target}'", needle,
                  commands=("generate", "check", "list", "verify"))
    assert not written.exists()


def test_a_trusted_module_may_hold_targets(root, capsys, monkeypatch):
    """The machine, never the spec, may trust a module of the user's for targets."""
    text = op().replace("  - torch.prod\n  - torch.Tensor.prod\n", "  - shardverify.plan.zoo.mlp_block\n")
    spec(root, text)
    fails_cleanly(capsys, root, "is not under 'torch'", "SHARDVERIFY_TRUSTED_TARGETS", commands=("check",))
    monkeypatch.setenv("SHARDVERIFY_TRUSTED_TARGETS", "os")
    fails_cleanly(capsys, root, "SHARDVERIFY_TRUSTED_TARGETS", "cannot be trusted", commands=("check",))


@pytest.mark.parametrize("factory, kwargs, needle", [
    ("os.system", "{command: 'touch x'}", "in no module the user named"),
    ("subprocess.run", "{args: [ls]}", "'subprocess'"),
    ("torch.hub.load", "{}", "is defined in 'torch.hub', in no module the user named"),
    ("trap.make", "{width: 2}", None),           # read, not imported: accepted, nothing ran
    ("trap.make", "{depth: 2}", "does not bind"),
    ("trap.nope", "{}", "has no attribute 'nope'"),
])
def test_a_plan_spec_is_read_not_run(root, capsys, tmp_path, monkeypatch, factory, kwargs, needle):
    marker = trap_module(tmp_path, monkeypatch, "def make(width=4):\n    open('/dev/null')\n")
    spec(root, PLAN.format(factory=factory, kwargs=kwargs), "plans/evil.yaml") \
        if (root / "specs" / "plans").mkdir(exist_ok=True) is None else None
    if needle is None:
        code, text = run(capsys, "list", "--root", str(root))
        assert code == 0 and "plan evil" in text, text
    else:
        fails_cleanly(capsys, root, "specs/plans/evil.yaml:3: field 'model.factory'"
                      if "bind" not in needle else "specs/plans/evil.yaml:4", needle)
    assert not marker.exists() and not (root / "x").exists()


def test_a_collective_implementation_is_read_not_imported(root, capsys, tmp_path, monkeypatch):
    marker = trap_module(tmp_path, monkeypatch, "def my_all_reduce(comm, t, axes):\n    return t\n")
    text = (REPO / "specs" / "collectives" / "all_reduce.yaml").read_text()
    text = text.replace("shardverify.collectives.functional.all_reduce", "trap.my_all_reduce")
    (root / "specs" / "collectives").mkdir()
    spec(root, text, "collectives/all_reduce.yaml")
    code, out = run(capsys, "generate", "--check", "--root", str(root))
    assert "implementation" not in out and not marker.exists(), out


@pytest.mark.parametrize("body, kwargs, needle", [
    ("def make(width=4):\n    raise RuntimeError('boom')\n", "{}", "raised RuntimeError: boom"),
    ("def make(width=4):\n    return 3\n", "{}", "returned a int, not a torch.nn.Module"),
    ("import torch\ndef make(width=4):\n    return torch.nn.Linear(width, 4)\n", "{width: -3}",
     "raised RuntimeError"),
    ("import torch\ndef make(width=4):\n    return torch.nn.Linear(width, width)\n", "{width: 120000}",
     "exceed the limit of 1073741824 (raise it with SHARDVERIFY_MAX_MODEL_BYTES=N)"),
    ("import torch\ndef make(width=4):\n    return torch.nn.Linear(3, 4)\n", "{}",
     "does not fit Linear: its first layer (the model itself: Linear, which wants shape [..., 3])"),
])
def test_a_failing_factory_is_one_line_naming_the_spec(tmp_path, monkeypatch, capsys, body, kwargs, needle):
    """Built only by `shardverify plan` (and the generated test): every failure is one line
    naming the spec's factory field, exit 2; a 57 GB model is refused before any allocation."""
    trap_module(tmp_path, monkeypatch, body)
    path = tmp_path / "evil.yaml"
    path.write_text(PLAN.format(factory="trap.make", kwargs=kwargs))
    code, text = run(capsys, "plan", str(path), "--backend", "simulated")
    assert code == 2, text
    assert needle in text and text.count("\n") == 1, text
    if "does not fit" not in needle:   # the model was built: the input that does not fit is named instead
        assert "evil.yaml:3: field 'model.factory'" in text, text


def test_a_reshard_spec_on_many_axes_is_refused_at_once(root, capsys):
    (root / "specs" / "reshard").mkdir()
    spec(root, "name: six\nmesh: [2, 2, 2, 2, 2, 2]\nshapes: [[8, 8, 8]]\n", "reshard/six.yaml")
    fails_cleanly(capsys, root, "specs/reshard/six.yaml:2", "SHARDVERIFY_MAX_MESH_AXES")
    spec(root, "name: six\nmesh: [2, 2, 2, 2]\nshapes: [[8, 8, 8]]\n", "reshard/six.yaml")
    fails_cleanly(capsys, root, "specs/reshard/six.yaml:3", "SHARDVERIFY_MAX_RESHARD_PAIRS")
    spec(root, "name: six\nmesh: [4, 4, 4]\nshapes: [[4096, 4096, 4096]]\n", "reshard/six.yaml")
    fails_cleanly(capsys, root, "specs/reshard/six.yaml:3", "SHARDVERIFY_MAX_TENSOR_ELEMENTS")


@pytest.mark.parametrize("argv", [
    ["calibrate", "--backend", "gloo", "--mesh", "128"],
    ["plan", "shardverify.plan.zoo.mlp_block", "--input", "8,32", "--mesh", "128"],
])
def test_a_command_starting_a_process_per_rank_refuses_128_ranks(capsys, argv):
    """`calibrate --mesh 128` started 131 processes; every command now applies the rank limit."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv) if argv[0] == "calibrate" else sys.exit(main(argv))
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and "128 ranks in one mesh exceed the limit of 64" in out + err
    assert "Traceback" not in out + err


def test_a_model_spec_has_the_rank_limit(root, capsys):
    text = (REPO / "specs" / "models" / "mlp.yaml").read_text()
    (root / "specs" / "models").mkdir()
    spec(root, text.replace("meshes: [[2], [4]]", "meshes: [[2], [128]]"), "models/mlp.yaml")
    fails_cleanly(capsys, root, "specs/models/mlp.yaml", "128 ranks in one mesh exceed the limit of 64")


def test_a_spec_problem_is_one_error_not_every_strategy_failing(root, capsys):
    """A float8 dtype (no random draw; complex ones are compared as their two parts), a CUDA device on
    a machine without one, exploring a spec that says `explore: false`: before, each showed up as every
    strategy failing with torch's error."""
    spec(root, op().replace("      dtype: float32\n", "      dtype: float8_e4m3fn\n", 1))
    fails_cleanly(capsys, root, "torch.float8_e4m3fn is a dtype a check cannot draw values in",
                  commands=("generate", "check", "list", "verify"))
    (root / "specs" / "evil.yaml").unlink()
    if not torch.cuda.is_available():
        code, text = run(capsys, "verify", "sum", "--root", str(root), "--device", "cuda")
        assert code == 2 and "needs a CUDA GPU" in text and text.count("\n") == 1, text
    spec(root, SUM.replace("verify:\n", "verify:\n  explore: false\n", 1), "sum.yaml")
    code, text = run(capsys, "explore", "sum", "--root", str(root))
    assert code == 2 and "says `explore: false`" in text, text


@pytest.mark.parametrize("text, argv, needle", [
    ("", [], "the file is empty; expected a mapping"),
    ("- a\n- b\n", [], "expected a mapping, got a list"),
    ("name: [\n", [], "invalid YAML"),
    (None, ["--input", "a,b"], "--input 'a,b': expected [NAME=][DTYPE][SHAPE][:LOW..HIGH]"),
    (None, ["--input", "8,32", "--mesh", "abc"], "got 'abc'"),
])
def test_plan_command_bad_input_is_one_line_exit_2(tmp_path, capsys, text, argv, needle):
    if text is None:
        target = "shardverify.plan.zoo.mlp_block"
    else:
        target = str(tmp_path / "plan.yaml")
        (tmp_path / "plan.yaml").write_text(text)
    code, out = run(capsys, "plan", target, *argv)
    assert code == 2 and needle in out and out.count("\n") == 1, out
