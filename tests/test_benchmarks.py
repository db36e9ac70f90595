"""The benchmark scripts are not timed in tests, but they must keep importing and parsing
their arguments as the package changes under them, and CI must run each one's quick mode
(.ci/run runs ``--quick`` of every ``benchmarks/bench_*.py``: a figure it cannot measure fails CI)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("bench_*.py"))


def test_there_are_benchmarks():
    assert BENCHMARKS, "benchmarks/ has no bench_*.py script"


def test_every_script_in_benchmarks_is_one_ci_runs():
    """CI's step globs bench_*.py: a script named otherwise would be forgotten."""
    scripts = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
    assert scripts == BENCHMARKS, f"not named bench_*.py, so CI skips: {sorted(set(scripts) - set(BENCHMARKS))}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'for script in benchmarks/bench_*.py' in ci and '"$script" --quick' in ci, \
        ".ci/run no longer runs every benchmark's --quick mode"


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_script_starts(script):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
    assert "--quick" in done.stdout, f"{script.name} has no --quick mode for CI"


def test_a_localtensormode_left_entered_by_a_cut_dtensor_layout_is_undone(monkeypatch):
    """bench_verify cuts a DTensor layout over its budget wherever it is, past a hard limit: cut
    inside LocalTensorMode's enter or exit, the mode stayed entered, and every tensor the rest of
    the run made (the bare op's, the fresh-processes baseline's) was a LocalTensor."""
    import torch
    from torch.distributed._local_tensor import LocalTensorMode

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_verify

    depths = bench_verify._mode_stacks()
    LocalTensorMode(4).__enter__()     # entered, never exited: what a cut in __enter__ leaves
    try:
        assert type(torch.zeros(2)).__name__ == "LocalTensor"
    finally:
        bench_verify._restore_mode_stacks(depths)
    assert bench_verify._mode_stacks() == depths
    assert type(torch.zeros(2)) is torch.Tensor and torch.zeros(2).tolist() == [0.0, 0.0]
