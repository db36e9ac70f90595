"""A newcomer's edit-check loop, priced: `shardverify generate OP` and `shardverify verify OP --mesh 2`
for one new op spec, in CPU seconds of the child processes, against the floor every command pays,
`python -c "import torch"`, measured in the same run.

The loop runs in a temporary copy of the package and the specs (the generated handler of the new
op must be importable for `verify` to find it), with the new spec written next to the others:
specs/mm.yaml copied as `inner` (torch.inner, the einsum mk,nk->mn). Each round edits the spec
(its description, so `generate` rewrites its files), then times, each in a fresh process:

  floor     python -c "import torch"
  generate  shardverify generate inner
  verify    shardverify verify inner --mesh 2
  loop      generate + verify

One untimed round first compiles the copy's bytecode, as a checkout that has run once has it
(PYTHONDONTWRITEBYTECODE is dropped for the copy: without bytecode every command compiles the
package's sources again, some 0.6 CPU s more).
The figures are the minimum and median over ``--rounds`` rounds (CPU time, user + system, of the
child processes: never the wall clock), with each command's minimum over the floor's. The target:
each command within 3 CPU seconds (`generate OP` and `verify OP` read the named spec and the
claims of the others, not every spec).

    .venv/bin/python benchmarks/bench_edit_loop.py              # 5 rounds
    .venv/bin/python benchmarks/bench_edit_loop.py --quick      # 1 round (CI's smoke run)
    .venv/bin/python benchmarks/bench_edit_loop.py --rounds 9 --json

A command that fails (or a copy that does not import the copied package) ends the benchmark with
exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OP = "inner"
#: specs/mm.yaml's lines made into the new spec: torch.inner(input, other) = input @ other.T
EDITS = (("op: mm", f"op: {OP}"),
         ("targets: [torch.mm, torch.Tensor.mm, torch.ops.aten.mm.default]", "targets: [torch.inner, torch.Tensor.inner]"),
         ("mat2", "other"),
         ('"mk,kn->mn"', '"mk,nk->mn"'),
         ("{shape: [16, 8]}", "{shape: [8, 16]}"))
COLUMNS = ("floor", "generate", "verify", "loop")


class Failed(Exception):
    """A command of the loop failed: no figure."""


def new_spec(round_number: int) -> str:
    """The new spec's text, its description naming the round (an edit each round)."""
    text = (REPO / "specs" / "mm.yaml").read_text(encoding="utf-8")
    for old, new in EDITS:
        if old not in text:
            raise Failed(f"specs/mm.yaml no longer holds {old!r}: update EDITS in {Path(__file__).name}")
        text = text.replace(old, new)
    lines = text.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("description:"))
    lines[at] = f"description: torch.inner of two matrices, the einsum mk,nk->mn (edit {round_number}).\n"
    return "".join(lines)


def copy_checkout(dest: Path) -> None:
    """The package and the specs, no bytecode (the warm-up round compiles the copy's own)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "shardverify", dest / "shardverify", ignore=ignore)
    shutil.copytree(REPO / "specs", dest / "specs", ignore=ignore)


def child_cpu(args: list[str], cwd: Path, env: dict[str, str]) -> float:
    """CPU seconds (user + system) of one child process run to its end; Failed if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise Failed(f"{' '.join(args[1:])} exited with status {done.returncode}:\n{(done.stdout + done.stderr)[-2000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def modules_entered(args: list[str], cwd: Path, env: dict[str, str]) -> int:
    """How many of the package's modules one command imports (``python -X importtime``'s lines
    naming ``shardverify``): what its start-up reads besides torch."""
    done = subprocess.run([args[0], "-X", "importtime", *args[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise Failed(f"{' '.join(args[1:])} exited with status {done.returncode}:\n{done.stderr[-2000:]}")
    names = [line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    return sum(name == "shardverify" or name.startswith("shardverify.") for name in names)


def one_round(root: Path, env: dict[str, str], number: int) -> dict[str, float]:
    (root / "specs" / f"{OP}.yaml").write_text(new_spec(number), encoding="utf-8")
    python = sys.executable
    figures = {"floor": child_cpu([python, "-c", "import torch"], root, env),
               "generate": child_cpu([python, "-m", "shardverify", "generate", OP], root, env),
               "verify": child_cpu([python, "-m", "shardverify", "verify", OP, "--mesh", "2"], root, env)}
    figures["loop"] = figures["generate"] + figures["verify"]
    return figures


def measure(rounds: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-edit-loop-") as folder:
        root = Path(folder)
        copy_checkout(root)
        env = {k: v for k, v in os.environ.items() if k not in ("AUTO_PARALLEL", "PYTEST_ADDOPTS", "PYTHONDONTWRITEBYTECODE")}
        env["PYTHONPATH"] = str(root)   # the copy shadows the installed (editable) package
        probe = subprocess.run([sys.executable, "-c", "import shardverify; print(shardverify.__file__)"], cwd=root,
                               env=env, capture_output=True, text=True, timeout=600)
        if probe.stdout.strip() != str(root / "shardverify" / "__init__.py"):
            raise Failed(f"the copy does not import its own package: {probe.stdout.strip() or probe.stderr[-2000:]}")
        one_round(root, env, 0)   # warm-up: the copy's bytecode
        found = [one_round(root, env, number) for number in range(1, rounds + 1)]
        modules = {command: modules_entered([sys.executable, "-m", "shardverify", *argv], root, env)
                   for command, argv in (("generate", ["generate", OP]), ("verify", ["verify", OP, "--mesh", "2"]))}
    figures = {c: [r[c] for r in found] for c in COLUMNS}
    return {"op": OP, "rounds": rounds, "min": {c: min(v) for c, v in figures.items()},
            "median": {c: statistics.median(v) for c, v in figures.items()}, "modules_entered": modules}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="CI's smoke run: one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 1
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    try:
        result = measure(args.rounds)
    except (Failed, subprocess.TimeoutExpired) as exc:
        print(f"bench_edit_loop: {exc}", file=sys.stderr)
        return 1
    floor = result["min"]["floor"]
    result["over_floor"] = {c: result["min"][c] / floor if floor else None for c in COLUMNS[1:]}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"a new op spec ({OP}) in a copy of the specs: CPU seconds of each fresh process, min / median over "
          f"{args.rounds} round(s)")
    for column in COLUMNS:
        ratio = "" if column == "floor" else f"   {result['over_floor'][column]:.2f}x the floor"
        print(f"  {column:<9} {result['min'][column]:6.2f} / {result['median'][column]:<6.2f}{ratio}".rstrip())
    print("  (floor: python -c 'import torch'; target: generate and verify within 3 CPU s each)")
    print(f"  modules of shardverify entered: generate {result['modules_entered']['generate']}, "
          f"verify {result['modules_entered']['verify']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
