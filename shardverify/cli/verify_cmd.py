"""`shardverify verify [SPEC ...]`: verify every strategy of the op specs numerically.

The report starts with the verdict (PASS or FAIL, the counts, the first failure) and lists every
failing case; -v adds one row per (case, mesh) (how many strategies were checked, how many
failed, how long it took) and every failure's full report (verify_summary). The exit status is 1
when anything failed, so CI can run it as the main job.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

from shardverify.backends import registry
from shardverify.cli import USAGE, parse_int, parse_seconds
from shardverify.cli.html_option import add_html_option, html_problem, write_html
from shardverify.cli.verify_rows import (Interrupted, Progress, Row, close_backends, quiet_tracing, row_label,
                                          verify_row)
from shardverify.cli.verify_summary import detail_lines, format_table, outcome, summary_lines
from shardverify.cli.catalogue import checked_op_specs
from shardverify.cli.cluster_option import parse_jobs
from shardverify.errors import ShardVerifyError, SpecError



def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify", help="verify every strategy of the op specs numerically",
        description="Check every sharding strategy of every op spec (every target, grid point and "
                    "mesh) against the single-device reference, forward and backward. "
                    "Exit status 1 when any strategy fails.")
    parser.add_argument("specs", nargs="*", metavar="SPEC",
                        help="op spec paths or names, e.g. sum or specs/linear.yaml (default: every op spec)")
    names = registry.backend_names()   # every registered kind (backends/registry.py)
    parser.add_argument("--backend", choices=names, default=registry.DEFAULT_KIND, help=registry.backend_help(names))
    parser.add_argument("--mesh", action="append", type=parse_mesh, metavar="SHAPE", default=None,
                        help="mesh shape such as 2,2 or 4 (repeatable; default: the meshes each spec lists)")
    parser.add_argument("--device", default=None,
                        help="device the shards live on (default: cpu; cuda where the backend runs NCCL)")
    parser.add_argument("--timeout", type=parse_timeout, default=60.0, metavar="S",
                        help="seconds one strategy check may take before its ranks count as hung (default: 60)")
    parser.add_argument("--jobs", "-j", type=parse_jobs, default=None, metavar="N",
                        help="share the (case, mesh) rows among N worker processes, one core each "
                             "(simulated backend; 'auto': one per CPU; default: 1, this process alone; "
                             "with --cluster: N Ray workers, default one per CPU of the cluster)")
    parser.add_argument("--cluster", default=None, metavar="ADDRESS",
                        help="run the rows (--opinfo: the entries to sweep) on the Ray cluster at ADDRESS "
                             "(HOST:PORT as `ray start --head` "
                             "prints it; auto: $RAY_ADDRESS or the cluster started on this machine; local: a Ray "
                             "started for this run on this machine's CPUs); simulated backend; needs "
                             "pip install 'shardverify[cluster]' (docs/cluster.md)")
    parser.add_argument("--seed", type=parse_seed, default=None, metavar="N",
                        help="draw every case's values from seed N instead of the spec's (the verdicts must "
                             "not depend on it: data that cannot tell two blocks apart gets more seeds anyway)")
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of the report")
    add_html_option(parser, "the report, each failing strategy's layouts and every rank's error drawn")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="after the verdict, one row per case and mesh and every failure's full report")
    parser.add_argument("--opinfo", action="store_true",
                        help="instead of the specs' grids, serve every PyTorch OpInfo sample of their targets "
                             "(torch.fx and torch.export captures, --mesh or (2,2) and (4,)) as a plan would, "
                             "calls outside a grid verified on demand, grid-served strategies verified at the "
                             "call; count served / on demand / refused by reason")
    parser.add_argument("--opinfo-every-entry", action="store_true",
                        help="with --opinfo: sweep every entry of PyTorch's op_db, not only those of the specs' "
                             "targets; an entry no spec lists is matched by what its samples call (every op node "
                             "its captures hold must be served), and the report gives the share over the specs' "
                             "own entries beside the share over all")
    parser.add_argument("--opinfo-samples", type=parse_seed, default=24, metavar="N",
                        help="with --opinfo: at most N samples per OpInfo entry, a fixed draw (0: every sample)")
    parser.add_argument("--opinfo-results", type=Path, default=None, metavar="DIR",
                        help="with --opinfo: one results file per OpInfo entry in DIR (default: "
                             "~/.cache/shardverify/opinfo); an entry whose file matches the settings and the "
                             "rules of every spec that could take its calls is not swept again; several processes "
                             "may share DIR, each sweeping the entries no other is sweeping")
    parser.add_argument("--opinfo-fresh", action="store_true",
                        help="with --opinfo: sweep every entry again, whatever its results file holds")
    parser.add_argument("--opinfo-stored", action="store_true",
                        help="with --opinfo: sweep nothing, report the entries whose stored results are current "
                             "and name the others")
    parser.add_argument("--report", type=Path, default=None, metavar="FILE",
                        help="with --opinfo: write the markdown report (docs/opinfo.md) to FILE")
    parser.add_argument("--root", type=Path, default=Path("."),
                        help="repository root (default: .)")
    parser.add_argument("--specs-dir", type=Path, default=None, help="folder holding the specs (default: ROOT/specs)")
    parser.set_defaults(func=run)


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"2,2"`` -> ``(2, 2)``; sizes are positive ints, within the axis and rank limits of every
    mesh (`limits.mesh_problem`: size-1 axes count)."""
    from shardverify.spec.limits import mesh_problem

    if len(text) > 200:
        raise argparse.ArgumentTypeError(f"mesh shape {text[:40]!r}... is {len(text)} characters long")
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(size <= 0 for size in shape):
        raise argparse.ArgumentTypeError(f"mesh shape {text!r} is not a list of positive ints such as 2,2 or 4")
    try:
        too_many = mesh_problem(shape)
    except SpecError as exc:   # a bad limit setting
        raise argparse.ArgumentTypeError(str(exc)) from None
    if too_many:
        raise argparse.ArgumentTypeError(f"mesh {text!r}: {too_many}")
    return shape


