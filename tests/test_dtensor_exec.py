"""DTensor executed (shardverify/features/dtensor): real DTensor under LocalTensorMode, forward and
backward, every rank's values against the reference; classes, the rule beside the runtime, the
repro script, a user's own op and rule, and the accepted-file gate."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardverify.sharding.layout import Layout
from shardverify.cli.main import main
from shardverify.spec.catalogue import load_op_specs
from shardverify.features.dtensor.accepted import load_accepted
from shardverify.features.dtensor.confirm import verdicts_of
from shardverify.features.dtensor.custom import load_custom, run_custom
from shardverify.features.dtensor.placements import placements_of, placements_text
from shardverify.features.dtensor.run import run_case
from shardverify.errors import SpecError

ROOT = Path(__file__).resolve().parent.parent
CUSTOM = ROOT / "tests" / "dtensor_custom"


def _case(name: str, case_id: str):
    spec = load_op_specs(ROOT, None, [name])[0]
    return spec, dict(spec.op_cases())[case_id]


@pytest.fixture(scope="module")
def conv2d_on_4():
    spec, case = _case("conv2d", "torch.ops.aten.conv2d.default-bias_False-groups_8")
    return run_case(spec, "torch.ops.aten.conv2d.default-bias_False-groups_8", case, (4,), limit=None)


def test_conv2d_with_a_partial_weight_is_silently_wrong_and_the_runtime_is_to_blame(conv2d_on_4):
    by_line = {f.line: f for f in conv2d_on_4.findings}
    found = by_line["input=[R] weight=[P(sum)]"]      # depthwise: the case the aten target's grid holds
    assert found.klass == "silent-wrong" and found.phase == "forward"
    assert "differs from the reference" in found.detail
    # the rule asks for a redistribution; the convolution handler never applies it
    assert "rule redistributes inputs to [R], [R]" in found.rule
    assert "the runtime did not redistribute" in found.rule
    assert found.runtime == ("the runtime is wrong: aten.convolution.default's rule asks for a redistribution "
                             "the runtime never applies")
    assert found.culprit.startswith("runtime of aten.convolution.default (forward): inputs [R], [P(sum)] -> output "
                                    "[R], wrong by")
    # a batch shard is right, with no communication
    assert conv2d_on_4.counts["agrees"] >= 1 and "input=[S(0)] weight=[R]" not in by_line


def test_the_repro_reproduces_with_torch_alone(conv2d_on_4, tmp_path):
    found = next(f for f in conv2d_on_4.findings if f.line == "input=[R] weight=[P(sum)]")
    assert found.repro and "shardverify" not in found.repro.split('"""', 2)[2]   # nothing of ours is imported
    script = tmp_path / "repro.py"
    script.write_text(found.repro)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "WRONG" in run.stdout


@pytest.mark.dist
def test_the_repro_reproduces_on_real_gloo_processes_under_torchrun(conv2d_on_4, tmp_path):
    found = next(f for f in conv2d_on_4.findings if f.line == "input=[R] weight=[P(sum)]")
    script = tmp_path / "repro.py"
    script.write_text(found.repro)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                          "--standalone", str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert run.returncode != 0
    # every real rank holds the full shape, with wrong values (a partial weight never summed)
    lines = sorted(line for line in run.stdout.splitlines() if line.startswith("rank "))
    assert [line.split(" (max abs error")[0] for line in lines] == [
        f"rank {r}: output shape (8, 16, 6, 6), WRONG" for r in range(4)], run.stdout + run.stderr[-2000:]
    assert [status for status, _ in verdicts_of(run.stdout).values()] == ["wrong"] * 4, run.stdout


