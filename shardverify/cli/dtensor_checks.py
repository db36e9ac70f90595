"""What `shardverify dtensor` runs beyond the sweep itself: each class's repro on real gloo
processes (--confirm, or what a results folder holds of it), the gate on accepted root causes
(--gate), and the upstream bug reports re-run on the installed torch (--upstream)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from shardverify.cli import USAGE
from shardverify.cli.dtensor_args import UPSTREAM
from shardverify.errors import SpecError

__all__ = ["gloo_confirmations", "gate_lines", "rerun_upstream"]


def gloo_confirmations(args: argparse.Namespace, results, specs, folder: Path | None):
    """Each gated class's run on real gloo processes: run now (--confirm; what is stored for the
    same example is kept), or what ``folder`` holds; None without a results folder."""
    import torch

    from shardverify.features.dtensor.confirm import DEFAULT_TIMEOUT, class_examples, confirm_classes, load_confirmations

    if folder is None:
        return None
    if not args.confirm:
        examples = class_examples(results, specs, args.root)
        return load_confirmations(folder, torch.__version__, {k: e for k, (_, e) in examples.items()})
    klasses = ("silent-wrong",) if args.confirm == "silent" else ("silent-wrong", "late-failure")
    start = time.perf_counter()

    def said(found, reused: bool) -> None:
        if not args.quiet:
            how = "stored" if reused else f"{found.seconds:.0f}s on {found.world} gloo processes"
            print(f"[{time.perf_counter() - start:7.1f}s] gloo: {found.key}: {found.status} ({how}): "
                  f"{found.detail[:160]}", file=sys.stderr, flush=True)

    return confirm_classes(results, specs, folder, root=args.root, klasses=klasses, progress=said,
                           timeout=DEFAULT_TIMEOUT if args.confirm_timeout is None else args.confirm_timeout or None)


def gate_lines(args: argparse.Namespace, results, accepted) -> list[str] | None:
    """--gate: what fails it (root causes gone, repros that do not reproduce), one line each,
    then one line saying what it watched; None without --gate. Each repro's line goes to stderr
    as it ends unless --quiet."""
    if not args.gate:
        return None
    from shardverify.features.dtensor.accepted import Accepted
    from shardverify.features.dtensor.gate import gate_problems, run_repros

    accepted = accepted or Accepted({})
    repros = run_repros(accepted, args.root)
    if not args.quiet:
        for found in repros:
            print(f"repro {found.line()} ({found.seconds:.1f}s)", file=sys.stderr, flush=True)
    ops = {r.op for r in results if r.executed}
    watched = sum(any(key.split(" ", 1)[0] in ops for key in cause.keys) for cause in accepted.causes)
    return [f"gate: {line}" for line in gate_problems(results, accepted, repros)] + [
        f"gate: {watched} root cause(s) watched on the ops run; {sum(not r.failed for r in repros)} of "
        f"{len(repros)} repro(s) reproduce ({sum(r.seconds for r in repros):.1f}s)"]


def rerun_upstream(args: argparse.Namespace) -> int:
    """--upstream: each report's repro run here; which still reproduce on this torch, which are fixed."""
    import torch

    from shardverify.features.dtensor.upstream import load_reports, rerun

    folder = args.upstream if args.upstream.is_absolute() or args.upstream != UPSTREAM else args.root / UPSTREAM
    try:
        reports = load_reports(folder)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    counts: dict[str, int] = {}
    from shardverify.features.dtensor.execute import quiet_dtensor

    for report in reports:
        with quiet_dtensor():
            found = rerun(report)
        counts[found.status] = counts.get(found.status, 0) + 1
        word = {"still wrong": "still wrong", "fixed": "FIXED", "error": "ERROR"}[found.status]
        print(f"{word:11}  {report.name}: {report.title}")
        if found.status != "still wrong" and found.output:
            print("             " + found.output.splitlines()[-1])
    print(f"\ntorch {torch.__version__}: {len(reports)} upstream report(s), "
          + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    return 1 if counts.get("error") else 0
