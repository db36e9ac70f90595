"""No orphans: `shardverify verify --jobs 2` (a pool of simulated-rank processes under a
forkserver) and a gloo run, stopped by SIGTERM or SIGKILL mid-run, leave no process, no
/dev/shm entry and no temp folder behind within 10 seconds.

Before: SIGTERM or SIGKILL of `--jobs` left the forkserver, its workers and the resource tracker
(about 1 GB), a `pymp-*` folder and 6-8 `sem.mp-*` files; SIGKILL of a gloo run left its
`shardverify-pool-*` and `pymp-*` folders. Each case runs a real `shardverify` process in its
own session, with TMPDIR pointed at a fresh folder so that only its own leftovers are counted.
Ctrl-C prints the rows finished so far and exits 130, without a traceback.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

SHM = Path("/dev/shm")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not SHM.is_dir() or sys.platform != "linux",
                                                   reason="Linux process and /dev/shm layout")]


def _descendants(pid: int) -> set[int]:
    """Every process whose ancestry includes ``pid`` or whose session is ``pid``'s (a
    forkserver re-parents its children, and a killed leader's children go to init)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == pid:    # the session id: the run was started with its own session
            found.add(int(entry.name))
    return found


@pytest.fixture
def short_tmp():
    """A fresh TMPDIR for the run, short enough for the forkserver's socket path (AF_UNIX
    paths hold 108 bytes; pytest's tmp_path under xdist does not fit)."""
    folder = Path(tempfile.mkdtemp(prefix="svo-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _semaphores() -> set[str]:
    """The multiprocessing semaphores in /dev/shm that no live process has mapped: leaked ones
    (another test's, still in use, are mapped by its processes)."""
    mapped = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                mapped |= {line.rsplit("/", 1)[-1].strip() for line in (entry / "maps").read_text().splitlines()
                           if "/dev/shm/sem.mp-" in line}
            except OSError:
                continue
    return {p.name for p in SHM.iterdir() if p.name.startswith("sem.mp-")} - mapped


@pytest.mark.parametrize("argv", [["verify", "--jobs", "2"], ["verify", "--backend", "gloo", "relu", "linear"]],
                         ids=["jobs", "gloo"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_stopped_run_leaves_nothing_behind(short_tmp, argv, sig):
    temp = short_tmp
    shm_before = _semaphores()
    env = {**os.environ, "TMPDIR": str(temp)}
    proc = subprocess.Popen([sys.executable, "-m", "shardverify", *argv], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])
    deadline = time.monotonic() + 120
    while len(_descendants(proc.pid)) < 3:       # the run and at least two workers are up
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "the run never started its workers"
        time.sleep(0.2)
    time.sleep(1.0)
    os.kill(proc.pid, sig)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        # torch's compile cache (torchinductor_<user>) is meant to outlive the run: not a leftover
        left = (_descendants(proc.pid), sorted(p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")),
                _semaphores() - shm_before)
        if not any(left):
            break
        time.sleep(0.25)
    processes, folders, semaphores = left
    for pid in processes:                          # leave the machine clean even when failing
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not processes and not folders and not semaphores, (
        f"after {signal.Signals(sig).name}: processes {sorted(processes)}, temp folders {folders}, "
        f"/dev/shm {sorted(semaphores)}")


def _terminal_sigint() -> None:
    """The SIGINT handling a terminal gives its programs (a background shell ignores SIGINT,
    and children inherit that)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("argv", [["verify"], ["verify", "--jobs", "2"]], ids=["verify", "jobs"])
def test_ctrl_c_prints_the_rows_so_far_and_exits_130(short_tmp, argv):
    checks = short_tmp / "checks.log"      # each strategy batch verified appends a line (SHARDVERIFY_CHECK_LOG)
    proc = subprocess.Popen([sys.executable, "-m", "shardverify", *argv], start_new_session=True,
                            env={**os.environ, "TMPDIR": str(short_tmp), "SHARDVERIFY_CHECK_LOG": str(checks)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_terminal_sigint,
                            cwd=Path(__file__).resolve().parents[1])
    deadline = time.monotonic() + 120
    while not checks.exists() or len(checks.read_text().splitlines()) < 3:   # some rows done, most to run
        assert proc.poll() is None and time.monotonic() < deadline, "the run never verified anything"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in out + err
    assert re.search(r"interrupted after \d+ of \d+ row\(s\); exit 130", err), err
    assert out.splitlines()[0].split()[:2] == ["op", "case"], out[:300]


def test_ctrl_c_during_the_audit_prints_the_cases_so_far(monkeypatch, capsys):
    from shardverify.audit import run as audit_run
    from shardverify.cli.main import main

    real = audit_run.audit_case
    done = []

    def interrupted_after_two(*args, **kwargs):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(audit_run, "audit_case", interrupted_after_two)
    assert main(["audit", "relu", "--mesh", "2"]) == 130
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split()[:2] == ["op", "case"] and len(out.splitlines()) == 4, out
    assert "interrupted after 2 case(s); exit 130" in err and "Traceback" not in out + err
