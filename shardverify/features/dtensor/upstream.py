"""The upstream bug reports (docs/upstream/*.md) re-run on the installed torch.

Each page is one DTensor bug ready to file with PyTorch: what goes wrong, the function at fault,
the layouts affected, and under ``## Repro`` a torch-only script (the page's first ``python``
block after that heading) that exits 1 while the bug is present and 0 once it is fixed.
``shardverify dtensor --upstream`` runs every page's script in this process (``python
repro.py`` as the page says: LocalTensorMode on a fake process group) and says which are fixed.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

from shardverify.errors import SpecError
from shardverify.files import read_regular_file

__all__ = ["Report", "Rerun", "load_reports", "rerun"]

_REPRO = re.compile(r"^## Repro\b.*?^```python\n(.*?)^```", re.S | re.M)
_TITLE = re.compile(r"^# (.+)$", re.M)
MAX_PAGE_BYTES = 1 << 20


@dataclass(frozen=True)
class Report:
    name: str          # the page's file name without .md
    title: str
    script: str
    path: Path


@dataclass(frozen=True)
class Rerun:
    report: Report
    status: str        # "still wrong" | "fixed" | "error"
    output: str        # what the script printed (or why it could not run)


def load_reports(folder: Path) -> list[Report]:
    """Every page of ``folder`` but its README, in name order; a page without a ``## Repro``
    python block is an input error naming it."""
    if not folder.is_dir():
        raise SpecError(f"{folder}: no folder of upstream reports")
    reports = []
    for path in sorted(folder.glob("*.md")):
        if path.name.lower() == "readme.md":
            continue
        text = read_regular_file(path, MAX_PAGE_BYTES).decode("utf-8", "replace")
        found = _REPRO.search(text)
        if found is None:
            raise SpecError(f"{path}: no repro: expected a ```python block under a '## Repro' heading")
        title = _TITLE.search(text)
        reports.append(Report(path.stem, title.group(1).strip() if title else path.stem, found.group(1), path))
    if not reports:
        raise SpecError(f"{folder}: no upstream report pages (*.md)")
    return reports


def rerun(report: Report) -> Rerun:
    """Runs the report's script here (one process, every rank under LocalTensorMode): exit
    status 1 is "still wrong", 0 "fixed", anything else (or an exception) "error". The process
    group it makes and DTensor's sharding cache are cleared afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        return Rerun(report, "error", "a process group is already initialised in this process")
    printed = io.StringIO()
    status, why = "error", ""
    try:
        code = compile(report.script, str(report.path), "exec")
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
            exec(code, {"__name__": "__main__", "__file__": str(report.path)})   # noqa: S102 - the page's own script
        why = "the script ended without an exit status"
    except SystemExit as exc:
        status = {1: "still wrong", 0: "fixed", None: "fixed"}.get(exc.code, "error")
        why = "" if status != "error" else f"exit status {exc.code!r}"
    except Exception as exc:  # noqa: BLE001 - a script that no longer runs on this torch is said, not raised
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    finally:
        _clean()
    output = printed.getvalue() + (f"\n{why}" if why else "")
    return Rerun(report, status, output.strip())


def _clean() -> None:
    import torch.distributed as dist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    if dist.is_initialized():
        dist.destroy_process_group()
    _clear_sharding_prop_cache()
