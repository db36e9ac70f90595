"""The collective count around DTensor's forward (dtensor/hooks.counting_collectives) must not
change what a module target computes. ``CommDebugMode``'s module tracker registers a global full
backward pre-hook, and under it every ``nn.Module`` call returns a view of its output
(``BackwardHookFunction``): a DTensor view re-reads the local value at the shape the placements
claim. conv's runtime handler returns local values that do not fit their placements, so the view
turned its late failures into silently reshaped values and its wrong shapes into a view's error
("raises") for nn.Conv2d only, while torch alone (python and torchrun) says otherwise."""

from __future__ import annotations

from pathlib import Path

import torch

from shardverify.features.audit.combinations import CaseCombinations
from shardverify.features.dtensor.execute import CaseRunner, quiet_dtensor
from shardverify.features.dtensor.hooks import counting_collectives
from shardverify.features.dtensor.placements import placements_of, placements_text
from shardverify.features.dtensor.run import present_combinations
from shardverify.features.dtensor.world import local_world
from shardverify.spec.catalogue import load_op_specs

ROOT = Path(__file__).resolve().parent.parent
CASE = "torch.nn.Conv2d-bias_False-groups_1"


def test_a_module_call_under_the_collective_count_is_what_a_plain_call_gives():
    spec = load_op_specs(ROOT, None, ["conv2d"])[0]
    audit = CaseCombinations(spec, dict(spec.op_cases())[CASE], (4,), partial_inputs=True, extremum_inputs=False)
    by_line = {" ".join(f"{o.role}={placements_text(placements_of(layout, (4,)))}"
                        for o, layout in zip(audit.operands, combo)): combo
               for combo in present_combinations(audit.combinations())}
    with quiet_dtensor(), local_world((4,)) as (mesh, mode):
        runner = CaseRunner(audit.problem, audit.operands, mesh, mode)
        late = runner.run(by_line["input=[P(sum)] weight=[S(0)]"])
        shape = runner.run(by_line["input=[S(2)] weight=[R]"])
    # the handler's (8, 4, 8, 8) local block labelled [S(0)] of (8, 16, 8, 8): full_tensor() raises,
    # as in the repro under python and on 4 gloo processes (not values re-read as (2, 16, 8, 8))
    assert late.failed == "forward-late" and "full_tensor() raises" in late.detail, late
    # each rank's 2 rows convolved, labelled [R]: a wrong shape, not the view's "shape ... is invalid"
    assert shape.failed == "forward-wrong" and "holds shape (8, 16, 2, 8)" in shape.detail, shape
    # the count itself still counts, and leaves no module hook behind
    module = torch.nn.Linear(2, 2)
    with counting_collectives() as comm:
        out = module(torch.ones(1, 2, requires_grad=True))
    assert out.grad_fn.name() == "AddmmBackward0" and comm.get_total_counts() == 0
    assert not torch.nn.modules.module._global_backward_pre_hooks
