"""``shardverify plan --export-parallelize FILE``: the plan the check ran, written as a PyTorch
parallelize plan (:mod:`shardverify.plan.export`), what no ParallelStyle expresses said on stderr."""

from __future__ import annotations

import sys

from shardverify.plan.export import ParallelizeExport, export_parallelize
from shardverify.plan.export_code import export_summary, render_parallelize

__all__ = ["write_export"]


def write_export(result, spec: str, path: str) -> ParallelizeExport | None:
    """Write ``result``'s plan to ``path``; the export, or None (said on stderr) when it cannot be written."""
    from shardverify.files import write_file_atomic

    export = export_parallelize(result.plan, result.graph_facts)
    try:
        write_file_atomic(path, render_parallelize(export, spec))
    except OSError as error:
        print(f"shardverify plan: --export-parallelize {path!r}: cannot write it ({error.strerror or error})",
              file=sys.stderr)
        return None
    for line in export_summary(export, path):
        print(line, file=sys.stderr)
    return export
