"""`shardverify dtensor --confirm` (shardverify/features/dtensor/confirm.py): each silent class's repro run
under torchrun on real gloo processes, its verdict read, stored and shown per class.

The tests that start torchrun are marked dist (run with AUTO_PARALLEL=1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardverify.spec.catalogue import load_op_specs
from shardverify.features.dtensor.confirm import (class_examples, confirm_classes, decide, load_confirmations,
                                         run_on_gloo)
from shardverify.features.dtensor.report import markdown, summary
from shardverify.features.dtensor.run import CaseResult, run_case
from shardverify.features.dtensor.verdicts import Finding

pytestmark = pytest.mark.slow   # findings confirmed on gloo processes

ROOT = Path(__file__).resolve().parent.parent
CASE = "torch.cumsum-dim_-1"


def _cumsum():
    spec = load_op_specs(ROOT, None, ["cumsum"])[0]
    return spec, dict(spec.op_cases())[CASE]


@pytest.mark.dist
def test_cumsum_of_a_negative_dim_is_confirmed_on_4_gloo_processes_and_not_run_again(tmp_path):
    spec, case = _cumsum()
    result = run_case(spec, CASE, case, (4,), limit=None)
    silent = [f for f in result.findings if f.klass == "silent-wrong"]
    assert [f.line for f in silent] == ["input=[S(2)]"]      # the last dim sharded: cumsum(x, -1) per shard
    seen = []
    found = confirm_classes([result], [spec], tmp_path, root=ROOT, progress=lambda c, reused: seen.append(reused))
    confirmation = found[silent[0].key()]
    assert confirmation.status == "confirmed", confirmation.output
    assert confirmation.world == 4 and "max abs error" in confirmation.detail and "(4 of 4 ranks)" in confirmation.detail
    # stored beside the results: the same example is not run again, another is
    again = confirm_classes([result], [spec], tmp_path, root=ROOT, progress=lambda c, reused: seen.append(reused))
    assert seen == [False, True] and again[silent[0].key()] == confirmation
    examples = {k: {**e, "spec_hash": "0" * 12} for k, (_, e) in class_examples([result], [spec], ROOT).items()}
    assert load_confirmations(tmp_path, confirmation.torch, examples) == {}
    page = markdown([result], None, "shardverify dtensor cumsum", confirmation.torch, confirmations=found)
    assert "**confirmed** on 4 real gloo processes" in page and "- 1 `silent-wrong` class(es): 1 confirmed" in page


@pytest.mark.dist
def test_a_repro_that_does_not_reproduce_on_gloo_is_said_loudly(tmp_path):
    # cumsum(x, -1) with the FIRST dim sharded is right: a silent finding claimed on it is suspect
    spec, _ = _cumsum()
    claimed = Finding("cumsum", CASE, (2,), (("input", "[S0, R, R]"),), (("input", "[S(0)]"),), "silent-wrong",
                      "forward", "output 0 [S(0)]: rank 0 differs from the reference", "", "", "", "")
    result = CaseResult("cumsum", CASE, (2,), 5, 5, findings=[claimed])
    found = confirm_classes([result], [spec], tmp_path, root=ROOT)[claimed.key()]
    assert found.status == "not reproduced", found.output
    assert found.detail == "every one of the 2 ranks computes the right values and gradients"
    text = summary([result], None, 5, {claimed.key(): found})
    assert "1 silent-wrong class(es): 1 not reproduced" in text
    assert f"[NOT REPRODUCED] {claimed.key()}" in text and "the in-process finding is suspect" in text


@pytest.mark.dist
def test_a_killed_process_is_aborted_and_a_hang_times_out_with_every_process_ended():
    abort = "import os, signal\nprint('starting', flush=True)\nos.kill(os.getpid(), signal.SIGABRT)\n"
    output, timed_out, _ = run_on_gloo({}, 1, timeout=120, program=abort)
    assert not timed_out
    status, detail = decide("silent-wrong", output, 1, timed_out, 120)
    assert (status, detail) == ("aborted", "rank 0 killed by SIGABRT; ranks without a verdict: [0]"), output
    output, timed_out, seconds = run_on_gloo({}, 1, timeout=3, program="import time\ntime.sleep(600)\n")
    assert timed_out and seconds < 60
    assert decide("silent-wrong", output, 1, timed_out, 3) == (
        "timeout", "no result within 3 s; every process killed; ranks without a verdict: [0]")


def test_verdict_lines_decide_the_class_a_silent_class_that_raises_on_gloo_differs():
    def line(ranks, status, detail=""):
        return "VERDICT " + json.dumps({"ranks": ranks, "status": status, "detail": detail})

    wrong = "\n".join([line([0], "wrong", "output on rank 0: max abs error 2"), line([1], "wrong", "x")])
    assert decide("silent-wrong", wrong, 2, False, 9) == ("confirmed", "output on rank 0: max abs error 2 (2 of 2 ranks)")
    late = line([0, 1], "late-failure", "the backward raises RuntimeError: no")
    assert decide("late-failure", late, 2, False, 9)[0] == "confirmed"
    assert decide("silent-wrong", late, 2, False, 9) == (
        "differs", "late-failure on real processes: the backward raises RuntimeError: no")
    assert decide("silent-wrong", line([0], "right"), 2, False, 9)[0] == "aborted"    # rank 1 said nothing
    # the processes write unbuffered: print's text and its newline are two writes, and another
    # process's line can land between them (seen once in CI: "3 of 4 ranks" on cumsum)
    merged = line([0], "wrong", "output on rank 0: max abs error 2") + "verdict of rank(s) [1]: DTensor is wrong: x" + (
        line([1], "wrong", "x")) + "\n\n\n"
    assert decide("silent-wrong", merged, 2, False, 9) == ("confirmed", "output on rank 0: max abs error 2 (2 of 2 ranks)")


def test_confirm_without_a_results_folder_is_a_usage_error(capsys):
    from shardverify.cli.main import main

    assert main(["dtensor", "cumsum", "--mesh", "4", "--confirm", "--root", str(ROOT)]) == 2
    assert "--confirm stores what it finds beside the results: give --results DIR or --from-json DIR" in (
        capsys.readouterr().err)


def test_a_process_gloo_kills_inside_dtensor_after_the_op_returned_is_a_late_failure_said_with_its_step():
    # conv2d forward-late input=S(0) weight=S(2) on (2, 2): the handler convolves each rank's kernel rows
    # (2 and 1 of 3), the output blocks differ in height, and full_tensor()'s all_gather hands gloo
    # buffers of different sizes: gloo aborts the ranks receiving more than their buffer holds
    def stage(rank, what):
        return "STAGE " + json.dumps({"ranks": [rank], "stage": what})

    def killed(rank, code, name):
        return (f"[{rank}]:\n  time      : now\n  host      : localhost\n  rank      : {rank} (local_rank: {rank})\n"
                f"  exitcode  : {code} (pid: {100 + rank})  ({name})")

    steps = [stage(r, s) for r in range(4) for s in ("the op", "full_tensor() of the output")]
    output = "\n".join(steps + [
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
        "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 20480 vs 18432. Received data "
        "size doesn't match expected size. Is there a distributed collective mismatch in your code?",
        "VERDICT " + json.dumps({"ranks": [3], "status": "wrong", "detail": "output on rank 3: expected shape (8, 16, 8, 8)"}),
        killed(0, -6, "SIGABRT"), killed(1, -6, "SIGABRT"), killed(2, -15, "SIGTERM")])
    status, detail = decide("late-failure", output, 4, False, 9)
    assert status == "confirmed", detail
    assert detail.startswith("the op returned on every rank, then rank 0 killed by SIGABRT in full_tensor() of the "
                             "output, rank 1 killed by SIGABRT in full_tensor() of the output; gloo: [enforce fail")
    assert "rank 3 wrong: output on rank 3: expected shape" in detail and "rank 2" not in detail   # torchrun's SIGTERM
    assert decide("silent-wrong", output, 4, False, 9)[0] == "differs"
    # killed while the op itself ran: DTensor's failure, never a confirmation of a late one
    during = "\n".join([stage(0, "the op"), killed(0, -6, "SIGABRT")])
    assert decide("late-failure", during, 1, False, 9)[1].startswith("the op itself kills a process: rank 0 killed by")
    # killed before any of DTensor's steps: the script's own setup, aborted
    assert decide("late-failure", killed(0, -6, "SIGABRT"), 1, False, 9)[0] == "aborted"
    # killed after its verdict (gloo's teardown aborting at exit, seen once in CI on cumsum): the verdicts decide
    said = [stage(r, "the op") for r in range(4)] + [
        "VERDICT " + json.dumps({"ranks": [r], "status": "wrong", "detail": f"output on rank {r}: max abs error 7.69"})
        for r in range(4)]
    assert decide("silent-wrong", "\n".join(said + [killed(0, -6, "SIGABRT")]), 4, False, 9)[0] == "confirmed"


def test_one_class_confirmed_on_two_meshes_keeps_both_and_a_store_of_one_file_per_key_is_still_read(tmp_path):
    from shardverify.features.dtensor.confirm import Confirmation, _path, save_confirmation

    key = "conv2d forward input=P(sum) weight=R"        # the same class key on (4,) and (2, 2)

    def made(mesh):
        example = {"op": "conv2d", "case": "c", "mesh": list(mesh), "layouts": {}, "spec_hash": "0" * 12, "format": 2}
        return Confirmation(key, "silent-wrong", "t", example, "confirmed", f"on {mesh}", 4, 1.0, "0" * 12)

    on_4, on_22 = made((4,)), made((2, 2))
    save_confirmation(tmp_path, on_4)
    save_confirmation(tmp_path, on_22)     # one file per key: this overwrote the (4,) confirmation
    assert load_confirmations(tmp_path, "t", {key: on_4.example}) == {key: on_4}
    assert load_confirmations(tmp_path, "t", {key: on_22.example}) == {key: on_22}
    legacy = made((2, 3))
    _path(tmp_path, "t", key).write_text(json.dumps(legacy.to_json()))
    assert load_confirmations(tmp_path, "t", {key: legacy.example}) == {key: legacy}