#: every mesh is bounded now; the name stays for the commands that import it
parse_bounded_mesh = parse_mesh


def one_rank_mesh(meshes) -> str:
    """Why a --mesh of one rank is refused, or "": on one rank nothing is sharded and no collective
    runs, so every check would pass without checking a layout (plans refuse it alike)."""
    single = next((mesh for mesh in meshes or () if math.prod(mesh) == 1), None)
    if single is None:
        return ""
    return (f"--mesh {','.join(map(str, single))} has one rank: nothing is sharded on it, so nothing would be "
            "checked; give a mesh of 2 or more ranks")


def parse_positive_int(text: str) -> int:
    """A positive integer option (bytes, repeats)."""
    return parse_int(text, 1, "expected a positive integer, got {text!r}")


def _device_problem(device: str | None, backend: str, ranks: int = 1) -> str:
    """Why the shards cannot live on ``device`` here ("" when they can): one error, not every
    strategy failing with torch's. ``ranks``: the largest mesh's, for a kind that picks NCCL by it."""
    import torch

    wanted = device or registry.backend_kind(backend).default_device(ranks)
    try:
        kind = torch.device(wanted).type
    except RuntimeError as exc:
        return f"--device {wanted!r} is not a device: {exc}"
    if kind == "cuda" and not torch.cuda.is_available():
        return (f"--device {wanted!r}" if device else f"the {backend} backend") + \
            " needs a CUDA GPU, and this torch sees none (torch.cuda.is_available() is False)"
    if kind not in ("cpu", "cuda"):
        return f"--device {wanted!r}: shards live on cpu or cuda"
    return ""


def parse_seed(text: str) -> int:
    return parse_int(text, 0, "seed {text!r} is not an integer >= 0")


def parse_timeout(text: str) -> float:
    return parse_seconds(text, "timeout {text!r} is not a positive number of seconds", zero=False)


# ------------------------------------------------------------------------------ running


def rows_in_workers(jobs: int | None, cluster: str | None, backend_kind: str) -> bool:
    """Whether :func:`verify_specs` shares its rows among ``verify_jobs``' worker processes."""
    return cluster is None and (jobs or 1) > 1 and backend_kind == "simulated"


def verify_specs(specs: list, backend_kind: str, meshes: list[tuple[int, ...]] | None, *,
                 device: str | None = None, timeout: float = 60.0, progress: Progress | None = None,
                 jobs: int | None = 1, seed: int | None = None, error_maps: bool = False,
                 cluster: str | None = None) -> list[Row]:
    """Verify every case of every spec on every mesh, rows in that order; one backend per mesh
    shape, reused.  ``jobs`` > 1 (simulated backend only) shares the rows among that many
    worker processes (see verify_jobs); ``cluster``: a Ray cluster's address, the rows run on
    ``jobs`` of its workers instead (verify_cluster); ``seed`` replaces every case's seed;
    ``error_maps``: failing checks keep where they are wrong (a report draws it: verify/error_map.py)."""
    plan = [(spec.name, case_id, case if seed is None else dataclasses.replace(case, seed=seed), tuple(mesh))
            for spec in specs for case_id, case in spec.op_cases()
            for mesh in (meshes or _runnable(spec.verify.meshes, backend_kind))]
    progress = progress or Progress(0)
    if cluster is not None:
        return _verify_on_cluster(plan, cluster, jobs, backend_kind, device=device, timeout=timeout,
                                  progress=progress, error_maps=error_maps)
    if jobs > 1 and backend_kind != "simulated":
        raise ShardVerifyError(f"--jobs {jobs} shares rows among processes of simulated ranks; the "
                               f"{backend_kind} backend runs its ranks as processes already (leave --jobs out)")
    if rows_in_workers(jobs, cluster, backend_kind):
        from shardverify.cli.verify_jobs import verify_rows_in_workers

        try:
            return verify_rows_in_workers(plan, jobs, device=device, timeout=timeout, progress=progress,
                                          error_maps=error_maps)
        finally:
            progress.close()
    from shardverify.verify.error_map import keep_error_maps

    backends: dict = {}
    rows = []
    try:
        with keep_error_maps() if error_maps else contextlib.nullcontext():
            for item in plan:
                progress.show(row_label(item))
                rows.append(verify_row(item, backends, backend_kind, device, timeout))
                progress.step()
    except KeyboardInterrupt:
        raise Interrupted(rows, len(plan)) from None
    finally:
        progress.close()
        close_backends(backends)
    return rows



