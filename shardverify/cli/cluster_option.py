"""`--cluster ADDRESS` and `--jobs N` of the commands whose units run only on a Ray cluster
(`dtensor`, `audit`): one wording, one check (`verify` has its own --jobs pool; docs/cluster.md)."""

from __future__ import annotations

import argparse

from shardverify.cli.verify_cmd import parse_jobs

__all__ = ["add_cluster_options", "jobs_problem", "preload"]


def add_cluster_options(parser: argparse.ArgumentParser, units: str) -> None:
    parser.add_argument("--cluster", default=None, metavar="ADDRESS",
                        help=f"run the {units} on the workers of the Ray cluster at ADDRESS (HOST:PORT as `ray "
                             "start --head` prints it; auto: $RAY_ADDRESS or the cluster on this machine; local: a "
                             "Ray started here); the report is the one a run here gives; needs pip install "
                             "'shardverify[cluster]' (docs/cluster.md)")
    parser.add_argument("--jobs", "-j", type=parse_jobs, default=None, metavar="N",
                        help="with --cluster: N Ray workers (default: one per CPU of the cluster)")


def jobs_problem(args: argparse.Namespace) -> str:
    """Why --jobs cannot run as given ("" when it can)."""
    if args.jobs is not None and args.cluster is None:
        return "--jobs N is the number of Ray workers of --cluster; a run without --cluster runs in this process"
    return ""


def preload(*modules: str) -> None:
    """A Ray worker's set-up (``functools.partial(preload, ...)``): one torch thread, as it holds
    one CPU, and ``modules`` imported before its first unit (not in that unit's time)."""
    import importlib

    import torch

    for name in modules:
        importlib.import_module(name)
    torch.set_num_threads(1)
