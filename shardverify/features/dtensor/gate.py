"""The accepted file as a gate that watches every known fault (``shardverify dtensor --gate``).

Beside the new classes every run fails on, the gate fails when

* a root cause's classes are all gone from the ops the run covered: the fault no longer shows,
  fixed upstream perhaps: its entry is to be retired (a root cause none of whose keys is an op
  run is not judged);
* a root cause's repro script (``repros``: run as ``python SCRIPT`` from the repository root;
  exit status 1 while the fault reproduces) exits 0: it stops reproducing; or the script is
  missing, or ends otherwise (another status, an uncaught exception, a timeout).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from shardverify.features.dtensor.accepted import Accepted

__all__ = ["REPRO_TIMEOUT", "ReproRun", "gone_causes", "run_repros", "gate_problems"]

REPRO_TIMEOUT = 120.0


@dataclass(frozen=True)
class ReproRun:
    slug: str
    script: str
    status: str        # "reproduces" | "stops reproducing" | "missing" | "error"
    detail: str
    seconds: float

    @property
    def failed(self) -> bool:
        return self.status != "reproduces"

    def line(self) -> str:
        said = {"reproduces": "reproduces (exit 1)",
                "stops reproducing": "STOPS REPRODUCING (exit 0): fixed upstream? retire the entry",
                "missing": "MISSING: no such file", "error": "ERROR"}[self.status]
        return f"{self.slug}: {self.script}: {said}" + (f"; {self.detail}" if self.detail else "")


def gone_causes(results, accepted: Accepted) -> list[str]:
    """One line per root cause with keys on the ops run and none of them found in ``results``."""
    ops = {r.op for r in results if r.executed}
    found = {f.key() for r in results for f in r.findings}
    lines = []
    for cause in accepted.causes:
        watched = [key for key in cause.keys if key.split(" ", 1)[0] in ops]
        if watched and not any(key in found for key in watched):
            name = cause.slug or cause.reason[:60]
            on = ", ".join(sorted({key.split(" ", 1)[0] for key in watched}))
            lines.append(f"root cause {name} ({cause.where}): none of its {len(watched)} class(es) on {on} was found: "
                         "fixed upstream? retire the entry")
    return lines


def run_repros(accepted: Accepted, root: Path, timeout: float = REPRO_TIMEOUT, jobs: int = 2) -> list[ReproRun]:
    """Every root cause's repros run, each in its own process from ``root``, ``jobs`` at a time
    (most spawn their own gloo ranks and wait on them), in the file's order."""
    listed = [(cause, script) for cause in accepted.causes for script in cause.repros]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda item: _run_one(item[0], item[1], root, timeout), listed))


def _run_one(cause, script: str, root: Path, timeout: float) -> ReproRun:
    path = root / script
    start = time.perf_counter()
    if not path.is_file():
        return ReproRun(cause.slug, script, "missing", f"listed at {cause.where} (repros)", 0.0)
    try:
        done = subprocess.run([sys.executable, str(path)], cwd=root, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return ReproRun(cause.slug, script, "error", f"still running after {timeout:g} s", time.perf_counter() - start)
    status = {1: "reproduces", 0: "stops reproducing"}.get(done.returncode, "error")
    tail = (done.stdout + done.stderr).strip().splitlines()
    said = [f"exit status {done.returncode}"] if status == "error" else []
    if status == "reproduces" and _uncaught(done.stderr):
        # Python's own exit status for an uncaught exception is 1 too: the script broke (an API
        # that moved), which says nothing of the fault
        status, said = "error", ["exit status 1 from an uncaught exception, not the script's verdict"]
    if status != "reproduces" and tail:
        said.append(f"its last line: {tail[-1][:200]}")
    return ReproRun(cause.slug, script, status, "; ".join(said), time.perf_counter() - start)


def _uncaught(stderr: str) -> bool:
    """The process ended on an uncaught exception: its stderr's last line is the exception
    after a traceback."""
    lines = stderr.strip().splitlines()
    return bool(lines) and "Traceback (most recent call last):" in stderr and \
        re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b", lines[-1]) is not None


def gate_problems(results, accepted: Accepted, repros: list[ReproRun]) -> list[str]:
    """What fails the gate beyond new classes: root causes gone, repros that do not reproduce."""
    return gone_causes(results, accepted) + [run.line() for run in repros if run.failed]