def test_right_dtensor_results_agree_and_a_partial_input_it_reduces_first_is_a_missed_optimisation():
    spec, case = _case("mean", "torch.ops.aten.mean.dim-dim_-1-keepdim_False")
    result = run_case(spec, "torch.ops.aten.mean.dim-dim_-1-keepdim_False", case, (4,), limit=None)
    assert result.executed == result.combinations == 5
    assert result.counts == {"agrees": 4, "missed-optimisation": 1}
    missed, = result.findings
    # mean is linear in its input: the audit runs a partial sum through it; DTensor all-reduces first
    assert missed.line == "input=[P(sum)]"
    assert missed.comms == "redistributes aten.mean.dim: [P(sum)] -> [R]; forward 1 all_reduce"
    assert missed.local_strategy == "[R, R] P(sum:0)"



def test_a_combination_over_its_time_budget_is_counted_too_slow_and_ends_the_case(monkeypatch):
    """DTensor's propagation of attention with a mask takes minutes a combination: over the budget
    the combination is "too-slow" (nothing claimed), said in the case's note with what was left."""
    import time as clock

    from shardverify.features.dtensor import execute

    real = execute.CaseRunner._run
    began: list[float] = []     # when the slow combination started (the case's set-up before it is not timed)

    def busy(seconds: float) -> None:     # CPU work, as DTensor's propagation is
        end = clock.monotonic() + seconds
        while clock.monotonic() < end:
            pass

    monkeypatch.setattr(execute.CaseRunner, "_run",
                        lambda self, combo: (began.append(clock.monotonic()), busy(5), real(self, combo))[2])
    spec, case = _case("mean", "torch.ops.aten.mean.dim-dim_-1-keepdim_False")
    result = run_case(spec, "torch.ops.aten.mean.dim-dim_-1-keepdim_False", case, (4,), limit=None, budget=0.2)
    assert clock.monotonic() - began[0] < 4               # the first combination was stopped, not waited for
    assert result.executed == 1 and result.counts == {"too-slow": 1}
    assert "took over 0.2 s of CPU time" in result.note and "other 4 chosen combination(s) not executed" in result.note
    from shardverify.features.dtensor.run import budget_skipped

    assert budget_skipped(result) == 5           # the slow one and the 4 after it
    with execute.deadline(0.2, execute.TooSlow, cpu=True):   # the timer is gone: nothing fires afterwards
        pass
    busy(0.3)


def test_the_time_budget_counts_cpu_time_not_a_loaded_machine_s_clock(monkeypatch):
    """On a loaded machine a combination waits for a core: a wall-clock budget cut cases short
    (15 sum and 6 linear combinations) that needed little work. Waiting is not work."""
    import time as clock

    from shardverify.features.dtensor import execute

    real = execute.CaseRunner._run
    # the first combination waits 2.5 s for the machine, beyond a budget of 2 CPU-s that its work
    # (milliseconds alone; a combination took over 0.2 CPU-s at load 20) stays far below
    waits = iter([2.5])
    monkeypatch.setattr(execute.CaseRunner, "_run",
                        lambda self, combo: (clock.sleep(next(waits, 0)), real(self, combo))[1])
    spec, case = _case("mean", "torch.ops.aten.mean.dim-dim_-1-keepdim_False")
    result = run_case(spec, "torch.ops.aten.mean.dim-dim_-1-keepdim_False", case, (4,), limit=None, budget=2.0)
    assert result.executed == result.combinations == 5 and "too-slow" not in result.counts

