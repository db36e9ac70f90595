"""`shardverify dtensor --cluster ADDRESS`: every case on the workers of a Ray cluster
(dtensor/sweep.py on backends/ray_units.py), this process writing the results folder as the
serial run does, so `--results` resumes either run and `--from-json DIR` reads both.

Each worker is an actor that keeps torch and DTensor imported between cases, on one torch thread
(it holds one CPU); the warnings torch gives on a worker are counted there and added to the run's.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from typing import Any

from shardverify.backends.units import UnitFailed
from shardverify.cli.cluster_option import cluster_engine, jobs_problem, preload
from shardverify.cli.progress import Progress
from shardverify.cli.row_warnings import Caught, caught_warnings

__all__ = ["sweep_on_cluster", "cluster_problem", "WORKER_SETUP"]

#: a worker's set-up: DTensor imported before its first case (not in that case's time), one torch thread
WORKER_SETUP = partial(preload, "shardverify.features.dtensor.run", "shardverify.features.dtensor.execute", "torch.distributed.tensor")


def cluster_problem(args: argparse.Namespace) -> str:
    """Why --cluster or --jobs cannot run as given ("" when they can)."""
    if problem := jobs_problem(args):
        return problem
    if args.cluster is not None and args.custom:
        return ("--cluster runs op specs; a custom-op spec imports its own module, which the cluster's nodes need "
                "not have: run --custom without --cluster")
    return ""


def sweep_on_cluster(args: argparse.Namespace, specs, limit: int | None, budget: float | None, progress: Progress,
                     caught: Caught, on_result: Callable) -> list:
    """The cases of ``specs`` on ``--jobs`` actors of the Ray cluster at ``--cluster`` (``local``: one
    started here on --jobs CPUs, default this machine's); ``on_result`` as each is settled, in the
    serial run's order."""
    from shardverify.features.dtensor.sweep import sweep

    wrong = [0]

    def finished(label: str, value: Any) -> None:
        found = None if isinstance(value, UnitFailed) else value[0]
        if found is not None:
            caught.counts.update(value[2])
        wrong[0] += found is None or found.note.startswith("error:") or any(
            f.klass in ("silent-wrong", "late-failure") for f in found.findings)
        progress.step()
        with caught.outside():
            progress.show(f"{wrong[0]} with wrong results or an error so far; {label}")

    with cluster_engine(args, WORKER_SETUP) as engine:
        return sweep(specs, args.mesh, engine, limit=limit, budget=budget, store=args.results, root=args.root,
                     call=_case_counting_warnings, on_result=on_result, on_finished=finished)


def _case_counting_warnings(*args) -> tuple:
    """``run_case_unit`` on a worker, and the warnings torch gave meanwhile (message -> count)."""
    from shardverify.features.dtensor.sweep import run_case_unit

    with caught_warnings() as found:
        value = run_case_unit(*args)
    return (*value, dict(found.counts))