def _verify_on_cluster(plan: list, cluster: str, jobs: int | None, backend_kind: str, *, device: str | None,
                       timeout: float, progress: Progress, error_maps: bool) -> list[Row]:
    from shardverify.backends.cpus import usable_cpus
    from shardverify.cli.verify_cluster import verify_rows_on_cluster

    if backend_kind != "simulated":
        raise ShardVerifyError(f"--cluster runs the rows on workers of simulated ranks; the {backend_kind} "
                               f"backend runs its ranks as processes of this machine (leave --cluster out)")
    try:
        return verify_rows_on_cluster(plan, cluster, jobs, device=device, timeout=timeout, progress=progress,
                                      error_maps=error_maps, local_cpus=jobs or len(usable_cpus()))
    finally:
        progress.close()


def _runnable(meshes, backend_kind: str) -> list:
    """A launcher's world (torchrun) has a fixed size: of a spec's meshes, only those of that size run."""
    world = registry.backend_kind(backend_kind).world_size()
    if world is None:
        return list(meshes)
    return [mesh for mesh in meshes if math.prod(mesh) == world]


def run(args: argparse.Namespace) -> int:
    quiet_tracing()
    if single := one_rank_mesh(args.mesh):
        print(f"error: {single}", file=sys.stderr)
        return USAGE
    if rows_in_workers(args.jobs, args.cluster, args.backend) and not args.opinfo:
        from shardverify.cli.verify_jobs import start_workers_early

        start_workers_early()   # its imports run while the specs are read
    specs = checked_op_specs(args, "verify")
    if specs is None:
        return USAGE
    if args.opinfo:
        from shardverify.cli.opinfo_run import run_opinfo

        return run_opinfo(args, specs)
    from shardverify.cli.catalogue import broken_handlers

    for problem in broken_handlers(args.root):
        print(f"warning: {problem}; run `shardverify generate`", file=sys.stderr)
    largest = max((math.prod(mesh) for mesh in args.mesh or [m for spec in specs for m in spec.verify.meshes]),
                  default=1)
    device_problem = _device_problem(args.device, args.backend, largest)
    if device_problem:
        print(f"error: {device_problem}", file=sys.stderr)
        return USAGE
    meshes = args.mesh
    total = sum(len(spec.cases()) * len(meshes or _runnable(spec.verify.meshes, args.backend)) for spec in specs)
    if total == 0:
        print(f"error: no spec lists a mesh of WORLD_SIZE={os.environ.get('WORLD_SIZE')} ranks; "
              f"pass --mesh", file=sys.stderr)
        return USAGE
    # Under torchrun every rank verifies; rank 0 alone reports (all ranks share the verdict).
    reporting = registry.backend_kind(args.backend).reporting()
    problem = html_problem(args.html)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return USAGE
    start = time.perf_counter()
    try:
        rows = verify_specs(specs, args.backend, meshes, device=args.device, timeout=args.timeout,
                            progress=None if args.json or not reporting else Progress(total),
                            jobs=args.jobs if args.cluster else args.jobs or 1, seed=args.seed,
                            error_maps=args.html is not None, cluster=args.cluster)
    except ShardVerifyError as exc:   # a mesh or backend that cannot exist here
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt as exc:   # Ctrl-C: the rows finished so far, no traceback
        rows = getattr(exc, "rows", [])
        if reporting and rows and not args.json:
            print(format_table(rows))
        print(f"\nshardverify verify: {exc or 'interrupted'}; exit 130", file=sys.stderr)
        return 130
    if not reporting:
        return 1 if any(r.failures for r in rows) else 0
    elapsed = time.perf_counter() - start
    checks, failed = outcome(rows)
    if args.json:
        json.dump({"backend": args.backend, "passed": failed == 0, "strategies": checks,
                   "failures": failed, "seconds": round(elapsed, 3), "rows": [r.to_json() for r in rows]},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        lines = summary_lines(rows, args.backend, elapsed, verbose=args.verbose)
        print("\n".join(lines + (detail_lines(rows) if args.verbose else [])))
    sys.stdout.flush()   # the results first: a page that cannot be written loses none of them

    def page():
        from shardverify.features.report.verify_page import verify_page

        return verify_page(rows, args.backend, elapsed)

    if not write_html(page, args.html):
        return USAGE
    return 1 if failed else 0