def test_both_shard_orders_and_uneven_blocks_reach_dtensor_as_the_audit_cut_them():
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor

    from shardverify.features.audit.decide import Operand, prepare
    from shardverify.features.dtensor.world import local_world
    from shardverify.sharding.mesh import DeviceMesh
    from shardverify.spec.case import InputDecl, OpCase

    layout = Layout(((1, 0), ()))   # S10: cut by axis 1, then by axis 0
    assert placements_text(placements_of(layout, (2, 3))) == "[_S(0, sf=3), S(0)]"
    case = OpCase(op="neg", target="torch.neg", inputs=(InputDecl("x", (7, 5), "float64"),))
    operand = Operand("x", "x", ("arg", 0), (7, 5), True)
    problem = prepare(case, DeviceMesh((2, 3)), (operand,))
    full = problem.values[("arg", 0)]
    blocks = problem.local(0, layout)
    assert sorted(b.shape[0] for b in blocks) == [0, 1, 1, 1, 2, 2]   # 7 rows: 3/2/2 by axis 1, then halves
    with local_world((2, 3)) as (mesh, mode):
        with mode:
            back = DTensor.from_local(LocalTensor(dict(enumerate(blocks))), mesh, placements_of(layout, (2, 3)),
                                      run_check=False, shape=full.shape, stride=full.stride()).full_tensor()
        assert all(torch.equal(t, full) for t in back._local_tensors.values())
        # ... while the mesh-order placements cannot read the same blocks back
        with mode, pytest.raises(RuntimeError):
            DTensor.from_local(LocalTensor(dict(enumerate(blocks))), mesh, placements_of(Layout(((0, 1), ())), (2, 3)),
                               run_check=False, shape=full.shape, stride=full.stride()).full_tensor()


def test_a_planted_wrong_rule_for_a_custom_op_is_reported_as_silent_corruption():
    right = run_custom(load_custom(CUSTOM / "row_normalize.yaml"))
    assert sum(r.counts["silent-wrong"] for r in right) == 0
    assert all(r.executed == r.combinations > 0 and not r.note for r in right)
    bad = run_custom(load_custom(CUSTOM / "row_normalize_bad.yaml"))
    findings = {(f.case, f.mesh, f.line): f for r in bad for f in r.findings}
    found = findings[("8x6", (4,), "x=[S(1)]")]
    assert found.klass == "silent-wrong" and "differs from the reference" in found.detail
    assert found.runtime == ("the forward rule is wrong: svtest.row_normalize_bad.default's rule gives a wrong "
                             "result on these placements")
    # the uneven case and the 2-D mesh find it too (7 columns of 5 cut 2/2/1/0 on (4,))
    assert ("7x5", (4,), "x=[S(1)]") in findings and ("8x6", (2, 2), "x=[S(0), S(1)]") in findings


def test_an_axis_asymmetric_wrong_rule_is_caught_on_both_axis_orders():
    """DTensor is not symmetric under swapping mesh axes: a rule wrong only where mesh axis 0 (or
    1) holds the last dim's shard is caught either way (one layout per orbit ran only one mirror)."""
    found = {}
    for axis in (0, 1):
        results = run_custom(load_custom(CUSTOM / f"row_normalize_bad_axis{axis}.yaml"))
        found[axis] = {f.line for r in results for f in r.findings if f.klass == "silent-wrong"}
        assert all(r.executed == r.combinations for r in results)
    assert "x=[S(1), R]" in found[0] and "x=[R, S(1)]" not in found[0]
    assert "x=[R, S(1)]" in found[1] and "x=[S(1), R]" not in found[1]


def test_a_wrong_gradient_is_blamed_on_the_backward_op_and_a_view_rewrite_is_no_data_movement():
    """select(x, -1, i)'s forward rule is right; the wrong gradient is select_backward's (its rule
    does not normalise dim=-1), found by holding every aten op to the op on its inputs' full values."""
    spec, case = _case("select", "torch.select-dim_-1-index_-1")
    result = run_case(spec, "torch.select-dim_-1-index_-1", case, (4,), limit=None)
    wrong = next(f for f in result.findings if f.klass == "silent-wrong")
    assert wrong.key() == "select backward input=S(1)"
    assert wrong.culprit.startswith("backward rule of aten.select_backward.default (backward): inputs [S(1)] -> output [S(2)]")
    assert wrong.runtime.startswith("the backward rule is wrong: aten.select_backward.default")
    # the same bug with dim 0 sharded: the gradient on the wrong dim makes the backward raise, late
    late = next(f for f in result.findings if f.klass == "late-failure")
    assert late.key() == "select backward-late input=S(0)" and "must match the size" in late.detail
    # a view's argument rewrite moves nothing: the replicated and sharded-elsewhere inputs agree
    assert result.counts["agrees"] == 3 and result.counts["missed-optimisation"] == 0


