"""The model check (shardverify.features.ddp): plan validation, the single-device reference, tolerances,
reports, and -- on real gloo processes -- that planted DDP reduction bugs are caught and
reported with the step, the parameter name and the rank.

Tests that need processes are marked dist (run with AUTO_PARALLEL=1); they share the plugin's
pools with the generated model tests.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from torch import nn

from shardverify.features.ddp import (DDPOptions, LayerDecl, LossDecl, ModelDecl, ModelPlan,
                             ModelResult, OptimizerDecl, assert_model_passed, plan_tolerance,
                             reference_trajectory, shard_steps, verify_model)
from shardverify.features.ddp.build import build_model, make_batch
from shardverify.features.ddp.check import FLOAT32_ATOL, FLOAT32_RTOL, _Comparer
from shardverify.features.ddp.hooks import COMPRESSION_UNIT_ROUNDOFF
from shardverify.features.ddp.report import model_mismatch, model_order
from shardverify.errors import BackendError, InvalidArgument
from shardverify.verify.report import Mismatch
from shardverify.verify.tolerance import Tolerance

MLP = ModelDecl(layers=(LayerDecl("torch.nn.Linear", (6, 12)), LayerDecl("torch.nn.ReLU"),
                        LayerDecl("torch.nn.Linear", (12, 3))))
MSE_PLAN = ModelPlan("mlp_mse", MLP, (8, 6), LossDecl("mse"), target_shape=(8, 3), steps=2,
                     optimizer=OptimizerDecl("sgd", (("lr", 0.1), ("momentum", 0.9))))
SUM_PLAN = ModelPlan("mlp_sum", MLP, (8, 6), LossDecl("sum", "sum"), steps=2)


def with_options(plan: ModelPlan, expect: str = "equal", **options: object) -> ModelPlan:
    return dataclasses.replace(plan, options=DDPOptions(**options), expect=expect)


# ---- plan values --------------------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    ({"accumulate": 0}, "accumulate must be an int >= 1, got 0"),
    ({"comm_hook": "fp8"}, "comm_hook must be one of"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb must be a number > 0, got 0"),
    ({"static_graph": 1}, "static_graph must be a bool, got 1"),
    ({"join": True, "accumulate": 2}, "join (uneven inputs) with accumulate > 1"),
])
def test_bad_ddp_options_are_rejected_naming_the_value(options, message):
    with pytest.raises(InvalidArgument) as info:
        DDPOptions(**options)
    assert message in str(info.value)


@pytest.mark.parametrize("changes, message", [
    ({"target_shape": (8, 3)}, "loss 'sum' takes no target_shape"),
    ({"loss": LossDecl("mse")}, "loss 'mse' needs target_shape"),
    ({"loss": LossDecl("cross_entropy"), "target_shape": (8,)}, "classes is required exactly for cross_entropy"),
    ({"loss": LossDecl("mse"), "target_shape": (4, 3)}, "with the batch size 8 first"),
    ({"expect": "maybe"}, "expect must be one of"),
    ({"steps": 1, "options": DDPOptions(join=True)}, "join needs steps >= 2"),
])
def test_bad_plans_are_rejected_naming_the_value(changes, message):
    with pytest.raises(InvalidArgument) as info:
        dataclasses.replace(SUM_PLAN, **changes)
    assert message in str(info.value)


def test_world_size_must_split_the_global_batch():
    SUM_PLAN.check_world(4)
    with pytest.raises(InvalidArgument, match="global batch 8 .* not divisible by the data-parallel world size 3"):
        SUM_PLAN.check_world(3)


def test_uneven_schedule_gives_lower_ranks_more_steps():
    assert shard_steps(3, 4, join=False) == (3, 3, 3, 3)
    assert shard_steps(3, 4, join=True) == (3, 2, 1, 1)


def test_options_label_names_only_changed_options():
    assert DDPOptions().label() == "default"
    assert DDPOptions(accumulate=2, static_graph=True).label() == "accumulate=2,static_graph=True"


# ---- the single-device reference -----------------------------------------------------------

def test_reference_is_plain_single_device_training_on_the_global_batch():
    """Independent re-computation: a hand-written torch loop on the whole batch."""
    snapshots = reference_trajectory(MSE_PLAN, world=2)
    torch.manual_seed(MSE_PLAN.seed)
    model = build_model(MSE_PLAN.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(MSE_PLAN.steps):
        inputs, target = make_batch(MSE_PLAN, step, 0)
        loss = nn.functional.mse_loss(model(inputs), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        got = dict(snapshots[step].params)
        for name, param in model.named_parameters():
            torch.testing.assert_close(got[name], param.detach())
            torch.testing.assert_close(dict(snapshots[step].grads)[name], param.grad)
    assert len(snapshots) == MSE_PLAN.steps


def test_reference_shard_losses_add_up_to_the_global_loss():
    """For a mean loss over equal shards the global loss is the mean of the shard losses."""
    snapshot = reference_trajectory(MSE_PLAN, world=4)[0]
    torch.manual_seed(MSE_PLAN.seed)
    model = build_model(MSE_PLAN.model)
    inputs, target = make_batch(MSE_PLAN, 0, 0)
    with torch.no_grad():
        global_loss = float(nn.functional.mse_loss(model(inputs), target))
    assert math.isclose(sum(snapshot.losses) / 4, global_loss, rel_tol=1e-6)


def test_uneven_reference_trains_only_on_the_shards_still_training():
    even, uneven = (reference_trajectory(dataclasses.replace(MSE_PLAN, steps=3, options=DDPOptions(join=join)), 2)
                    for join in (False, True))
    assert even[0].losses == uneven[0].losses and uneven[2].losses[1] is None
    torch.testing.assert_close(dict(even[1].params), dict(uneven[1].params))
    with pytest.raises(AssertionError):  # step 2 used only shard 0 in the uneven run
        torch.testing.assert_close(dict(even[2].params), dict(uneven[2].params))


# ---- tolerances and reports --------------------------------------------------------------

def test_tolerance_is_float32_tight_and_fp16_looser_growing_with_world_and_steps():
    assert plan_tolerance(MSE_PLAN, 4) == Tolerance(FLOAT32_RTOL, FLOAT32_ATOL)
    fp16 = with_options(MSE_PLAN, comm_hook="fp16_compress")
    tol2 = plan_tolerance(fp16, 2)
    assert tol2.rtol == tol2.atol == 4 * 3 * COMPRESSION_UNIT_ROUNDOFF["fp16_compress"] * fp16.steps
    assert plan_tolerance(fp16, 4).rtol > tol2.rtol > 100 * FLOAT32_RTOL
    assert plan_tolerance(dataclasses.replace(fp16, rtol=0.5), 2) == Tolerance(0.5, tol2.atol)


def _mismatch(step, rank=0, quantity="grad", name="0.weight"):
    return model_mismatch("values", step, rank, quantity, name, Tolerance(1e-5, 1e-6), actual_shape=(12, 6),
                          expected_shape=(12, 6), max_abs_err=0.5, max_rel_err=1.0)


def test_mismatch_report_names_step_rank_quantity_parameter_and_error():
    found = _mismatch(1, rank=3)
    assert isinstance(found, Mismatch)
    assert (found.when, found.phase, found.tensor) == ("step 1", "grad", "grad of '0.weight'")
    text = found.describe()
    assert text.startswith("step 1, rank 3: grad of '0.weight' shape (12, 6) differs")
    assert "max abs err 0.5" in text and "atol=1e-06" in text
    assert _mismatch(None, quantity="param").describe().startswith("after join, rank 0: param of '0.weight'")
    assert model_mismatch("values", 0, 1, "loss", "", Tolerance(1e-5, 1e-6), actual_shape=(), max_abs_err=0.5,
                          max_rel_err=1.0).describe().startswith("step 0, rank 1: loss differs from the reference")


def test_mismatches_sort_by_step_then_quantity_then_name_then_rank():
    found = [_mismatch(None, 0, "param"), _mismatch(1, 0, "loss", ""), _mismatch(0, 1, "buffer", "a"),
             _mismatch(0, 1, "grad", "a.b"), _mismatch(0, 0, "grad", "a.b"), _mismatch(0, 0, "grad", "a")]
    assert [(m.when, m.tensor, m.rank) for m in sorted(found, key=model_order)] == [
        ("step 0", "grad of 'a'", 0), ("step 0", "grad of 'a.b'", 0), ("step 0", "grad of 'a.b'", 1),
        ("step 0", "buffer of 'a'", 1), ("step 1", "loss", 0), ("after join", "param of '0.weight'", 0)]


def test_values_are_compared_by_verifys_rule_naming_shape_and_non_finite_values():
    comparer = _Comparer(2, Tolerance(1e-5, 1e-6))
    comparer.tensor(0, "param", "w", torch.tensor([1.0, float("inf"), float("nan")]),
                    torch.tensor([1.0, float("inf"), float("nan")]))     # inf and NaN where the reference has them
    assert not comparer.mismatches
    comparer.tensor(0, "grad", "w", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
    comparer.tensor(1, "grad", "w", torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]))
    comparer.tensor(1, "param", "w", torch.zeros(3), torch.zeros(2))
    comparer.tensor(None, "buffer", "b", None, torch.zeros(2))
    values, nonfinite, shape, missing = comparer.mismatches
    assert comparer.compared == 5
    assert values.describe() == ("step 0, rank 2: grad of 'w' shape (2,) differs from the reference: "
                                 "max abs err 0.5, max rel err 0.2 (tolerance atol=1e-06, rtol=1e-05)")
    assert "1 non-finite mismatch(es), first at index [1]: got nan, expected 2.0" in nonfinite.describe()
    assert shape.kind == "shape" and shape.describe().endswith("shape (3,) vs reference (2,)")
    assert missing.describe() == "after join, rank 2: buffer of 'b' differs from the reference: it is None on DDP only"


def test_result_passes_only_when_the_outcome_matches_the_expectation():
    found = (_mismatch(0),)
    assert ModelResult(MSE_PLAN, (2,), (), 10).passed
    assert not ModelResult(MSE_PLAN, (2,), found, 10).passed
    differ = dataclasses.replace(MSE_PLAN, expect="differ")
    assert ModelResult(differ, (2,), found, 10).passed
    assert not ModelResult(differ, (2,), (), 10).passed
    assert not ModelResult(MSE_PLAN, (2,), (), 0).passed  # comparing nothing proves nothing
    with pytest.raises(AssertionError, match="expected DDP to differ"):
        assert_model_passed(ModelResult(differ, (2,), (), 10))


def test_simulated_backend_is_refused_with_a_pointer_to_the_process_backend(sv_backend):
    with pytest.raises(BackendError, match="process backend"):
        verify_model(sv_backend((2,), "simulated"), SUM_PLAN)


# ---- real DDP on gloo processes ------------------------------------------------------------

def _values_per_step(plan: ModelPlan) -> int:
    torch.manual_seed(0)
    model = build_model(plan.model)
    return 1 + 2 * len(list(model.parameters())) + len(list(model.buffers()))


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_correct_ddp_matches_and_every_value_is_compared(sv_backend, world):
    for plan in (SUM_PLAN, with_options(MSE_PLAN, accumulate=2)):
        result = verify_model(sv_backend((world,), "process"), plan)
        assert_model_passed(result)
        assert result.compared == _values_per_step(plan) * plan.steps * world


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_planted_sum_instead_of_average_is_caught_at_step_0_naming_each_parameter(sv_backend, world):
    result = verify_model(sv_backend((world,), "process"), with_options(MSE_PLAN, comm_hook="sum_without_average"))
    assert not result.passed
    first = result.mismatches[0]
    assert (first.when, first.phase) == ("step 0", "grad")
    grads = {(m.tensor, m.rank): m for m in result.mismatches if m.when == "step 0" and m.phase == "grad"}
    assert set(grads) == {(f"grad of {name!r}", rank) for name in ("0.weight", "0.bias", "2.weight", "2.bias")
                          for rank in range(world)}
    # every gradient is world times too large: relative error world - 1
    assert all(math.isclose(m.max_rel_err, world - 1, rel_tol=1e-4) for m in grads.values())
    with pytest.raises(AssertionError) as info:
        assert_model_passed(result)
    message = str(info.value)
    assert "DDP training differs from single-device training" in message
    assert "step 0, rank 0: grad of '0.bias'" in message and f"mesh ({world},)" in message


@pytest.mark.dist
def test_planted_unreduced_bucket_is_caught_with_parameter_and_step(sv_backend):
    plan = with_options(MSE_PLAN, comm_hook="skip_first_bucket", bucket_cap_mb=0.0001)
    result = verify_model(sv_backend((2,), "process"), plan)
    assert not result.passed
    first = result.mismatches[0]
    assert first.when == "step 0" and first.phase == "grad" and first.tensor in {
        f"grad of {name!r}" for name in ("0.weight", "0.bias", "2.weight", "2.bias")}
    with pytest.raises(AssertionError, match=rf"step 0, rank \d: {re.escape(first.tensor)}"):
        assert_model_passed(result)


@pytest.mark.dist
def test_a_plan_declared_to_differ_that_matches_fails(sv_backend):
    result = verify_model(sv_backend((2,), "process"), with_options(SUM_PLAN, expect="differ"))
    assert result.compared > 0 and not result.mismatches
    with pytest.raises(AssertionError, match="failed to detect"):
        assert_model_passed(result)


def test_cpu_sync_batchnorm_conversion_keeps_names_and_state_and_leaves_no_torch_syncbn():
    from shardverify.features.ddp.syncbn import CpuSyncBatchNorm, convert_sync_batchnorm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm2d(4)))
    model(torch.randn(4, 2, 5, 5))  # move the running statistics away from their initial values
    before = {name: value.clone() for name, value in model.state_dict().items()}
    converted = convert_sync_batchnorm(model, None, torch.device("cpu"))
    assert [type(m) for m in converted.modules()].count(CpuSyncBatchNorm) == 2
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in converted.modules())  # DDP refuses those on CPU
    after = converted.state_dict()
    assert list(after) == list(before)
    for name, value in before.items():
        torch.testing.assert_close(after[name], value)


CONV_BN = ModelPlan("conv_bn", ModelDecl(layers=(
    LayerDecl("torch.nn.Conv2d", (2, 3, 3)), LayerDecl("torch.nn.BatchNorm2d", (3,)),
    LayerDecl("torch.nn.Flatten"), LayerDecl("torch.nn.Linear", (27, 2)))),
    (8, 2, 5, 5), LossDecl("cross_entropy"), target_shape=(8,), classes=2, steps=2)


@pytest.mark.dist
def test_batchnorm_statistics_are_caught_as_buffer_and_loss_mismatches_unless_synced(sv_backend):
    backend = sv_backend((2,), "process")
    local = verify_model(backend, with_options(CONV_BN, expect="differ"))
    found = {(m.when, m.tensor) for m in local.mismatches}
    assert {("step 0", "loss"), ("step 0", "buffer of '1.running_mean'"),
            ("step 0", "buffer of '1.running_var'")} <= found
    assert ("step 0", "buffer of '1.num_batches_tracked'") not in found
    assert_model_passed(local)
    assert_model_passed(verify_model(backend, with_options(CONV_BN, sync_batchnorm=True)))
