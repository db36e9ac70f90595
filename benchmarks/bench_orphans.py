"""Stop `shardverify verify --jobs 2` (simulated ranks in a forkserver pool) and a gloo run with
SIGTERM and SIGKILL mid-run, and report how long it takes until nothing of them is left: no
process of their session, no folder in their TMPDIR, no new multiprocessing semaphore in
/dev/shm that no live process has mapped. Exit status 1 if anything is left after --within
seconds.

    python benchmarks/bench_orphans.py                 # the four cases, 10 s each
    python benchmarks/bench_orphans.py --within 60 --ignore-shm --cases jobs:KILL

Run it on a quiet machine for the figures: under a loaded test suite the workers' start-up and
shut-down stretch, and other processes' semaphores come and go in /dev/shm (--ignore-shm).
Before the fix, SIGTERM or SIGKILL of `--jobs` left the forkserver, its workers and the resource
tracker (about 1 GB), a `pymp-*` folder and 6-8 `sem.mp-*` files; SIGKILL of a gloo run left its
`shardverify-pool-*` and `pymp-*` folders.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")
RUNS = {"jobs": ["verify", "--jobs", "2"], "gloo": ["verify", "--backend", "gloo", "relu", "linear"]}
SIGNALS = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL}


def session_processes(sid: int) -> set[int]:
    """The processes of session ``sid`` (the run starts its own: a forkserver re-parents its
    children, and a killed leader's children go to init, but they keep the session)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3]) == sid:
                    found.add(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def unmapped_semaphores() -> set[str]:
    """multiprocessing semaphores in /dev/shm that no live process has mapped (leaked ones)."""
    mapped = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                mapped |= {line.rsplit("/", 1)[-1].split()[0] for line in (entry / "maps").read_text().splitlines()
                           if "/dev/shm/sem.mp-" in line}
            except OSError:
                continue
    return {p.name for p in SHM.iterdir() if p.name.startswith("sem.mp-")} - mapped if SHM.is_dir() else set()


def stop_and_watch(run: str, sig: str, within: float, ignore_shm: bool) -> tuple[float | None, str]:
    """(seconds until nothing was left, or None; what was left at the end)."""
    temp = Path(tempfile.mkdtemp(prefix="svo-", dir="/tmp"))   # short: the forkserver's AF_UNIX path lives here
    shm_before = unmapped_semaphores()
    proc = subprocess.Popen([sys.executable, "-m", "shardverify", *RUNS[run]], cwd=REPO, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(temp)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while len(session_processes(proc.pid)) < 3:       # the run and at least two workers are up
            if proc.poll() is not None or time.monotonic() > deadline:
                return None, f"the run never started its workers: {proc.stderr.read().decode()[-500:]}"
            time.sleep(0.2)
        time.sleep(1.0)
        os.kill(proc.pid, SIGNALS[sig])
        proc.wait(timeout=60)
        killed = time.monotonic()
        while True:
            left = (sorted(session_processes(proc.pid)),
                    sorted(p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")),
                    sorted(set() if ignore_shm else unmapped_semaphores() - shm_before))
            if not any(left):
                return time.monotonic() - killed, ""
            if time.monotonic() - killed > within:
                return None, f"processes {left[0]}, temp folders {left[1]}, /dev/shm {left[2]}"
            time.sleep(0.25)
    finally:
        for pid in session_processes(proc.pid):           # leave the machine clean even when failing
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(temp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="jobs:TERM,jobs:KILL,gloo:TERM,gloo:KILL",
                        help="comma-separated RUN:SIGNAL, RUN in jobs|gloo, SIGNAL in TERM|KILL")
    parser.add_argument("--within", type=float, default=10.0, help="seconds allowed until nothing is left")
    parser.add_argument("--ignore-shm", action="store_true", help="do not count /dev/shm (a loaded machine)")
    parser.add_argument("--quick", action="store_true",
                        help="CI's smoke run: jobs:KILL and gloo:KILL only (the cases that leave the most), "
                             "within 30 s (a loaded CI machine stretches shut-down; the figure is still printed)")
    args = parser.parse_args(argv)
    if args.quick:
        args.cases, args.within = "jobs:KILL,gloo:KILL", max(args.within, 30.0)
    if sys.platform != "linux":
        print("Linux only (/proc, /dev/shm)")
        return 0
    failed = False
    print(f"{'run':<6} {'signal':<8} result")
    for case in args.cases.split(","):
        run, _, sig = case.partition(":")
        if run not in RUNS or sig not in SIGNALS:
            parser.error(f"case {case!r} is not RUN:SIGNAL with RUN in {sorted(RUNS)} and SIGNAL in {sorted(SIGNALS)}")
        seconds, left = stop_and_watch(run, sig, args.within, args.ignore_shm)
        failed |= seconds is None
        print(f"{run:<6} SIG{sig:<5} " + (f"nothing left after {seconds:.1f} s" if seconds is not None
                                          else f"LEFT after {args.within:g} s: {left}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