@pytest.mark.parametrize("name, case_id, node", [
    ("select_scatter", "torch.select_scatter-dim_1-index_-1", "SelectScatterBackward0"),
    ("slice_scatter", "torch.ops.aten.slice_scatter.default-dim_1-start_1-end_7-step_2", "SliceScatterBackward0")])
def test_a_backward_that_hands_dtensor_a_plain_tensor_is_a_late_failure_blamed_on_its_backward_function(
        name, case_id, node):
    """select_scatter's and slice_scatter's forward is right on every layout; their autograd
    backward makes the input's gradient from plain zeros (``src_info.zeros()``), which DTensor
    refuses beside the DTensor gradient: attributed to that backward function, not to a rule
    (docs/upstream/scatter-backward-plain-zeros.md)."""
    spec, case = _case(name, case_id)
    result = run_case(spec, case_id, case, (4,), limit=2)
    assert result.executed == 2 and result.counts["late-failure"] == 2
    for found in result.findings:
        assert found.phase == "backward" and "got mixed torch.Tensor and DTensor" in found.detail
        assert found.culprit.startswith(f"runtime function autograd's {node} (backward): it passes "
                                        f"aten.{name}.default a plain torch.Tensor")
    assert "shardverify" not in result.findings[0].repro.split('"""', 2)[2]


def test_a_combination_local_tensor_mode_itself_cannot_run_is_not_simulated_not_raising():
    """select_scatter with src [S(0), P(sum)] on (2, 3): reducing the partial onto uneven shards
    makes LocalTensorMode combine ranks' results that differ in structure (torch.chunk of uneven
    blocks), which it asserts against; real gloo processes run it (the op returns, its backward
    fails late). Not DTensor raising: nothing is claimed in process."""
    from shardverify.features.audit.combinations import CaseCombinations
    from shardverify.features.dtensor.run import CaseResult, execute_combos, present_combinations

    case_id = "torch.select_scatter-dim_1-index_-1"
    spec, case = _case("select_scatter", case_id)
    audit = CaseCombinations(spec, case, (2, 3), partial_inputs=True, extremum_inputs=False)
    want = {"input": "[R, R]", "src": "[S(0), P(sum)]"}
    combo, = [c for c in present_combinations(audit.combinations())
              if {o.role: placements_text(placements_of(layout, (2, 3))) for o, layout in zip(audit.operands, c)} == want]
    result = CaseResult("select_scatter", case_id, (2, 3))
    execute_combos(result, audit.problem, audit.operands, [combo], audit.decide, None)
    assert dict(result.counts) == {"not-simulated": 1}
    found, = result.findings
    assert found.detail.startswith("forward: LocalTensorMode fails combining the ranks' results (AssertionError")


def test_the_embedding_mask_on_the_first_mesh_axis_is_a_late_failure_and_its_mirror_is_right():
    """The trigger is which mesh axis holds the table's rows (the mask) and which the ids, not
    uneven ids: even ids on (2, 2) fail when the mask's axis is gathered after the ids' axis."""
    from collections import Counter

    from shardverify.features.audit.combinations import CaseCombinations
    from shardverify.features.dtensor.run import CaseResult, execute_combos

    case_id = "torch.ops.aten.embedding.default"
    spec, case = _case("embedding", case_id)
    audit = CaseCombinations(spec, case, (2, 2), partial_inputs=True, extremum_inputs=False)
    on = {"0": Layout(((0,), ())), "1": Layout(((1,), ()))}      # dim 0 cut by mesh axis 0, or by axis 1
    combos = [tuple(on[ids] if o.role == "input" else on[rows] for o in audit.operands)
              for ids, rows in (("1", "0"), ("0", "1"))]
    result = CaseResult("embedding", case_id, (2, 2))
    execute_combos(result, audit.problem, audit.operands, combos, audit.decide, None)
    assert result.executed == 2 and result.counts == Counter({"late-failure": 1, "agrees": 1})
    late, = result.findings
    assert dict(late.placements) == {"input": "[R, S(0)]", "weight": "[S(0), R]"}
    assert late.key() == "embedding forward-late input=S(0) weight=S(0)"
    assert "full_tensor() raises IndexError: The shape of the mask [4, 8]" in late.detail
    assert "shardverify" not in late.repro.split('"""', 2)[2]          # a torch-only repro of the late failure


