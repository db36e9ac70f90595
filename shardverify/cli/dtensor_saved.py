"""`shardverify dtensor --from-json`: the report, verdict and files of results already made, a
saved --json run (a file) or what a --results folder holds (a folder), without running again."""

from __future__ import annotations

import argparse
import sys

from shardverify.cli import USAGE
from shardverify.cli.dtensor_args import command_line
from shardverify.cli.dtensor_checks import gate_lines, gloo_confirmations
from shardverify.cli.dtensor_outputs import accepted_writer, page_writer, write_file, write_outputs
from shardverify.cli.dtensor_report import budget_cut, passes, report_lines, unchecked_reasons
from shardverify.errors import SpecError

__all__ = ["report_saved", "report_stored"]


def report_saved(args: argparse.Namespace, accepted) -> int:
    """--from-json: the summary, page and verdict of a saved run."""
    from shardverify.features.dtensor.report import markdown, new_classes
    from shardverify.features.dtensor.run import CaseResult
    from shardverify.features.dtensor.store import made_by, read_saved_run

    try:
        saved = read_saved_run(args.from_json)
        results = [CaseResult.from_json(item) for item in saved["results"]]
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    fresh = new_classes(results, accepted)
    unchecked = unchecked_reasons(results)
    cut, _ = budget_cut(results)
    passed = passes(args, fresh, unchecked, cut)
    print("\n".join(report_lines(args, results, accepted, None, passed, f"saved run {args.from_json}",
                                 f"saved run {args.from_json}: {made_by(saved.get('torch'), saved.get('harness'))}")))
    sys.stdout.flush()
    if write_outputs([(args.write, lambda path: write_file(path, markdown(
            results, accepted, saved.get("command", "shardverify dtensor"), saved.get("torch", "?"),
            note=str(saved.get("note") or "")))),
            (args.write_accepted, accepted_writer(results, accepted, saved.get("torch", "?"))),
            (args.html, page_writer(results, accepted, passed, 0.0, saved.get("command", "shardverify dtensor")))]):
        return USAGE
    return 0 if passed else 1


def report_stored(args: argparse.Namespace, accepted, specs, limit) -> int:
    """--from-json DIR: the summary, page and verdict of what a --results folder holds."""
    import torch

    from shardverify.features.dtensor.report import markdown, new_classes
    from shardverify.features.dtensor.stored_results import stored_results

    try:
        results, note = stored_results(args.from_json, specs, args.mesh, limit, args.root)
    except (SpecError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    fresh = new_classes(results, accepted)
    unchecked = unchecked_reasons(results)
    cut, _ = budget_cut(results)
    confirmations = gloo_confirmations(args, results, specs, args.from_json)
    gated = gate_lines(args, results, accepted)
    passed = passes(args, fresh, unchecked, cut, confirmations, gated)
    print("\n".join(report_lines(args, results, accepted, confirmations, passed, f"what {args.from_json} holds",
                                 note, gated=gated)))
    sys.stdout.flush()
    command = command_line(args) + f" --results {args.from_json}"
    if write_outputs([(args.write, lambda path: write_file(path, markdown(
            results, accepted, command, torch.__version__, note=note, confirmations=confirmations))),
            (args.write_accepted, accepted_writer(results, accepted, torch.__version__)),
            (args.html, page_writer(results, accepted, passed, 0.0, command))]):
        return USAGE
    return 0 if passed else 1
