"""`--cluster ADDRESS` and `--jobs N` of the commands whose units run only on a Ray cluster
(`dtensor`, `audit`, `parallelize --sweep-hf`): one wording, one check, one engine; and the
--jobs count `verify` shares (docs/cluster.md)."""

from __future__ import annotations

import argparse

from shardverify.cli import parse_int

__all__ = ["add_cluster_options", "jobs_problem", "preload", "cluster_engine", "parse_jobs"]


def parse_jobs(text: str) -> int:
    """``"auto"`` -> the CPUs this process may use; otherwise a positive int."""
    if text == "auto":
        from shardverify.backends.cpus import usable_cpus

        return len(usable_cpus())
    return parse_int(text, 1, "jobs {text!r} is not a positive number of processes or 'auto'")


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


def cluster_engine(args: argparse.Namespace, setup):
    """The engine of ``--cluster`` with ``--jobs`` workers, each set up by ``setup`` (``local``: a
    Ray started here on --jobs CPUs, by default this machine's usable ones)."""
    from shardverify.backends.cpus import usable_cpus
    from shardverify.backends.ray_units import RayEngine

    return RayEngine(args.cluster, args.jobs, setup=setup, local_cpus=args.jobs or len(usable_cpus()))
