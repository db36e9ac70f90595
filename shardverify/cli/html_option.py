"""`--html FILE` of verify, plan, dtensor, audit and parallelize: the run's page written beside
the plain-text output (which stays as it is), its path checked before the run so a long run
never ends unable to write it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["add_html_option", "html_problem", "write_html"]


def add_html_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--html", type=Path, default=None, metavar="FILE",
                        help=f"also write {what} as one self-contained HTML page (layouts and errors drawn; "
                             "nothing fetched: it opens offline in any browser)")


def html_problem(path: Path | None) -> str:
    """Why ``path`` cannot take the page ("" when it can, or when no page was asked for)."""
    if path is None:
        return ""
    if path.is_dir():
        return f"--html {path}: is a folder; name the file to write, e.g. {path / 'report.html'}"
    folder = path.parent if str(path.parent) else Path(".")
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return f"--html {path}: cannot write into {existing}"
    return ""


def write_html(page: Callable[[], object], path: Path | None) -> bool:
    """The page ``page()`` builds written to ``path`` (nothing when ``path`` is None); False, said
    on stderr, when it could not be written."""
    if path is None:
        return True
    from shardverify.features.report.page import write

    try:
        write(page(), str(path))
    except OSError as error:
        print(f"error: cannot write the HTML report {path}: {error}", file=sys.stderr)
        return False
    print(f"report: {path}", file=sys.stderr)
    return True