def _accepted(tmp_path, keys, reason="planted in a test"):
    path = tmp_path / "accepted.yaml"
    path.write_text("accepted:\n  - reason: " + reason + "\n    keys:\n" + "".join(f"      - \"{k}\"\n" for k in keys))
    return path


def test_the_command_fails_on_a_silent_class_the_accepted_file_does_not_list(tmp_path, capsys):
    spec = str(CUSTOM / "row_normalize_bad.yaml")
    assert main(["dtensor", "--custom", spec, "--mesh", "4", "--accepted", str(_accepted(tmp_path, ["x y z"]))]) == 1
    out = capsys.readouterr().out
    assert "[NEW] svtest::row_normalize_bad forward x=S(1)" in out and out.startswith("FAIL  ")
    assert out.splitlines()[1].startswith("first new class: svtest::row_normalize_bad forward x=S(1): e.g. ")
    listed = _accepted(tmp_path, ["svtest::row_normalize_bad forward x=S(1)"])
    assert main(["dtensor", "--custom", spec, "--mesh", "4", "--accepted", str(listed),
                 "--write", str(tmp_path / "dtensor.md"), "--repros", str(tmp_path / "repros")]) == 0
    page = (tmp_path / "dtensor.md").read_text()
    assert "`svtest::row_normalize_bad forward x=S(1)`" in page and "accepted: planted in a test" in page
    assert len(list((tmp_path / "repros").glob("*.py"))) == 1


class _Terminal:
    """stderr as an interactive shell has it: a terminal (the progress line is drawn there)."""

    def __init__(self) -> None:
        import io

        self.text = io.StringIO()

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return self.text.write(text)

    def flush(self) -> None:
        pass


