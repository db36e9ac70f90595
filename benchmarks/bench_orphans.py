"""Stop a run mid-way and report how long it takes until nothing of it is left: no process of
its session, no folder in its TMPDIR, no new multiprocessing semaphore in /dev/shm that no live
process has mapped; and that it said so in one line: exit status 128 + the signal, no traceback.
Exit status 1 if anything is left after --within seconds, or the stop printed a traceback or
ended otherwise.

Runs: `verify --jobs 2` (simulated ranks in a forkserver pool), `verify --backend gloo`, `plan
--backend gloo` (a gloo pool), `dtensor` (in process), `pytest -n 2` (xdist workers with gloo
pools). Signals: TERM and KILL to the run's process, INT and GTERM to its whole process group (a
terminal's Ctrl-C, `kill -- -PGID`).

    python benchmarks/bench_orphans.py                 # every case, 10 s each
    python benchmarks/bench_orphans.py --within 60 --ignore-shm --cases jobs:KILL,pytest:GTERM
    python benchmarks/bench_orphans.py --parallel 3    # three cases at a time (the test suite's way)

Run it on a quiet machine for the figures: under a loaded test suite the workers' start-up and
shut-down stretch, and other processes' semaphores come and go in /dev/shm (--ignore-shm).
Before the fix, SIGTERM or SIGKILL of `--jobs` left the forkserver, its workers and the resource
tracker (about 1 GB), a `pymp-*` folder and 6-8 `sem.mp-*` files; SIGKILL of a gloo run left its
`shardverify-pool-*` and `pymp-*` folders; a group SIGTERM of `pytest -n 2` ended in INTERNALERROR
(exit 3), and Ctrl-C of `plan --backend gloo` printed a forkserver traceback in 4 runs of 16 and
was lost in 3. Then a `--jobs` worker stopped mid-row left the multiprocessing lock of tqdm's
progress bar (which torch.fx's Interpreter opens, disabled, on every run) to the resource
tracker, which warned "2 leaked semaphore objects": a stop other than SIGKILL now fails on that
warning (after SIGKILL the tracker unlinks what the killed process held, and warns, by design).
A SIGKILL while a gloo pool started left its just-started workers for 300 s under load: one
worker's clean-up removed the pool's folder, and torch's FileStore constructor in the others
retried the missing folder holding the GIL, so their parent watch never ran (see
process_worker.open_store).
pytest keeps its own `pytest-of-*` folder by design (its last three sessions' tmp_path), so that
one is not counted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shardverify.backends.liveness import session_cpu_seconds, session_processes

REPO = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")
LEAK_WARNING = "resource_tracker: There appear to be"     # ... N leaked semaphore objects ...
SV = ["-m", "shardverify"]
#: each run's command and when it is under way: (processes of its session, CPU seconds it has used)
#: (`--jobs` waits for its two workers to be verifying rows: a worker's own resources exist by then)
RUNS = {"jobs": ([*SV, "verify", "--jobs", "2"], (5, 8.0)),
        "gloo": ([*SV, "verify", "--backend", "gloo", "relu", "linear"], (3, 0.0)),
        "plan": ([*SV, "plan", "specs/plans/transformer.yaml", "--backend", "gloo"], (3, 0.0)),
        "dtensor": ([*SV, "dtensor", "linear", "relu", "--mesh", "2,2"], (1, 6.0)),
        "pytest": (["-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-q", "tests/test_backends_process.py",
                    "generated_tests/test_linear.py", "-k", "not torchrun"], (5, 0.0))}
#: signal, and whether it goes to the whole process group (a terminal's Ctrl-C, `kill -- -PGID`)
SIGNALS = {"TERM": (signal.SIGTERM, False), "KILL": (signal.SIGKILL, False), "INT": (signal.SIGINT, True),
           "GTERM": (signal.SIGTERM, True)}
#: runs started one at a time (--parallel): the child runs _terminal_sigint between fork and exec,
#: so no other thread of this process forks or holds the subprocess machinery meanwhile
_STARTING = threading.Lock()
DEFAULT_CASES = ("jobs:TERM,jobs:KILL,gloo:TERM,gloo:KILL,plan:INT,plan:GTERM,dtensor:INT,dtensor:TERM,"
                 "pytest:INT,pytest:GTERM")


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


def _terminal_sigint() -> None:
    """The SIGINT handling a terminal gives its programs (a background shell ignores SIGINT)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop_and_watch(run: str, sig: str, within: float, ignore_shm: bool,
                   start_within: float = 300.0) -> tuple[float | None, str]:
    """(seconds until nothing was left, or None; what was left at the end, or what went wrong)."""
    temp = Path(tempfile.mkdtemp(prefix="svo-", dir="/tmp"))   # short: the forkserver's AF_UNIX path lives here
    shm_before = unmapped_semaphores()
    command, (processes, cpu) = RUNS[run]
    signum, group = SIGNALS[sig]
    output = tempfile.TemporaryFile()
    with _STARTING:
        proc = subprocess.Popen([sys.executable, *command], cwd=REPO, start_new_session=True,
                                env={**os.environ, "TMPDIR": str(temp), "AUTO_PARALLEL": "1"}, stdout=output,
                                stderr=subprocess.STDOUT, preexec_fn=_terminal_sigint)

    def said() -> str:
        output.seek(0)
        return output.read().decode(errors="replace")

    try:
        deadline = time.monotonic() + start_within   # a hang guard: the run's own progress is what is waited for
        while len(session_processes(proc.pid)) < processes or session_cpu_seconds(proc.pid) < cpu:
            if proc.poll() is not None or time.monotonic() > deadline:
                return None, f"the run never got under way: {said()[-500:]}"
            time.sleep(0.2)
        time.sleep(1.0)
        if proc.poll() is not None:
            return None, f"the run ended (exit {proc.returncode}) before the stop: choose a longer one"
        (os.killpg if group else os.kill)(proc.pid, signum)
        ends_within = max(120.0, within)   # a hang guard, as wide as --within: on a loaded machine a run
        try:                               # stopped while its workers start (xdist's nodes) takes minutes
            proc.wait(timeout=ends_within)   # a run that outlives it is reported with what it said
        except subprocess.TimeoutExpired:
            return None, (f"still running {ends_within:g} s after {sig} (its session's processes: "
                          f"{sorted(session_processes(proc.pid))}): {said()[-1500:]}")
        killed = time.monotonic()
        text = said()
        if signum != signal.SIGKILL:
            if proc.returncode not in (128 + signum, -signum):
                return None, f"exit {proc.returncode}, not {128 + signum}: {text[-800:]}"
            if "Traceback" in text or "INTERNALERROR" in text:
                return None, f"a traceback: {text[-1500:]}"
        while True:
            left = (sorted(session_processes(proc.pid)),
                    sorted(p.name for p in temp.iterdir() if not p.name.startswith(("torchinductor_", "pytest-of-"))),
                    sorted(set() if ignore_shm else unmapped_semaphores() - shm_before))
            if not any(left):
                # the resource tracker, the last to go, warns of what no process unregistered
                # (after SIGKILL that is its job: the killed process could unregister nothing)
                if signum != signal.SIGKILL and LEAK_WARNING in said():
                    return None, f"a leak warning: {said()[-800:]}"
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
        output.close()
        shutil.rmtree(temp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=DEFAULT_CASES,
                        help=f"comma-separated RUN:SIGNAL, RUN in {'|'.join(RUNS)}, SIGNAL in {'|'.join(SIGNALS)} "
                             f"(default: {DEFAULT_CASES})")
    parser.add_argument("--within", type=float, default=10.0, help="seconds allowed until nothing is left")
    parser.add_argument("--start-within", type=float, default=300.0,
                        help="seconds a run may take to get under way before it is called hung (default 300)")
    parser.add_argument("--ignore-shm", action="store_true", help="do not count /dev/shm (a loaded machine)")
    parser.add_argument("--quick", action="store_true",
                        help="CI's smoke run: jobs:KILL and gloo:KILL only (the cases that leave the most), "
                             "within 30 s (a loaded CI machine stretches shut-down; the figure is still printed)")
    parser.add_argument("--parallel", type=int, default=1,
                        help="cases run at once, each in its own session and TMPDIR (default 1: the figures are "
                             "for one case alone; a semaphore one leaks fails every case that sees it)")
    args = parser.parse_args(argv)
    if args.parallel < 1:
        parser.error("--parallel must be at least 1")
    if args.quick:
        args.cases, args.within = "jobs:KILL,gloo:KILL", max(args.within, 30.0)
    if sys.platform != "linux":
        print("Linux only (/proc, /dev/shm)")
        return 0
    cases = []
    for case in args.cases.split(","):
        run, _, sig = case.partition(":")
        if run not in RUNS or sig not in SIGNALS:
            parser.error(f"case {case!r} is not RUN:SIGNAL with RUN in {sorted(RUNS)} and SIGNAL in {sorted(SIGNALS)}")
        cases.append((run, sig))
    failed = False
    print(f"{'run':<8} {'signal':<7} result")
    with ThreadPoolExecutor(args.parallel) as pool:   # results printed in the order asked, each as it is known
        futures = [pool.submit(stop_and_watch, run, sig, args.within, args.ignore_shm, args.start_within) for run, sig in cases]
        for (run, sig), future in zip(cases, futures):
            seconds, left = future.result()
            failed |= seconds is None
            print(f"{run:<8} {sig:<7} " + (f"nothing left after {seconds:.1f} s" if seconds is not None
                                                else f"FAILED (within {args.within:g} s): {left}"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
