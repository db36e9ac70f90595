"""`shardverify dtensor [SPEC ...]`: execute PyTorch DTensor on every input layout combination
of each op spec's cases, forward and backward, and say where it computes wrong values silently,
raises, or communicates where it need not.

Exit status 1 when a silent-corruption or late-failure class is found that the accepted file (default
``specs/dtensor/accepted.yaml`` when it exists) does not list; 2 on a usage or input error.

The report starts with the verdict (PASS or FAIL, the counts, the first new class), then the
classes found; -v adds the per-case table and notes (and a line per case on stderr as it ends).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from shardverify.cli import USAGE
from shardverify.cli.dtensor_args import Inputs, add_arguments, command_line, read_inputs, run_problem
from shardverify.cli.dtensor_checks import gate_lines, gloo_confirmations, rerun_upstream
from shardverify.cli.dtensor_cluster import sweep_on_cluster
from shardverify.cli.dtensor_outputs import accepted_writer, page_writer, write_file, write_outputs, write_repros
from shardverify.cli.dtensor_report import budget_cut, passes, report_lines, unchecked_reasons
from shardverify.cli.dtensor_saved import report_saved, report_stored
from shardverify.cli.progress import Progress
from shardverify.cli.row_warnings import Caught, caught_warnings
from shardverify.errors import ShardVerifyError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dtensor", help="execute DTensor on every layout combination and classify what it computes",
        description="For every case of each op spec (and each custom-op spec given with --custom) on each "
                    "mesh, run torch.distributed.tensor in process (LocalTensorMode, fake process group) "
                    "on every input layout combination, forward and backward, and compare every rank's "
                    "values with the single-device reference. Exit status 1 when DTensor computes wrong "
                    "values silently, or returns and fails later, in a class the accepted file does not list.")
    add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.upstream is not None:
        return rerun_upstream(args)
    inputs = read_inputs(args)
    if inputs is None:
        return USAGE
    if args.from_json is not None and args.from_json.is_dir():
        return report_stored(args, inputs.accepted, inputs.specs, inputs.limit)
    if args.from_json is not None:
        return report_saved(args, inputs.accepted)
    if problem := run_problem(args, inputs):
        print(f"error: {problem}", file=sys.stderr)
        return USAGE
    start = time.perf_counter()
    ran = _run_cases(args, inputs, start)
    if isinstance(ran, int):
        return ran
    results, warned = ran
    return _finish(args, inputs, results, warned, start)


def _run_cases(args: argparse.Namespace, inputs: Inputs, start: float) -> tuple[list, dict[str, int]] | int:
    """Every case of the specs and custom-op specs, here or on --cluster, with progress on stderr:
    the results and the warnings torch gave (counted), or the exit status of a run that stopped."""
    from shardverify.features.dtensor.custom import run_custom
    from shardverify.features.dtensor.run import run_spec

    specs, customs, limit, budget = inputs.specs, inputs.customs, inputs.limit, inputs.budget
    results: list = []
    progress = Progress(0 if args.quiet or args.verbose or args.json else
                        sum(len(spec.cases()) * len(args.mesh or spec.verify.meshes) for spec in specs)
                        + sum(len(custom.cases) * len(args.mesh or custom.meshes) for custom in customs))

    caught = Caught()   # the warnings torch gives on the ops' edge cases: counted, not printed (row_warnings)

    def done(result) -> None:   # progress on stderr: a full run takes a while
        progress.step()
        settled(result)

    def settled(result) -> None:
        results.append(result)
        with caught.outside():
            _said(result)

    def _said(result) -> None:
        progress.show(f"{result.op} {result.case} on {list(result.mesh)}")
        if args.quiet or not args.verbose:
            return
        if result.resumed:
            print(f"[{time.perf_counter() - start:7.1f}s] {result.op} {result.case} on {list(result.mesh)}: "
                  f"stored in {args.results} ({result.executed} executed)", file=sys.stderr, flush=True)
        else:
            counts = ", ".join(f"{n} {k}" for k, n in sorted(result.counts.items()))
            print(f"[{time.perf_counter() - start:7.1f}s] {result.op} {result.case} on {list(result.mesh)}: "
                  f"{result.executed} executed in {result.seconds:.1f}s ({counts or result.note[:100]})",
                  file=sys.stderr, flush=True)

    try:
        with progress, caught_warnings() as caught:
            if args.cluster is not None:
                sweep_on_cluster(args, specs, limit, budget, progress, caught, settled)
            else:
                for spec in specs:
                    run_spec(spec, args.mesh, limit=limit, budget=budget, on_result=done, store=args.results,
                             root=args.root)
            for custom in customs:
                run_custom(custom, args.mesh, limit=limit, budget=budget, on_result=done)
    except ShardVerifyError as exc:   # a custom spec's module cannot be imported; no cluster to join
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        print(f"\nshardverify dtensor: interrupted after {len(results)} case(s); exit 130", file=sys.stderr)
        return 130
    return results, caught.counts


def _finish(args: argparse.Namespace, inputs: Inputs, results: list, warned: dict[str, int], start: float) -> int:
    """The verdict of a run that ended: its report (or --json) on stdout, then the files asked for."""
    import torch

    from shardverify.features.dtensor.report import markdown, new_classes
    from shardverify.features.dtensor.store import HARNESS

    accepted, command = inputs.accepted, command_line(args)
    fresh = new_classes(results, accepted)
    executed = sum(r.executed for r in results)
    unchecked = unchecked_reasons(results)
    cut, skipped = budget_cut(results)
    confirmations = gloo_confirmations(args, results, inputs.specs, args.results)
    gated = gate_lines(args, results, accepted)
    passed = passes(args, fresh, unchecked, cut, confirmations, gated)
    # The results reach stdout first: a file that cannot be written below loses none of them.
    if args.json:
        json.dump({"passed": passed, "seconds": round(time.perf_counter() - start, 3), "command": command,
                   "torch": torch.__version__, "harness": HARNESS, "executed": executed, "unchecked": unchecked,
                   "skipped_by_budget": skipped,
                   "new_classes": [f.key() for f in fresh],
                   "gloo": None if confirmations is None else {k: c.to_json() for k, c in confirmations.items()},
                   "results": [r.to_json() for r in results]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print("\n".join(report_lines(args, results, accepted, confirmations, passed,
                                     f"{time.perf_counter() - start:.1f}s", warned=warned, gated=gated)))
    sys.stdout.flush()

    outputs = [(args.repros, lambda folder: write_repros(folder, results)),
               (args.write_accepted, accepted_writer(results, accepted, torch.__version__)),
               (args.write, lambda path: write_file(path, markdown(results, accepted, command, torch.__version__,
                                                                   confirmations=confirmations))),
               (args.html, page_writer(results, accepted, passed, time.perf_counter() - start, command))]
    failed = write_outputs(outputs)
    if failed:
        return USAGE
    return 0 if passed else 1
