"""A newcomer adds torch.nansum by copying specs/sum.yaml, generates, and runs the generated
test to green, all in a temporary copy of the repository."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # a spec generated, imported and verified in fresh processes

REPO = Path(__file__).resolve().parents[1]

# The newcomer's edits to a copy of specs/sum.yaml: the op and its targets (the grid is
# trimmed only to keep this test quick).
EDITS = [
    ("op: sum", "op: nansum"),
    ("  - torch.sum\n", "  - torch.nansum\n"),
    ("  - torch.Tensor.sum\n", "  - torch.Tensor.nansum\n"),
    ("    dim: [[0, 2], 1, -1, null]", "    dim: [[0, 2], -1]"),
]


def _copy_repo(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "shardverify", dest / "shardverify", ignore=ignore)
    shutil.copytree(REPO / "specs", dest / "specs", ignore=ignore)
    for name in ("pyproject.toml", "conftest.py"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, dest / name)


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AUTO_PARALLEL", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(cwd)  # the copy shadows the installed (editable) package
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_a_new_op_spec_generates_and_verifies(tmp_path):
    _copy_repo(tmp_path)
    probe = _run(["-c", "import shardverify; print(shardverify.__file__)"], tmp_path, 60)
    assert probe.stdout.strip() == str(tmp_path / "shardverify" / "__init__.py"), probe

    text = (tmp_path / "specs" / "sum.yaml").read_text()
    for old, new in EDITS:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (tmp_path / "specs" / "nansum.yaml").write_text(text)

    generated = _run(["-m", "shardverify", "generate"], tmp_path, 120)
    assert generated.returncode == 0, generated.stdout + generated.stderr
    assert "created generated_tests/test_nansum.py" in generated.stdout
    assert "created shardverify/strategies/handlers/generated/nansum.py" in generated.stdout
    test_file = tmp_path / "generated_tests" / "test_nansum.py"
    assert "from specs/nansum.yaml" in test_file.read_text().splitlines()[0]
    checked = _run(["-m", "shardverify", "generate", "--check"], tmp_path, 120)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    result = _run(["-m", "pytest", "generated_tests/test_nansum.py", "-q", "-rs"], tmp_path, 540)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    passed = re.search(r"(\d+) passed", output)
    skipped = re.search(r"(\d+) skipped", output)
    # on the simulated backend every case on the smallest mesh (2 targets x 4 grid points) and
    # every grid point once on the other, the targets in turns (sum.yaml pins no strategy
    # counts); the process-backend runs (every grid point and every mesh at least once: 4 runs,
    # the targets taking turns) skip without AUTO_PARALLEL
    assert passed is not None and int(passed.group(1)) == 2 * 4 + 4, output
    assert skipped is not None and int(skipped.group(1)) == 4, output
