"""The README stays true: it reads in minutes, every command it shows runs, and every output it
shows is what the command prints.

- README.md has at most 120 lines.
- Its first ```sh block is CI's: the install line (which ends in `shardverify verify --jobs auto`
  over every shipped spec, minutes of CPU) and the whole suite. They run as written only in a fresh
  environment, so each of their commands must appear in `.ci/run`, which runs them.
- Every other command of a ```sh block runs here, from the repository root, `.venv/bin/` read as
  the running interpreter's bin folder, and exits with its status in EXIT_STATUS (0 when not listed).
- A ```text block right after a command's block is that command's output: each of its lines but
  `...` must be a line of the real output (stdout, then stderr), in order, every number read as
  any number (counts and timings vary); a line that ends in `...` matches the start of one.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CI = REPO / ".ci" / "run"
MOST_LINES = 120
VENV_BIN = ".venv/bin/"

#: the first block as it must stay: CI and newcomers run exactly these two lines
CI_BLOCK = (
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e '.[models,cluster]' && .venv/bin/shardverify verify --jobs auto",
    "AUTO_PARALLEL=1 .venv/bin/pytest -n auto",
)

#: commands that must fail, and how: the failing-strategy example of the tour
EXIT_STATUS = {
    ".venv/bin/shardverify dtensor --custom examples/row_normalize.yaml --mesh 4": 1,
}

NUMBER = re.compile(r"\d+(?:[.,]\d+)*(?:e[-+]?\d+)?")


@dataclass(frozen=True)
class Block:
    lang: str
    lines: tuple[str, ...]
    first: int          # line number of the opening fence (1-based)
    last: int           # line number of the closing fence


def blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, in order."""
    found, lines = [], text.splitlines()
    at = 0
    while at < len(lines):
        if lines[at].startswith("```"):
            lang, start = lines[at][3:].strip(), at
            at += 1
            while at < len(lines) and not lines[at].startswith("```"):
                at += 1
            assert at < len(lines), f"README.md:{start + 1}: a code block that is never closed"
            found.append(Block(lang, tuple(lines[start + 1:at]), start + 1, at + 1))
        at += 1
    return found


def commands(block: Block) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines left out."""
    joined, pending = [], ""
    for line in block.lines:
        if line.endswith("\\"):
            pending += line[:-1]
            continue
        line, pending = pending + line, ""
        if line.strip() and not line.lstrip().startswith("#"):
            joined.append(shlex.join(shlex.split(line, comments=True)) if "#" in line else line.strip())
    return joined


def readme_blocks() -> list[Block]:
    return blocks(README.read_text())


def excerpts() -> list[tuple[str, Block | None]]:
    """Every command of every ```sh block after CI's, with the ```text block right after its block
    (only blank lines between), if any."""
    found, all_blocks = [], readme_blocks()
    lines = README.read_text().splitlines()
    shells = [i for i, b in enumerate(all_blocks) if b.lang == "sh"]
    for index in shells[1:]:
        block = all_blocks[index]
        after = all_blocks[index + 1] if index + 1 < len(all_blocks) else None
        if after is not None and not (after.lang == "text" and not any(
                line.strip() for line in lines[block.last:after.first - 1])):
            after = None
        found.extend((command, after) for command in commands(block))
    return found


def normalised(line: str) -> str:
    return NUMBER.sub("#", line.rstrip())


def unmatched(excerpt: tuple[str, ...], output: list[str]) -> list[str]:
    """The excerpt's lines not found in ``output`` in order (numbers aside; `...` skips, a line ending
    in `...` matches a line's start)."""
    real = [normalised(line) for line in output]
    at, missing = 0, []
    for line in excerpt:
        if line.strip() in ("", "..."):
            continue
        want = normalised(line)
        prefix = want.endswith("...")
        want = want[:-3] if prefix else want
        hit = next((i for i in range(at, len(real)) if (real[i].startswith(want) if prefix else real[i] == want)), None)
        if hit is None:
            missing.append(line)
        else:
            at = hit + 1
    return missing


