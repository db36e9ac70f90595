"""The warnings torch gives while a `verify` row runs are counted on the row, not printed
(shardverify/cli/row_warnings.py); anything else written to stderr meanwhile still reaches it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from shardverify.cli.row_warnings import caught_warnings

REPO = Path(__file__).resolve().parents[1]
DOF = "var(): degrees of freedom is <= 0. Correction should be strictly less than the reduction factor " \
      "(input numel divided by output numel)."


def test_python_and_cpp_warnings_are_counted_and_other_output_passes(capfd):
    one = torch.ones(1)
    with caught_warnings() as found:
        torch.var(one)                                   # a Python warning
        torch.ops.aten.var.correction(one, correction=1)   # torch.ops: C++ writes it to descriptor 2
        torch.ops.aten.var.correction(one, correction=1)
        warnings.warn("planted", DeprecationWarning)
        os.write(2, b"a line that is no warning\n")
        os.write(2, b"/x/child.py:3: RuntimeWarning: from a child process\n  its_source_line()\n")
    assert dict(found.counts) == {DOF: 3, "DeprecationWarning: planted": 1, "RuntimeWarning: from a child process": 1}
    out, err = capfd.readouterr()
    assert err == "a line that is no warning\n" and out == ""


def test_a_cpp_warning_of_several_lines_is_counted_whole_and_prints_nothing():
    """torch.cholesky's deprecation, given once per process from C++, shows over eight lines the
    code to write instead; every line of it is the one warning's, none reaches stderr (a `verify
    --jobs` worker printed them under its report)."""
    script = (
        "import json, torch\n"
        "from shardverify.cli.row_warnings import caught_warnings\n"
        "a = torch.eye(3) * 2\n"
        "with caught_warnings() as found:\n"
        "    torch.ops.aten.cholesky(a)\n"
        "    torch.ops.aten.var.correction(torch.ones(1), correction=1)\n"
        "print(json.dumps(dict(found.counts)))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    counts = json.loads(done.stdout)
    cholesky = [key for key in counts if key.startswith("torch.cholesky is deprecated")]
    assert len(cholesky) == 1 and counts[cholesky[0]] == 1 and counts[DOF] == 1, counts
    text = cholesky[0]
    assert "should be replaced with" in text and text.endswith("(symmetric positive definite) inputs.")


def test_without_the_descriptor_only_python_warnings_are_caught(capfd):
    one = torch.ones(1)
    with caught_warnings(descriptor=False) as found:
        torch.var(one)
        torch.ops.aten.var.correction(one, correction=1)
    assert dict(found.counts) == {DOF: 1}
    assert "Warning: var(): degrees of freedom is <= 0" in capfd.readouterr().err   # a process pool's ranks keep it


def test_the_descriptor_is_given_back_when_the_block_raises(capfd):
    try:
        with caught_warnings():
            os.write(2, b"said before the error\n")
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "said before the error\nafter\n"


def test_a_progress_line_drawn_outside_reaches_stderr_at_once(capfd):
    with caught_warnings() as found:
        os.write(2, b"[W1202 20:46:57.7 ReduceOps.cpp:1861] Warning: planted (function f)\n")
        with found.outside():
            os.write(2, b"\rprogress")
            assert capfd.readouterr().err == "\rprogress"      # written now, not when the block ends
        os.write(2, b"[rank0]:[W1202 20:46:57.8 ReduceOps.cpp:1861] Warning: planted (function f)\n")
    assert dict(found.counts) == {"planted": 2} and capfd.readouterr().err == ""