def test_the_report_starts_with_the_verdict_and_the_table_is_behind_verbose(tmp_path, capsys, monkeypatch):
    """FAIL, the first new class, the classes; a progress line on a terminal; -v adds the table,
    and --quiet leaves stderr empty even on a terminal."""
    argv = ["dtensor", "--custom", str(CUSTOM / "row_normalize_bad.yaml"), "--mesh", "4",
            "--accepted", str(_accepted(tmp_path, ["x y z"]))]
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(argv) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("FAIL  8 layout combinations run on DTensor: 2 silently wrong, 0 failing later, "
                               "1 new class not in the accepted file  (1 op, 2 cases, 1 mesh; ")
    assert lines[1].startswith("first new class: svtest::row_normalize_bad forward x=S(1): e.g. ")
    assert lines[2].startswith("DTensor computes wrong values silently: 2 combination(s)")
    assert lines[3].startswith("  [NEW] svtest::row_normalize_bad") and len(lines) == 4
    drawn = terminal.text.getvalue()
    assert drawn.startswith("\r[") and "2/2 100%" in drawn and drawn.endswith("\r") and "\n" not in drawn
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main([*argv, "-v", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[1:4] == lines[1:] and terminal.text.getvalue() == ""
    table = out.splitlines()[5:]
    assert table[0].split()[:5] == ["op", "case", "mesh", "combos", "run"] and len(table) == 4


def test_a_malformed_accepted_file_is_a_usage_error_naming_file_and_line(tmp_path, capsys):
    path = tmp_path / "accepted.yaml"
    path.write_text("accepted:\n  - reason: x\n    keys: [conv2d]\n")
    with pytest.raises(SpecError, match="class key"):
        load_accepted(path)
    assert main(["dtensor", "--custom", str(CUSTOM / "row_normalize.yaml"), "--accepted", str(path)]) == 2
    assert "accepted.yaml:3" in capsys.readouterr().err


def test_a_custom_spec_that_cannot_import_its_module_is_a_usage_error(tmp_path, capsys):
    path = tmp_path / "custom.yaml"
    path.write_text("op: nope::op\nimport: no_such_module_here\ninputs:\n  x: {}\ncases:\n  - {x: [4]}\n"
                    "meshes: [[2]]\n")
    assert main(["dtensor", "--custom", str(path)]) == 2
    assert "no_such_module_here" in capsys.readouterr().err


def test_a_class_key_is_the_same_on_every_mesh_and_the_accepted_file_round_trips(tmp_path):
    import dataclasses

    from shardverify.features.dtensor.accepted import RootCause, render_accepted
    from shardverify.features.dtensor.verdicts import class_key

    on_4 = class_key("conv2d", "forward", (("input", "[R]"), ("weight", "[S(0)]")))
    on_2x2 = class_key("conv2d", "forward", (("input", "[R, R]"), ("weight", "[R, S(0)]")))
    assert on_4 == on_2x2 == "conv2d forward input=R weight=S(0)"
    assert class_key("mm", "backward", (("a", "[S(0), P(sum)]"),)) == "mm backward a=P(sum)+S(0)"
    assert class_key("cumsum", "forward", (("x", "[_S(2, sf=3), S(2)]"),)) == "cumsum forward x=S(2)+_S(2, sf=3)"
    path = tmp_path / "accepted.yaml"
    cause = RootCause("conv-runtime", 'the "runtime" skips it', (on_4, on_4 + " bias=R"),
                      ("runtime of aten.convolution.default (forward)",), ("wrong shape", "wrong values"),
                      ("docs/upstream/repros/conv.py",), "docs/upstream/conv.md")
    path.write_text(render_accepted([cause], "2.13.0"))
    accepted = load_accepted(path)
    assert accepted.torch == "2.13.0"
    assert accepted.reasons == {on_4: 'the "runtime" skips it', on_4 + " bias=R": 'the "runtime" skips it'}
    assert accepted.causes == (dataclasses.replace(cause, where=f"{path}:7"),)


def test_a_saved_run_is_reported_again_against_another_accepted_file(tmp_path, capsys):
    spec = str(CUSTOM / "row_normalize_bad.yaml")
    assert main(["dtensor", "--custom", spec, "--mesh", "4", "--json", "--quiet",
                 "--accepted", str(_accepted(tmp_path, ["x y z"]))]) == 1
    saved = tmp_path / "run.json"
    saved.write_text(capsys.readouterr().out)
    listed = _accepted(tmp_path, ["svtest::row_normalize_bad forward x=S(1)"])
    assert main(["dtensor", "--from-json", str(saved), "--accepted", str(listed),
                 "--write", str(tmp_path / "page.md")]) == 0
    page = (tmp_path / "page.md").read_text()
    assert f"`shardverify dtensor --custom {spec} --mesh 4`" in page and "accepted: planted in a test" in page
    (tmp_path / "broken.json").write_text("{}")
    assert main(["dtensor", "--from-json", str(tmp_path / "broken.json")]) == 2


def test_a_stored_run_interrupted_mid_case_resumes_at_its_next_combination(tmp_path, monkeypatch, capsys):
    from shardverify.features.dtensor import run as run_module
    from shardverify.features.dtensor.execute import CaseRunner

    spec = load_op_specs(ROOT, None, ["neg"])[0]
    whole = run_module.run_spec(spec, [(4,)], limit=None)
    store = tmp_path / "results"
    real_save, saves = run_module.save_stored, []

    def interrupted(path, stored):   # stored after every combination; killed at the 7th save
        saves.append(path)
        if len(saves) == 7:
            raise KeyboardInterrupt
        real_save(path, stored)

    monkeypatch.setattr(run_module, "CHECKPOINT_SECONDS", -1.0)
    monkeypatch.setattr(run_module, "save_stored", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_module.run_spec(spec, [(4,)], limit=None, store=store, root=ROOT)
    monkeypatch.setattr(run_module, "save_stored", real_save)
    executed, real_run = [], CaseRunner.run
    monkeypatch.setattr(CaseRunner, "run", lambda self, combo: executed.append(combo) or real_run(self, combo))
    resumed = run_module.run_spec(spec, [(4,)], limit=None, store=store, root=ROOT)
    total = sum(r.executed for r in whole)
    assert 0 < len(executed) < total          # the first case and part of the second were not run again
    assert [(r.case, r.executed, dict(r.counts)) for r in resumed] == [(r.case, r.executed, dict(r.counts)) for r in whole]
    executed.clear()
    run_module.run_spec(spec, [(4,)], limit=None, store=store, root=ROOT)
    assert not executed                       # complete: read back, nothing run
    assert main(["dtensor", "neg", "relu", "--mesh", "4", "--limit", "0", "--from-json", str(store),
                 "--root", str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert "1 of 2 (op spec, mesh) pairs complete" in out and "Not run on any mesh (1 specs): relu" in out


def test_a_combination_a_process_died_on_is_counted_raising_when_the_run_resumes(tmp_path):
    from shardverify.features.dtensor.run import DIED, run_spec
    from shardverify.features.dtensor.store import spec_hash, store_path

    spec = load_op_specs(ROOT, None, ["neg"])[0]
    path = store_path(tmp_path, "neg", spec_hash(spec, ROOT), (4,), torch.__version__, None)
    path.parent.mkdir(parents=True)
    # what a process killed by a native crash leaves: the marker of the combination in progress
    path.with_name(path.name + ".running").write_text("torch.Tensor.neg\n2\nDTensor's execution\n")
    results = {r.case: r for r in run_spec(spec, [(4,)], limit=None, store=tmp_path, root=ROOT)}
    died = results["torch.Tensor.neg"]
    assert died.executed == 5 and died.counts["raises"] == 1
    assert died.findings[0].detail == f"{DIED} (in DTensor's execution)"
    assert results["torch.neg"].counts == {"agrees": 5}
    assert not path.with_name(path.name + ".running").exists()


def test_a_full_report_reads_a_case_the_full_run_has_not_finished_from_its_stored_sample_and_says_so(
        tmp_path, capsys):
    from shardverify.features.dtensor.run import run_spec
    from shardverify.features.dtensor.stored_results import stored_results

    spec = load_op_specs(ROOT, None, ["neg"])[0]
    run_spec(spec, [(4,)], limit=2, store=tmp_path, root=ROOT)        # every case, a sample of 2
    results, note = stored_results(tmp_path, [spec], [(4,)], None, ROOT)
    assert [r.executed for r in results] == [2] * len(spec.op_cases()) and len(results) > 1
    assert "0 of 1 (op spec, mesh) pairs complete, 1 complete where some cases ran an evenly spaced sample" in note
    assert "--limit 2" in note and all("not executed (limit 2)" in r.note for r in results)
    # the full run's finished cases win over the sample; a sampled pair is no longer said to be one
    whole = run_spec(spec, [(4,)], limit=None, store=tmp_path, root=ROOT)
    results, note = stored_results(tmp_path, [spec], [(4,)], None, ROOT)
    assert [r.executed for r in results] == [r.executed for r in whole] and "1 of 1 (op spec, mesh) pairs complete," in note
    # asked for the sample, only the sample is read
    assert [r.executed for r in stored_results(tmp_path, [spec], [(4,)], 2, ROOT)[0]] == [2] * len(results)


def test_a_run_stored_by_another_harness_version_is_never_read_as_this_ones(tmp_path, monkeypatch):
    """Results are keyed by the spec file's hash; a harness fix changes outcomes without touching
    the spec, so a run stored before it must not pass for one made after (conv1d's module results
    kept a silent class the fix had turned into a late failure)."""
    import json

    from shardverify.features.dtensor import store, stored_results as reading
    from shardverify.features.dtensor.run import run_spec
    from shardverify.features.dtensor.stored_results import stored_results

    spec = load_op_specs(ROOT, None, ["neg"])[0]
    first = run_spec(spec, [(4,)], limit=1, store=tmp_path, root=ROOT)
    path, = (tmp_path / f"torch-{torch.__version__}").glob("neg.4.limit1.*.json")
    assert json.loads(path.read_text())["harness"] == store.HARNESS
    assert "pairs complete" in stored_results(tmp_path, [spec], [(4,)], 1, ROOT)[1]
    newer = store.HARNESS + 1
    monkeypatch.setattr(reading, "HARNESS", newer)     # the harness changed since (read by both)
    monkeypatch.setattr(store, "HARNESS", newer)
    results, note = stored_results(tmp_path, [spec], [(4,)], 1, ROOT)
    assert results == [] and "0 of 1 (op spec, mesh) pairs complete" in note
    assert f"Left out, made by another version of the harness than this one's ({newer})" in note
    assert f"neg (4,) (version {newer - 1})" in note
    again = run_spec(spec, [(4,)], limit=1, store=tmp_path, root=ROOT)    # run again, not resumed
    assert not any(r.resumed for r in again) and [r.executed for r in again] == [r.executed for r in first]


def test_a_running_statistic_is_no_gradient_leaf_so_batch_norm_runs_forward_and_backward():
    case_id = "torch.ops.aten.batch_norm.default-training_False-momentum_0.1-eps_1e-05-cudnn_enabled_False"
    spec, case = _case("batch_norm", case_id)
    result = run_case(spec, case_id, case, (4,), limit=3)
    assert result.executed == 3 and "error" not in result.note      # it raised asking running_mean's gradient
    assert result.counts["agrees"] >= 1


def test_a_repro_differentiates_every_output_the_finding_did_so_group_norm_fails_as_in_process(tmp_path):
    """native_group_norm's finding checks output, mean and rstd and takes the gradient of all three:
    autograd then runs its composite backward (unsqueeze_, which DTensor has no rule for), not
    native_group_norm_backward (right on every rank). A repro of the output alone is right on gloo
    and on LocalTensorMode alike: it would 'not reproduce' a finding it never ran."""
    case_id = "torch.ops.aten.native_group_norm.default-N_4-C_6-HxW_6-group_3-eps_1e-05"
    spec, case = _case("native_group_norm", case_id)
    result = run_case(spec, case_id, case, (4,), limit=1)
    found, = result.findings
    assert found.line == "input=[R] weight=[R] bias=[R]" and "aten.unsqueeze_.default" in found.detail
    script = tmp_path / "repro.py"
    script.write_text(found.repro)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert '"status": "late-failure"' in run.stdout and "aten.unsqueeze_.default" in run.stdout, run.stdout


def test_write_accepted_writes_one_entry_per_root_cause_that_accepts_the_run_and_round_trips(tmp_path, capsys):
    spec = str(CUSTOM / "row_normalize_bad.yaml")
    written, again = tmp_path / "written.yaml", tmp_path / "again.yaml"
    assert main(["dtensor", "--custom", spec, "--mesh", "4", "--quiet", "--accepted", str(_accepted(tmp_path, ["x y z"])),
                 "--write-accepted", str(written)]) == 1
    cause, = load_accepted(written).causes
    assert cause.keys == ("svtest::row_normalize_bad forward x=S(1)",)
    assert cause.culprits and cause.culprits[0].startswith("forward rule of ") and cause.severity == ("wrong values",)
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", cause.slug) and cause.reason.startswith("to fill in")
    assert "classes: 1" in written.read_text() and "TODO" not in written.read_text()
    # the file written accepts the run, and a run against it writes its entries back as they are
    assert main(["dtensor", "--custom", spec, "--mesh", "4", "--quiet", "--accepted", str(written),
                 "--write-accepted", str(again)]) == 0
    assert again.read_text() == written.read_text()
