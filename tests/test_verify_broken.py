"""The verifier catches wrong strategies: deliberately broken variants of the generated linear
and sum strategies (a dropped all-reduce, a wrong output layout, a wrong mesh axis, a skipped
gradient all-reduce) each fail, naming the strategy, the rank(s) and the tensor.

The mutations are applied to every generated strategy they fit, so the tests stay correct
whatever the generators produce; the same helpers run on 4 gloo processes in
test_verify_process.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from shardverify import DeviceMesh
from shardverify.strategies.for_node import strategies_for_node
from shardverify.backends import SimulatedBackend
from shardverify.strategies.generators.common import memory_cost, with_declared_costs
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.sharding.strategy import CommAction, CommPattern, CommWhere, ShardingStrategy
from shardverify.spec.case import InputDecl, ModuleDecl, OpCase
from shardverify.verify.engine import verify_case
from shardverify.verify.report import CheckResult, assert_passed

INPUT = (InputDecl("input", (4, 4, 4, 16)),)
LINEAR = OpCase(op="linear", target="torch.nn.Linear", inputs=INPUT,
                module=ModuleDecl("torch.nn.Linear", (16, 32), (("bias", True),)))
SUM = OpCase(op="sum", target="torch.sum", inputs=INPUT, params=(("dim", (0, 2)), ("keepdim", False)),
             predecessor=ModuleDecl("torch.nn.Linear", (16, 32), (("bias", False),)))
MESHES = [pytest.param((2, 2), id="mesh2x2"), pytest.param((4,), id="mesh4")]


def generated(case: OpCase, mesh: DeviceMesh) -> list[ShardingStrategy]:
    graph_module, node_name = case.build()
    return list(strategies_for_node(graph_module, node_name, mesh))


def ranks_failing(result: CheckResult, tensor: str, kinds=("values", "shape")) -> set[int]:
    return {m.rank for m in result.mismatches if m.tensor == tensor and m.kind in kinds}


def with_layout(strategy: ShardingStrategy, name: str, operand: str, spec: ShardingSpec) -> ShardingStrategy:
    """``strategy`` with one operand's layout replaced and its memory cost recomputed, so
    the only thing wrong is what the test means to be wrong."""
    specs = dict(strategy.sharding_specs)
    specs[operand] = spec
    return strategy.replace(name=name, sharding_specs=tuple(specs.items()),
                            memory_cost=memory_cost(strategy.operands, specs))


# ------------------------------------------------------------------- broken variants

def drop_required_all_reduces(strategies):
    """(broken strategy, tensor that must go wrong) for every non-hook all-reduce."""
    for s in strategies:
        for i, a in enumerate(s.communication_actions):
            if a.where is CommWhere.HOOK or a.pattern not in (CommPattern.ALLREDUCE_FWD_IDENTITY_BWD,
                                                             CommPattern.IDENTITY_FWD_ALLREDUCE_BWD):
                continue
            broken = s.replace(name=f"{s.name} [no all-reduce of {a.operand}]",
                               communication_actions=s.communication_actions[:i] + s.communication_actions[i + 1:])
            yield broken, "output" if a.where is CommWhere.AFTER else f"grad of {a.operand}"


def skip_gradient_hooks(strategies):
    for s in strategies:
        for i, a in enumerate(s.communication_actions):
            if a.where is CommWhere.HOOK:
                broken = s.replace(name=f"{s.name} [no grad all-reduce of {a.operand}]",
                                   communication_actions=s.communication_actions[:i] + s.communication_actions[i + 1:])
                yield broken, f"grad of {a.operand}"


def wrong_mesh_axis(strategies):
    """Every single-axis action moved to the other axis of a 2-D mesh."""
    for s in strategies:
        for i, a in enumerate(s.communication_actions):
            if len(a.axes) == 1:
                moved = dataclasses.replace(a, axes=(1 - a.axes[0],))
                actions = s.communication_actions[:i] + (moved,) + s.communication_actions[i + 1:]
                target = "output" if a.where is CommWhere.AFTER else f"grad of {a.operand}"
                yield s.replace(name=f"{s.name} [{a.operand} on axis {moved.axes}]", communication_actions=actions), target


def wrong_output_layout(strategies, mesh: DeviceMesh):
    """The output claimed in another layout: mesh axes swapped on a 2-D mesh, the shard moved
    to another dim on a 1-D mesh. Yields (broken, ranks whose output slice changes)."""
    for s in strategies:
        name, spec = s.sharding_specs[-1]
        if not spec.dim_partition:
            continue
        if mesh.ndim == 2:
            claimed = {d: tuple(1 - a for a in axes) for d, axes in spec.dim_partition}
        else:
            (dim, axes), = spec.dim_partition
            free = [d for d in range(len(spec.tensor_shape)) if d != dim and spec.tensor_shape[d] % mesh.size == 0]
            if not free:
                continue
            claimed = {free[0]: axes}
        wrong = ShardingSpec.from_partition(mesh.shape, spec.tensor_shape, claimed)
        if wrong == spec:
            continue
        moved = {r for r in mesh.ranks if wrong.local_slices(mesh, r) != spec.local_slices(mesh, r)}
        yield with_layout(s, f"{s.name} [output claimed {wrong}]", name, wrong), moved


def partial_sum(sum_strategy: ShardingStrategy, mesh: DeviceMesh) -> ShardingStrategy:
    """A correct hand-made sum strategy the generator does not produce: the summed dim 0 stays
    sharded over mesh axis 0 and the partial sums are all-reduced after the op."""
    (in_name, in_spec), (out_name, out_spec) = sum_strategy.sharding_specs
    specs = {in_name: ShardingSpec.from_partition(mesh.shape, in_spec.tensor_shape, {0: (0,)}),
             out_name: ShardingSpec.from_partition(mesh.shape, out_spec.tensor_shape, {})}
    return with_declared_costs(sum_strategy.replace(
        name="partial sum over axis 0", sharding_specs=tuple(specs.items()),
        communication_actions=(CommAction(CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, (0,), out_name, CommWhere.AFTER),)),
        *SUM.build(), mesh)


# ----------------------------------------------------------------------------- checks

def check_caught(backend, case: OpCase, variants) -> int:
    """Verify (broken, tensor) pairs: each fails on every rank, for that tensor, by name."""
    variants = list(variants)
    results = verify_case(backend, case, [broken for broken, _ in variants])
    everyone = set(backend.mesh.ranks)
    for (broken, tensor), result in zip(variants, results):
        assert not result.passed, f"{broken.name} was not caught"
        assert result.strategy == broken.name and broken.name in result.report()
        assert ranks_failing(result, tensor) == everyone, result.report()
        if all(m.kind == "values" for m in result.mismatches):   # a real bug survives the float64 re-check
            assert "float64 re-check fails too" in result.note
        for rank in everyone:
            assert f"rank {rank}: {tensor}" in result.report()
    return len(variants)


def check_layout_caught(backend, case: OpCase, strategies) -> int:
    variants = list(wrong_output_layout(strategies, backend.mesh))
    results = verify_case(backend, case, [broken for broken, _ in variants])
    for (broken, moved), result in zip(variants, results):
        assert not result.passed and result.strategy == broken.name
        assert ranks_failing(result, "output") == moved, result.report()
    return len(variants)


def check_partial_sum(backend) -> None:
    base = generated(SUM, backend.mesh)[0]
    good = partial_sum(base, backend.mesh)
    assert_passed(verify_case(backend, SUM, [good]))
    (out_name, _), = good.sharding_specs[1:]
    variants = list(drop_required_all_reduces([good]))
    if backend.mesh.ndim == 2:
        variants += list(wrong_mesh_axis([good]))
    assert check_caught(backend, SUM, variants) == backend.mesh.ndim


@pytest.fixture(scope="module", params=MESHES)
def backend(request):
    with SimulatedBackend(DeviceMesh(request.param), timeout=30) as simulated:
        yield simulated


def test_linear_dropped_all_reduce_is_caught(backend):
    assert check_caught(backend, LINEAR, drop_required_all_reduces(generated(LINEAR, backend.mesh))) > 0


def test_linear_skipped_gradient_all_reduce_is_caught(backend):
    assert check_caught(backend, LINEAR, skip_gradient_hooks(generated(LINEAR, backend.mesh))) > 0


@pytest.mark.parametrize("backend", [(2, 2)], indirect=True, ids=["mesh2x2"])  # 1-D: no other axis
def test_linear_wrong_mesh_axis_is_caught(backend):
    assert check_caught(backend, LINEAR, wrong_mesh_axis(generated(LINEAR, backend.mesh))) > 0


def test_linear_wrong_output_layout_is_caught(backend):
    assert check_layout_caught(backend, LINEAR, generated(LINEAR, backend.mesh)) > 0


def test_sum_wrong_output_layout_is_caught(backend):
    assert check_layout_caught(backend, SUM, generated(SUM, backend.mesh)) > 0


def test_sum_partial_strategy_passes_and_its_broken_variants_fail(backend):
    check_partial_sum(backend)