def ci_lines() -> list[list[str]]:
    """Each command line of .ci/run as tokens, CI's venv read as the README's `.venv` and its
    `--quiet` left out."""
    text = CI.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        tokens = [t.replace("$venv", ".venv") for t in tokens if t not in ("--quiet", "-q")]
        if tokens:
            out.append(tokens)
    return out


def runs_in_ci(command: list[str], lines: list[list[str]]) -> bool:
    n = len(command)
    return any(line[i:i + n] == command for line in lines for i in range(len(line) - n + 1))


def test_the_readme_reads_in_minutes():
    count = len(README.read_text().splitlines())
    assert count <= MOST_LINES, f"README.md has {count} lines; keep it at {MOST_LINES} at most and move detail to docs/"


def test_the_first_block_is_cis_two_lines():
    first = readme_blocks()[0]
    assert first.lang == "sh" and tuple(commands(first)) == CI_BLOCK, (
        f"README.md:{first.first}: the first code block must stay {CI_BLOCK} (CI and newcomers run it as written)")


def test_every_command_of_the_first_block_runs_in_ci():
    lines = ci_lines()
    missing = []
    for command in CI_BLOCK:
        tokens = shlex.split(command)
        pieces, piece = [], []
        for token in tokens + ["&&"]:
            if token == "&&":
                pieces.append(piece)
                piece = []
            else:
                piece.append(token)
        missing += [" ".join(p) for p in pieces if not runs_in_ci(p, lines)]
    assert not missing, f".ci/run does not run these README commands: {missing}"


def test_every_other_command_is_one_this_test_runs():
    found = excerpts()
    assert found, "the README shows no command after its first block"
    wrong = [command for command, _ in found if not command.startswith(VENV_BIN)]
    assert not wrong, f"README commands must run from the virtual environment ({VENV_BIN}...): {wrong}"
    shown = {command for command, _ in found}
    assert set(EXIT_STATUS) <= shown, f"EXIT_STATUS names commands the README no longer shows: {set(EXIT_STATUS) - shown}"


def test_every_output_block_follows_one_command():
    all_blocks = readme_blocks()
    paired = {block.first for _, block in excerpts() if block is not None}
    loose = [b.first for b in all_blocks if b.lang == "text" and b.first not in paired]
    assert not loose, f"README.md: output blocks at lines {loose} follow no command's block"
    for index, block in enumerate(all_blocks[1:], start=1):
        if block.lang == "text" and all_blocks[index - 1].lang == "sh":
            assert len(commands(all_blocks[index - 1])) == 1, f"README.md:{block.first}: whose output is this?"


def _run(command: str) -> subprocess.CompletedProcess[str]:
    argv = shlex.split(command)
    argv[0] = str(Path(sys.executable).parent / argv[0][len(VENV_BIN):])
    for at, token in enumerate(argv[:-1]):
        if token == "--html":
            Path(argv[at + 1]).unlink(missing_ok=True)
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.slow   # each a fresh shardverify process: imports, a model or a DTensor sweep
@pytest.mark.parametrize("command, excerpt", excerpts(), ids=[command[len(VENV_BIN):] for command, _ in excerpts()])
def test_the_readme_command_prints_what_the_readme_shows(command, excerpt):
    result = _run(command)
    output = result.stdout.splitlines() + result.stderr.splitlines()
    expected = EXIT_STATUS.get(command, 0)
    assert result.returncode == expected, (
        f"`{command}` exited {result.returncode}, the README says {expected}:\n{result.stdout}\n{result.stderr}")
    if excerpt is not None:
        missing = unmatched(excerpt.lines, output)
        assert not missing, (f"README.md:{excerpt.first}: lines the command no longer prints (numbers aside):\n"
                             + "\n".join(missing) + "\n-- it printed:\n" + "\n".join(output))
    argv = shlex.split(command)
    if "--html" in argv:
        page = Path(argv[argv.index("--html") + 1])
        assert page.read_text().startswith("<!DOCTYPE html>"), f"`{command}` wrote no page to {page}"
        page.unlink()
