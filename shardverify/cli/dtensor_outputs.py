"""The files `shardverify dtensor` writes after its report is on stdout (--write, --write-accepted,
--html, --repros): each written whole or not at all, one that cannot be written said in one line
naming it without losing the others or the results."""

from __future__ import annotations

import sys
from pathlib import Path

from shardverify.files import write_file_atomic

__all__ = ["write_file", "accepted_writer", "page_writer", "write_outputs", "write_repros"]


def write_file(path: Path, text: str) -> None:
    write_file_atomic(path, text)     # whole or not at all: a full disk leaves no half page


def accepted_writer(results, accepted, torch_version: str):
    """--write-accepted: every silent-corruption and late-failure class found, as root causes in
    the accepted file's format (shardverify.features.dtensor.rootcause.found_causes)."""
    def write(path: Path) -> None:
        from shardverify.features.dtensor.accepted import render_accepted
        from shardverify.features.dtensor.rootcause import found_causes

        write_file(path, render_accepted(found_causes(results, accepted), torch_version))
    return write


def page_writer(results, accepted, passed: bool, seconds: float, command: str):
    """What writes the run's HTML page to a path (--html)."""
    def write_page(path: Path) -> None:
        from shardverify.features.dtensor.accepted import Accepted
        from shardverify.features.report.dtensor_page import dtensor_page
        from shardverify.features.report.page import write

        write(dtensor_page(results, accepted or Accepted({}), passed, seconds, command), str(path))
        print(f"report: {path}", file=sys.stderr)

    return write_page


def write_outputs(outputs) -> bool:
    """Each requested output written; one that fails is one line naming the file (the results are
    already on stdout). True when any failed."""
    failed = False
    for path, write in outputs:
        if path is None:
            continue
        try:
            write(path)
        except OSError as exc:
            print(f"error: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
            failed = True
    return failed


def write_repros(folder: Path, results) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for r in results:
        for f in r.findings:
            if f.repro:
                name = "".join(c if c.isalnum() else "_" for c in f.key()).strip("_")[:120]
                write_file_atomic(folder / f"{name}.py", f.repro)
