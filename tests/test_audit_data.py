"""The audit decides on data a rank really holds: contiguous blocks of their own, one dtype per
output, and bool operands drawn so that a reduction is not saturated (the (2, 3)
findings of the no-argument audit)."""

from __future__ import annotations

from pathlib import Path

from shardverify.features.audit.decide import Operand, lone_value_draws, prepare
from shardverify.sharding.layout import Layout
from shardverify.features.audit.offered import offered_combination
from shardverify.features.audit.offered import own_arguments
from shardverify.features.audit.combinations import CaseCombinations, outputs_hold
from shardverify.spec.catalogue import load_op_specs
from shardverify.sharding.mesh import DeviceMesh
from shardverify.spec.case import InputDecl, OpCase

REPO = Path(__file__).resolve().parents[1]


def L(*dims) -> Layout:
    return Layout(tuple(tuple(d) for d in dims))


def _case(spec_name: str, case_id: str):
    spec = load_op_specs(REPO, None, [spec_name])[0]
    points = {cid: dict(cs.point) for cs, (cid, _) in zip(spec.cases(), spec.op_cases())}
    return spec, case_id, dict(spec.op_cases())[case_id], points[case_id]


def test_local_blocks_are_contiguous_tensors_of_their_own():
    case = OpCase(op="t", target="torch.transpose", inputs=(InputDecl("x", (4, 6)),), params=(("dim0", 0), ("dim1", 1)))
    problem = prepare(case, DeviceMesh((3,)), [Operand("x", "input", ("arg", 0), (4, 6), True)])
    full = problem.values[("arg", 0)].untyped_storage().data_ptr()
    for layout in (L((), (0,)), L((0,), ())):   # a strided view, a contiguous view of the same storage
        blocks = problem.local(0, layout)
        assert all(t.is_contiguous() and t.untyped_storage().data_ptr() != full for t in blocks)


def test_a_group_shard_of_native_group_norm_holds_on_its_own_contiguous_blocks():
    # native_group_norm refuses a strided input: with views of the full value the channel
    # shard (one group per rank) was reported incorrect although `verify` passes it
    spec, cid, case, _ = _case("native_group_norm", "torch.ops.aten.native_group_norm.default-N_4-C_6-HxW_6-group_3-eps_1e-05")
    audit = CaseCombinations(spec, case, (3,), partial_inputs=False)
    strategy = next(s for s in audit.strategies if s.name.startswith("RS0RR"))
    offered = offered_combination(strategy)
    combo = tuple(dict(offered.inputs)[o.name] for o in audit.operands)
    outputs = tuple(dict(offered.outputs)[name] for name in audit.output_names)
    own = own_arguments(strategy, audit.problem.shape_arg, audit.mesh)
    assert own[0] == {("kwarg", "C"): 2, ("kwarg", "group"): 1}
    assert outputs_hold(audit.problem, combo, outputs, arguments=own)


def test_ranks_whose_outputs_differ_in_dtype_form_no_layout():
    # 6 over 4 ranks leaves rank 3 an empty block, whose mask native_dropout returns as float
    spec, cid, case, _ = _case("native_dropout", "torch.ops.aten.native_dropout.default-p_0.5-train_False")
    audit = CaseCombinations(spec, case, (4,), partial_inputs=False)
    outcome = audit.decide((L((), (), (0,)),))
    assert not outcome.valid and "differ in dtype" in outcome.reason
    assert audit.decide((L((0,), (), ()),)).valid


def test_a_sharded_reduced_dim_of_a_bool_any_is_not_replicated():
    # half-true data makes any() of every block of 10 elements True: [S1, R, R] looked valid
    # with a replicated output on (2, 3); the lone-True draw tells it apart
    spec, cid, case, _ = _case("any_dims", "torch.ops.aten.any.dims-dim_0.2-keepdim_False")
    audit = CaseCombinations(spec, case, (2, 3), partial_inputs=False)
    assert len(lone_value_draws(audit.problem)[0]) == 2 and len(audit.problems) >= 3
    assert not audit.decide((L((1,), (), ()),)).valid
    assert audit.decide((L((), (1,), ()),)).outputs == (L((1,)),)
