"""The completeness audit: layout enumeration, the numerical decision, what offered strategies
cover, accepted gaps, and the CLI failing on a planted generator that omits row-parallel Linear."""

from __future__ import annotations

import json
import pickle
import re
import textwrap
from pathlib import Path

import pytest

from shardverify.spec.accept import glob_matches
from shardverify.features.audit.decide import Operand, prepare
from shardverify.features.audit.layouts import axis_symmetries, tensor_layouts
from shardverify.sharding.layout import Layout
from shardverify.features.audit.offered import offered_combination
from shardverify.cli.main import main
from shardverify.errors import SpecError
from shardverify.strategies.generators.registry import get_generator, register_generator
from shardverify.strategies.rules.sources import parse_rule
from shardverify.sharding.mesh import DeviceMesh
from shardverify.spec.case import InputDecl, ModuleDecl, OpCase

REPO = Path(__file__).resolve().parents[1]
LINEAR = (REPO / "specs" / "linear.yaml").read_text()


def L(*dims, partial=(), reduce="sum", absent=False) -> Layout:
    return Layout(tuple(tuple(d) for d in dims), tuple(partial), reduce, absent)


# ------------------------------------------------------------------ layouts

def test_layouts_of_a_matrix_on_a_1d_mesh():
    found = {str(layout) for layout in tensor_layouts((4, 6), (2,))}
    assert found == {"[R, R]", "[S0, R]", "[R, S0]", "[R, R] P(sum:0)", "[R, R] P(max:0)", "[R, R] P(min:0)"}
    assert {str(layout) for layout in tensor_layouts((4, 6), (2,), partial=("sum",))} == \
        {"[R, R]", "[S0, R]", "[R, S0]", "[R, R] P(sum:0)"}


def test_layouts_include_uneven_blocks_and_every_order_of_axes_but_never_split_one_element():
    found = {str(layout) for layout in tensor_layouts((4, 3), (2, 2), partial=())}
    assert "[S01, R]" in found and "[S10, R]" in found
    assert "[R, S0]" in found and "[R, S10]" in found and "[S0, S1]" in found   # 3 cut 2 + 1
    found = {str(layout) for layout in tensor_layouts((4, 1), (2, 2), partial=())}
    assert not any(text.endswith("S0]") or text.endswith("S1]") for text in found)


def test_symmetries_swap_only_equal_axes():
    assert axis_symmetries((2, 2)) == [(0, 1), (1, 0)]
    assert axis_symmetries((2, 4)) == [(0, 1)]
    assert L((0, 1), ()).permuted((1, 0)) == L((1, 0), ())


def test_a_layout_remembers_its_hash_but_hashes_anew_where_it_is_unpickled():
    layout = L((0,), (), partial=(1,), reduce="max")
    remembered = hash(layout)
    assert layout.__dict__["_hash"] == remembered
    copy = pickle.loads(pickle.dumps(layout))
    assert "_hash" not in copy.__dict__ and copy == layout and hash(copy) == remembered


# ------------------------------------------------------------------ the numerical decision

def _mm_problem(mesh_shape, bias=False):
    inputs = (InputDecl("x", (8, 12)), InputDecl("w", (16, 12))) + ((InputDecl("b", (16,)),) if bias else ())
    case = OpCase(op="linear", target="torch.nn.functional.linear", inputs=inputs)
    operands = [Operand("x", "input", ("arg", 0), (8, 12), True), Operand("w", "other", ("arg", 1), (16, 12), True)]
    if bias:
        operands.append(Operand("b", "bias", ("arg", 2), (16,), True, optional=True))
    return prepare(case, DeviceMesh(mesh_shape), operands)


def test_contraction_sharded_linear_gives_a_partial_sum():
    problem = _mm_problem((2, 2))
    outcome = problem.decide((L((), (0,)), L((), (0,))))
    assert outcome.outputs == (L((), (), partial=(0,)),)


def test_mismatched_shards_are_invalid_with_a_reason():
    problem = _mm_problem((2,))
    outcome = problem.decide((L((), (0,)), L((), ())))
    assert not outcome.valid and "local op fails" in outcome.reason
    outcome = problem.decide((L((0,), ()), L((0,), ())))  # shapes fit, values do not
    assert not outcome.valid and "matches no" in outcome.reason


def test_sharded_and_multi_axis_outputs_are_detected():
    problem = _mm_problem((2, 2))
    assert problem.decide((L((1, 0), ()), L((), ()))).outputs == (L((1, 0), ()),)
    assert problem.decide((L((0,), ()), L((1,), ()))).outputs == (L((0,), (1,)),)


def test_partial_inputs_sum_to_a_partial_output():
    problem = _mm_problem((2, 2))
    outcome = problem.decide((L((), (), partial=(1,)), L((0,), ())))
    assert outcome.outputs == (L((), (0,), partial=(1,)),)


def test_an_absent_bias_is_judged_against_the_output_without_it():
    problem = _mm_problem((2,), bias=True)
    row_parallel = (L((), (0,)), L((), (0,)))
    assert problem.decide(row_parallel + (L(()),)).valid is False        # bias added on every rank
    assert problem.decide(row_parallel + (L((), absent=True),)).outputs == (L((), (), partial=(0,)),)


def test_max_over_a_sharded_dim_is_a_partial_max():
    case = OpCase(op="amax", target="torch.amax", inputs=(InputDecl("x", (8, 6)),), params=(("dim", 0),))
    problem = prepare(case, DeviceMesh((2,)), [Operand("x", "input", ("arg", 0), (8, 6), True)])
    assert problem.decide((L((0,), ()),)).outputs == (L((), partial=(0,), reduce="max"),)


@pytest.mark.parametrize("combo, layout", [
    ((L((0,), ()), L((1,), ())), L((0,), (1,))),                                # sharded
    ((L((), (), partial=(1,)), L((0,), ())), L((), (0,), partial=(1,))),         # a partial sum
])
def test_the_last_element_rules_a_layout_out_only_where_the_comparison_does(combo, layout):
    """detect's shortcut (each block's last element beyond twice the tolerance) never rejects a
    layout the full comparison accepts: the last element of rank 0's output moved by a fraction
    of the tolerance still holds, moved past it or to NaN or inf it does not, with or without."""
    problem = _mm_problem((2, 2))
    tensors = [out[0] for out in problem.run(combo)]
    ref = problem.outputs[0]
    block = ref[problem.slices(layout, ref.shape, 0)]
    tol = problem._tols[0]
    bound = tol.atol + tol.rtol * float(block[-1, -1].abs())
    for moved, holds in ((0.0, True), (0.9 * bound, True), (1.5 * bound, False), (3 * bound, False),
                         (float("nan"), False), (float("inf"), False)):
        ranks = [t.clone() for t in tensors]
        ranks[0][-1, -1] = moved if moved != moved or moved == float("inf") else ranks[0][-1, -1] + moved
        lasts = [float(t[-1, -1]) for t in ranks]
        assert problem.holds(ranks, layout, 0, ref) is holds, moved
        assert problem.holds(ranks, layout, 0, ref, lasts) is holds, moved


def test_the_audit_leaves_the_reference_module_as_it_was():
    """A module op is run on the audit's own copy of its module, each rank's blocks swapped in:
    the reference's module, which verification reads too, keeps its own parameters."""
    import torch

    from shardverify.capture.call import called_module
    from shardverify.verify.reference import reference

    case = OpCase(op="linear", target="torch.nn.Linear", inputs=(InputDecl("x", (4, 16)),),
                  module=ModuleDecl("torch.nn.Linear", args=(16, 32), kwargs=(("bias", True),)))
    ref = reference(case, torch.float64, torch.device("cpu"))
    module = called_module(ref.graph_module, ref.node)
    weight, bias = module.weight, module.bias
    before = weight.detach().clone()
    operands = [Operand("x", "input", ("arg", 0), (4, 16), True),
                Operand("weight", "weight", ("param", "weight"), (32, 16), True),
                Operand("bias", "bias", ("param", "bias"), (32,), True)]
    problem = prepare(case, DeviceMesh((2,)), operands)
    assert problem.module is not module
    assert problem.decide((L((), ()), L((0,), ()), L((0,),))).outputs == (L((), (0,)),)
    assert module.weight is weight and module.bias is bias and torch.equal(module.weight.detach(), before)


# ------------------------------------------------------------------ offered strategies

def _linear_strategies(mesh_shape, bias):
    from shardverify.strategies.for_node import strategies_for_node

    case = OpCase(op="linear", target="torch.nn.Linear", inputs=(InputDecl("x", (4, 16)),),
                  module=ModuleDecl("torch.nn.Linear", args=(16, 32), kwargs=(("bias", bias),)))
    graph_module, node = case.build()
    return strategies_for_node(graph_module, node, DeviceMesh(mesh_shape))


def test_an_after_all_reduce_is_a_partial_raw_output():
    strategy = next(s for s in _linear_strategies((2,), False) if s.name.startswith("RR = RS0 x S0R"))
    offered = offered_combination(strategy)
    assert dict(offered.inputs)["x"] == L((), (0,))
    assert offered.outputs[0][1] == L((), (), partial=(0,))


def test_a_before_gather_changes_the_layout_the_op_sees():
    from shardverify.sharding.strategy import CommAction, CommPattern, CommWhere

    strategy = next(s for s in _linear_strategies((2,), False) if s.name.startswith("S0R = S0R x RR"))
    gather = CommAction(CommPattern.GATHER_FWD_SPLIT_BWD, (0,), "x", CommWhere.BEFORE, dims=(0,))
    offered = offered_combination(strategy.replace(communication_actions=(gather,)))
    assert dict(offered.inputs)["x"] == L((), ())
    bad = CommAction(CommPattern.GATHER_FWD_SPLIT_BWD, (0,), "x", CommWhere.BEFORE, dims=(1,))
    assert "do not end" in offered_combination(strategy.replace(communication_actions=(bad,))).problem


# ------------------------------------------------------------------ accepted gaps

def test_globs_have_only_a_star():
    assert glob_matches("[S0, *]", "[S0, R, R]")
    assert not glob_matches("[S0, *]", "[S1, R]")
    assert glob_matches("* P(*", "[R] P(sum:0)")


def _write(tmp_path: Path, text: str, name: str = "linear.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_accept_entries_name_file_and_line_on_mistakes(tmp_path):
    from shardverify.spec.catalogue import load_op_specs

    base = LINEAR.split("\naudit:")[0]
    bad_role = base + "\naudit:\n  accept:\n    - reason: r\n      match: {weight: \"*\"}\n"
    _write(tmp_path, bad_role)
    with pytest.raises(SpecError) as info:
        load_op_specs(tmp_path, tmp_path, [])
    text = str(info.value)
    assert "linear.yaml" in text and "'weight' is not an operand role" in text
    line = base.count("\n") + 5
    assert f":{line}" in text
    no_reason = base + "\naudit:\n  accept:\n    - reason: ' '\n      match: {input: \"*\"}\n"
    _write(tmp_path, no_reason)
    with pytest.raises(SpecError, match="needs a reason"):
        load_op_specs(tmp_path, tmp_path, [])
    bad_where = base + "\naudit:\n  accept:\n    - reason: r\n      match: {input: \"*\"}\n      where: {dim: 1}\n"
    _write(tmp_path, bad_where)
    with pytest.raises(SpecError, match="not a grid key"):
        load_op_specs(tmp_path, tmp_path, [])


# ------------------------------------------------------------------ the CLI on a planted gap

@register_generator("audit_test_no_row_parallel", parse=parse_rule)   # the rules options
def _no_row_parallel(ctx):
    """The linear spec's rules without the strategies that shard the contraction dim K."""
    strategies = get_generator("rules")(ctx)
    return [s for s in strategies if not s.get_sharding_spec_by_name(ctx.operand("input").name).partition_dict()
            .get(len(ctx.operand("input").shape) - 1)]


def _audit_json(spec_dir: Path, mesh: str, capsys) -> tuple[int, dict]:
    code = main(["audit", str(spec_dir / "linear.yaml"), "--root", str(spec_dir), "--specs-dir", str(spec_dir),
                 "--mesh", mesh, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _without_bias(text: str) -> str:
    text = re.sub(r"    - mesh: \[2, 2\][^\n]*\n      where:\n        bias: true\n      count: 131\n", "", text)
    return text.replace("bias: [false, true]", "bias: [false]").replace(
        textwrap.dedent("""\
            - mesh: [2, 2]
              where:
                bias: false
              count: 69"""), "")


def test_linear_offers_every_valid_combination_with_nothing_accepted(tmp_path, capsys):
    _write(tmp_path, _without_bias(LINEAR))
    code, report = _audit_json(tmp_path, "2,2", capsys)
    assert code == 0, [f["line"] for row in report["rows"] for f in row["missing"] + row["incorrect"]]
    assert all(row["valid"] == row["offered"] > 0 and not row["accepted"] for row in report["rows"])


def test_a_rule_omitting_row_parallel_linear_is_reported_missing(tmp_path, capsys):
    planted = _without_bias(LINEAR).replace("family: rules", "family: audit_test_no_row_parallel")
    _write(tmp_path, planted)
    code, report = _audit_json(tmp_path, "2,2", capsys)
    assert code == 1
    missing = [f["line"] for row in report["rows"] for f in row["missing"]]
    assert "input=[R, R, R, S0] other=[R, S0] -> output=[R, R, R, R] P(sum:0)" in missing
    assert all(re.search(r", S(0|1|01|10)\]", f["layouts"]["input"]) for row in report["rows"]
               for f in row["missing"])


@register_generator("audit_test_forgets_the_all_reduce", parse=parse_rule)   # the rules options
def _forgets_the_all_reduce(ctx):
    """The linear spec's rules whose row-parallel strategies lose their AFTER all-reduce."""
    from shardverify.sharding.strategy import CommWhere

    return [s.replace(communication_actions=tuple(a for a in s.communication_actions if a.where is not CommWhere.AFTER))
            for s in get_generator("rules")(ctx)]


def test_an_offered_strategy_with_a_wrong_output_layout_is_incorrect(tmp_path, capsys):
    planted = _without_bias(LINEAR).replace("family: rules", "family: audit_test_forgets_the_all_reduce")
    _write(tmp_path, planted)
    code, report = _audit_json(tmp_path, "4", capsys)
    assert code == 1
    incorrect = [f for row in report["rows"] for f in row["incorrect"]]
    assert {f["strategy"] for f in incorrect} == {"RR = RS0 x S0R", "RR = RR+P0 x RR", "RR = RR x RR+P0"}
    assert all("the op gives [R, R, R, R] P(sum:0)" in f["line"] for f in incorrect)


def test_dtensor_agrees_on_linear_and_leaves_no_process_group_behind():
    import torch.distributed as dist

    from shardverify.features.dtensor.propagation import compare_case
    from shardverify.spec.catalogue import load_op_specs

    spec = load_op_specs(REPO, None, ["linear"])[0]
    case_id, case = next((cid, c) for cid, c in spec.op_cases() if cid == "torch.nn.functional.linear-bias_False")
    report = compare_case(spec, case_id, case, (4,))
    assert report.disagreements == [] and report.counts["agree: same output"] >= 4
    assert report.counts["agree: invalid"] > 0
    assert not dist.is_initialized()


def test_dtensor_gets_integer_operands_as_integers():
    """embedding's indices stay int64 in DTensor (a float cast once made DTensor refuse every
    combination, each reported as a DTensor error on a valid one)."""
    from shardverify.features.dtensor.propagation import compare_case
    from shardverify.spec.catalogue import load_op_specs

    spec = load_op_specs(REPO, None, ["embedding"])[0]
    case_id, case = spec.op_cases()[0]
    report = compare_case(spec, case_id, case, (4,))
    assert not [d for d in report.disagreements if d.kind == "dtensor-error"], report.disagreements
    assert report.counts["agree: same output"] >= 2   # [R, R] and [S0, R] indices with a replicated table


def test_a_strided_dtensor_output_is_counted_apart_from_errors():
    """flatten of a tensor sharded on an inner merged dim: DTensor answers with a _StridedShard
    (interleaved slices), which is no block layout of the audit's: neither an error of
    DTensor's nor a disagreement while the audit finds no block output either."""
    from shardverify.features.dtensor.propagation import STRIDED, compare_case
    from shardverify.spec.catalogue import load_op_specs

    spec = load_op_specs(REPO, None, ["flatten"])[0]
    case_id, case = spec.op_cases()[0]
    report = compare_case(spec, case_id, case, (4,))
    assert report.counts[STRIDED] >= 1 and report.counts["DTensor error"] == 0, report.counts
    assert report.disagreements == []


@register_generator("audit_test_no_post_add", parse=parse_rule)   # the rules options
def _without_post_add(ctx):
    """The linear spec's rules without any post-added strategy (whether or not it offers them)."""
    return [s for s in get_generator("rules")(ctx) if not s.post_add]


def test_post_added_bias_covers_row_parallel_linear_with_bias(tmp_path, capsys):
    """The rules engine offers every partial-output family of linear with the bias post-added
    (what row-parallel Linear with bias needs); without those strategies the audit finds them missing."""
    _write(tmp_path, LINEAR)
    code, report = _audit_json(tmp_path, "4", capsys)
    assert code == 0, [f["line"] for row in report["rows"] for f in row["missing"] + row["incorrect"]]
    with_bias = [row for row in report["rows"] if row["case"].endswith("bias_True")]
    assert with_bias and all(row["covered"] == row["valid"] - len(row["accepted"]) for row in with_bias)
    without_accepts = LINEAR.split("\naudit:")[0]
    _write(tmp_path, without_accepts.replace("family: rules", "family: audit_test_no_post_add"))
    code, report = _audit_json(tmp_path, "4", capsys)
    assert code == 1
    missing = {f["line"] for row in report["rows"] for f in row["missing"]}
    assert "input=[R, R, R, S0] other=[R, S0] bias=absent (post-added) -> output=[R, R, R, R] P(sum:0)" in missing


# ------------------------------------------------------------------ absent operands, family gaps

def test_a_kernel_that_takes_an_undersized_operand_is_refused_by_its_meta_kernel():
    """On the CPU, ``_native_batch_norm_legit.no_stats`` takes a bias of 3 for 6 channels and reads
    past it, so an absent bias sharded in two gave outputs of whatever memory followed: a valid
    combination in some runs, not in others. Its meta kernel refuses those shapes, and so does the
    audit, every time, saying so; a bias of the full 6 channels is still decided by its values."""
    case = OpCase(op="bn", target="torch.ops.aten._native_batch_norm_legit.no_stats",
                  inputs=(InputDecl("x", (4, 6, 3, 3)), InputDecl("w", (6,)), InputDecl("b", (6,))),
                  params=(("training", True), ("momentum", 0.1), ("eps", 1e-5)))
    operands = [Operand("x", "input", ("arg", 0), (4, 6, 3, 3), True),
                Operand("w", "weight", ("arg", 1), (6,), True, optional=True),
                Operand("b", "bias", ("arg", 2), (6,), True, optional=True)]
    problem = prepare(case, DeviceMesh((2,)), operands)
    whole = (L((), (), (), ()), L(()))
    for _ in range(3):
        outcome = problem.decide(whole + (L((0,), absent=True),))
        assert not outcome.valid and "meta kernel refuses these local shapes" in outcome.reason, outcome
    assert problem.decide(whole + (L((), absent=True),)).outputs[0] == L((), (), (), ())


def _op_spec(name: str):
    from shardverify.spec.catalogue import load_op_specs

    return load_op_specs(REPO, None, [name])[0]


def _audit(name: str, case_id: str, mesh_shape):
    from shardverify.features.audit.run import audit_case

    spec = _op_spec(name)
    point = {cid: dict(cs.point) for cs, (cid, _) in zip(spec.cases(), spec.op_cases())}
    case = dict(spec.op_cases())[case_id]
    return audit_case(spec, case_id, case, tuple(mesh_shape), point[case_id])


def test_a_bias_is_post_addable_and_a_factor_is_not():
    problem = _mm_problem((2,), bias=True)
    assert problem.post_addable(2)            # F.linear(x, w, 0) + b == F.linear(x, w, b)
    case = OpCase(op="mul", target="torch.mul", inputs=(InputDecl("x", (4, 6)), InputDecl("y", (4, 6))))
    operands = [Operand("x", "input", ("arg", 0), (4, 6), True), Operand("y", "other", ("arg", 1), (4, 6), True, True)]
    assert not prepare(case, DeviceMesh((2,)), operands).post_addable(1)   # x * 0 + y != x * y


def test_mul_never_leaves_its_other_factor_out():
    """With the factor given as zeros every layout "forms" the zero output: such combinations
    are no strategy at all, and the audit must not call them missing."""
    result = _audit("mul", "torch.mul-other_True", (4,))
    lines = [f.line for f in result.missing + result.accepted]
    # every valid combination is offered (partial sums included) but the partial max/min ones the
    # data's signs may allow (accepted in the spec), none with the factor absent
    assert result.valid and result.covered + len(result.accepted) == result.valid
    assert not any("absent" in line for line in lines)
    assert all("P(max:" in f.line or "P(min:" in f.line for f in result.accepted)


def test_a_post_added_input_that_is_not_optional_is_audited():
    """addmm's bias `input` is a plain input that the rules post-add: its row-parallel
    strategies (input absent) are correct, not 'incorrect'."""
    result = _audit("addmm", "torch.addmm", (2, 2))
    assert result.incorrect == [] and result.missing == [] and result.covered == result.offered == 39


def test_a_module_target_reads_its_parameters_like_the_verifier():
    """nn.Softmax(dim=-1) keeps only its dim whole: the audit sees the same strategies as verify."""
    result = _audit("softmax", "torch.nn.Softmax-dim_-1", (4,))
    assert result.offered == 3 and result.missing == [] and result.covered == 3


def test_the_rules_family_declares_no_gap_and_a_family_gap_becomes_an_accept_entry():
    """Partial inputs (linear_in) and both shard orders are offered, so the rules family accepts
    nothing on behalf of its specs: relu covers every valid combination."""
    from shardverify.spec.accept import family_gaps
    from shardverify.strategies.generators import registry

    assert family_gaps("rules") == ()
    result = _audit("relu", "torch.relu", (2, 2))
    assert result.missing == [] and result.accepted == [] and result.covered == result.valid > 0
    gap = registry.KnownGap(reason="planted", match=(("any_input", ("*S10*",)),))
    registry.register_generator("planted_family", known_gaps=(gap,))(lambda ctx: [])
    try:
        (entry,) = family_gaps("planted_family")
        assert entry.reason == "planted" and entry.applies((2, 2), {}, {"input": "[S10, R]"}, "[S10, R]")
    finally:
        registry._GAPS.pop("planted_family", None)
        registry._GENERATORS.pop("planted_family", None)


def _relu_keeping_its_batch_dim_whole(tmp_path: Path) -> Path:
    text = (REPO / "specs" / "relu.yaml").read_text()
    assert "pointwise: true" in text
    planted = re.sub(r"generator:.*?\nverify:", "generator:\n  family: rules\n  options:\n"
                     "    einsum: \"a b c -> a b c\"\n    whole: [a]\n    monotone_in: [input]\nverify:", text, flags=re.S)
    (tmp_path / "relu.yaml").write_text(planted)
    return tmp_path / "relu.yaml"


def test_a_rules_spec_that_keeps_a_shardable_dim_whole_fails_its_audit(tmp_path, capsys):
    """The family's gap covers only reversed axis orders: a spec that stops
    offering a valid plain layout (softmax keeping its batch dim whole too) is reported missing."""
    spec = _relu_keeping_its_batch_dim_whole(tmp_path)
    code = main(["audit", str(spec), "--root", str(tmp_path), "--specs-dir", str(tmp_path), "--mesh", "4", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    missing = {f["layouts"]["input"] for row in report["rows"] for f in row["missing"]}
    assert "[S0, R, R]" in missing and all(layout.startswith("[S") for layout in missing)


def test_the_audit_report_starts_with_the_verdict_and_lists_every_failing_case(tmp_path, capsys):
    """FAIL with the counts, the first missing combination, then each failing case; the table and
    every finding behind -v; a passing audit is its verdict alone."""
    spec = _relu_keeping_its_batch_dim_whole(tmp_path)
    argv = ["audit", str(spec), "--root", str(tmp_path), "--specs-dir", str(tmp_path), "--mesh", "4"]
    assert main([*argv, "--json"]) == 1
    failing = [row for row in json.loads(capsys.readouterr().out)["rows"] if row["missing"]]
    assert main(argv) == 1
    lines = capsys.readouterr().out.splitlines()
    missing = sum(len(row["missing"]) for row in failing)
    assert lines[0].startswith("FAIL  ") and f": {missing} valid but not offered, 0 offered but invalid, " in lines[0]
    assert lines[1] == f"first failure: relu {failing[0]['case']} on mesh (4,): a valid combination no strategy offers"
    assert lines[2] == f"  {failing[0]['missing'][0]['line']}"
    assert lines[3] == f"failing: {len(failing)} cases (every finding: -v or --json)"
    assert [line.split(" on mesh")[0] for line in lines[4:]] == [f"  relu {row['case']}" for row in failing]
    assert main([*argv, "-v"]) == 1
    verbose = capsys.readouterr().out.splitlines()
    assert verbose[1:3] == lines[1:3] and verbose[3] == "" and verbose[4].split()[:4] == ["op", "case", "mesh", "combos"]
    assert sum(line.endswith(" 1 missing") for line in verbose) == len(failing)
    assert main(["audit", "relu", "--root", str(REPO), "--mesh", "4"]) == 0
    passed = capsys.readouterr().out.splitlines()
    assert len(passed) == 1 and passed[0].startswith("PASS  ") and ": 0 valid but not offered, 0 offered but " in passed[0]


def test_a_view_told_its_shape_is_judged_with_the_local_shape_of_the_layout_asked_about():
    from shardverify.features.audit.combinations import CaseCombinations, outputs_hold
    from shardverify.spec.loader import load_yaml_text
    from shardverify.spec.op import parse_op_spec

    root = Path(__file__).resolve().parents[1]
    spec = parse_op_spec(load_yaml_text((root / "specs/reshape.yaml").read_text(), "specs/reshape.yaml"))
    case = dict(spec.op_cases())["torch.reshape-shape_32.16"]
    audit = CaseCombinations(spec, case, (4,), partial_inputs=False)
    assert audit.problem.shape_arg is not None
    rows = Layout(((0,), (), ()))                    # input [S0, R, R]
    assert outputs_hold(audit.problem, (rows,), (Layout(((0,), ())),))          # -> [S0, R]
    assert not outputs_hold(audit.problem, (rows,), (Layout(((), (0,))),))      # not [R, S0]


def test_an_unflatten_is_judged_with_the_local_sizes_of_its_split_dim():
    """unflatten's sizes are a run of the output shape (dims 2 and 3 when the last of three
    dims splits): the audit passes that run of each candidate's local shape."""
    from shardverify.features.audit.combinations import CaseCombinations, outputs_hold
    from shardverify.spec.loader import load_yaml_text
    from shardverify.spec.op import parse_op_spec

    root = Path(__file__).resolve().parents[1]
    spec = parse_op_spec(load_yaml_text((root / "specs/unflatten.yaml").read_text(), "specs/unflatten.yaml"))
    case = dict(spec.op_cases())["torch.unflatten-dim_-1-sizes_4.4"]
    audit = CaseCombinations(spec, case, (4,), partial_inputs=False)
    assert audit.problem.shape_arg is not None and audit.problem.shape_arg[1] == slice(2, 4)
    last = Layout(((), (), (0,)))                                                   # input [R, R, S0]
    assert outputs_hold(audit.problem, (last,), (Layout(((), (), (0,), ())),))       # -> [R, R, S0, R]
    assert not outputs_hold(audit.problem, (last,), (Layout(((), (), (), (0,))),))   # not [R, R, R, S0]


def test_a_case_too_large_to_enumerate_is_bounded_and_said(monkeypatch):
    """baddbmm on (2,2,2) has 7.8 million combinations with partial inputs: the audit grew past
    7 GB. Over the limit it leaves the partial inputs out (an offered partial-input strategy is
    then decided on its own, so no verdict changes) and says so; still over, the case is decided
    on a stated sample (it was an error, and `shardverify audit` failed on the shipped specs)."""
    from shardverify.features.audit.run import audit_case
    from shardverify.spec.catalogue import load_op_specs

    (spec,) = load_op_specs(Path(__file__).resolve().parents[1], None, ["mul"])
    case_id, case = spec.op_cases()[0]
    full = audit_case(spec, case_id, case, (2, 2))
    assert not full.note and not full.error
    monkeypatch.setenv("SHARDVERIFY_MAX_AUDIT_COMBINATIONS", str(full.combinations - 1))
    sums = audit_case(spec, case_id, case, (2, 2))       # the partial max/min layouts go first
    assert "partial max/min layouts not enumerated" in sums.note and sums.combinations < full.combinations
    assert (len(sums.missing), len(sums.incorrect)) == (len(full.missing), len(full.incorrect))
    monkeypatch.setenv("SHARDVERIFY_MAX_AUDIT_COMBINATIONS", str(sums.combinations - 1))
    reduced = audit_case(spec, case_id, case, (2, 2))    # then the partial sums
    assert "partial-input layouts not enumerated" in reduced.note and reduced.combinations < sums.combinations
    assert (len(reduced.missing), len(reduced.incorrect)) == (len(full.missing), len(full.incorrect))
    monkeypatch.setenv("SHARDVERIFY_MAX_AUDIT_COMBINATIONS", "3")
    monkeypatch.setenv("SHARDVERIFY_AUDIT_SAMPLE", "7")
    from shardverify.features.audit.run import audit_spec

    (sampled, *_) = audit_spec(spec, [(2, 2)])
    assert not sampled.error and (sampled.sampled, sampled.combinations) == (7, 7)
    assert f"decided on a sample: 7 of {reduced.combinations} combinations (seed 0" in sampled.note
    assert "over the limit of 3" in sampled.note and "SHARDVERIFY_AUDIT_SAMPLE=N" in sampled.note
    assert sampled.offered == full.offered and len(sampled.incorrect) == len(full.incorrect)
    assert audit_spec(spec, [(2, 2)])[0].to_json()["missing"] == sampled.to_json()["missing"]   # the same sample


def test_a_sample_finds_an_absent_operand_unneeded_as_the_full_audit_does(monkeypatch):
    """addmm's bias may be absent (post-added): such a combination is needed only if no
    combination passing the bias in gives its output. A sample rarely holds that counterpart,
    so the audit decides it where needed, and reports nothing missing that the full run does not."""
    from shardverify.features.audit.run import audit_case
    from shardverify.spec.catalogue import load_op_specs

    (spec,) = load_op_specs(Path(__file__).resolve().parents[1], None, ["addmm"])
    case_id, case = spec.op_cases()[0]
    full = audit_case(spec, case_id, case, (2, 2), partial_inputs=False)
    monkeypatch.setenv("SHARDVERIFY_MAX_AUDIT_COMBINATIONS", str(full.combinations // 4))
    monkeypatch.setenv("SHARDVERIFY_AUDIT_SAMPLE", str(full.combinations // 8))
    sampled = audit_case(spec, case_id, case, (2, 2), partial_inputs=False)
    assert sampled.sampled and sampled.valid > 0 and not sampled.error
    assert {f.line for f in sampled.missing} <= {f.line for f in full.missing}


def test_an_audit_that_cannot_run_the_op_is_skipped_with_its_reason_said(tmp_path):
    """`audit: skip:` for a kernel that reads out of bounds on the mismatched local shapes the
    audit tries: no audit test is generated and every audited case carries the reason."""
    from shardverify.features.audit.run import audit_spec
    from shardverify.spec.catalogue import load_op_specs
    spec = load_op_specs(REPO, None, ["avg_pool2d_backward"])[0]
    assert "reads\nout of bounds" not in spec.audit_skip and "out of bounds" in spec.audit_skip
    rows = audit_spec(spec, [(4,)])
    assert rows and all(not r.failed and r.decided == 0 and r.note.startswith("not audited: the CPU kernel")
                        for r in rows)
    assert not (REPO / "generated_tests" / "test_avg_pool2d_backward_audit.py").exists()   # generate --check keeps it so
    base = LINEAR.split("\naudit:")[0]
    _write(tmp_path, base + "\naudit:\n  skip: ' '\n")
    with pytest.raises(SpecError, match="give a reason"):
        load_op_specs(tmp_path, tmp_path, [])
    _write(tmp_path, base + "\naudit:\n  skip: why\n  meshes: [[2, 2]]\n")
    with pytest.raises(SpecError, match="takes no 'accept' or 'meshes'"):
        load_op_specs(tmp_path, tmp_path, [])


# ------------------------------------------------------------------ the generated audit tests' reads
def test_generated_audits_read_the_spec_folder_once_and_a_bad_spec_fails_only_its_own(tmp_path, monkeypatch):
    """Reading one named spec checks it against the whole folder (every spec file opened): the
    audit tests of a process read the folder once, not once per spec. A spec the folder's read
    cannot give fails its own audit naming it; the folder's other specs are still audited."""
    from shardverify.features.audit import check
    from shardverify.spec import catalogue

    (tmp_path / "specs").mkdir()
    for name in ("relu.yaml", "acosh.yaml"):
        (tmp_path / "specs" / name).write_text((REPO / "specs" / name).read_text())
    folder_reads = []
    real = catalogue.spec_folder_sources
    monkeypatch.setattr(catalogue, "spec_folder_sources", lambda *a, **k: folder_reads.append(a) or real(*a, **k))
    for spec, case_id in (("specs/relu.yaml", "torch.relu"), ("specs/acosh.yaml", "torch.acosh"),
                          ("specs/relu.yaml", "torch.Tensor.relu")):
        check.assert_complete(check.audit_generated_case(tmp_path, spec, case_id, (4,)))
    assert len(folder_reads) == 1, f"the spec folder was read {len(folder_reads)} times for three audits"

    broken = tmp_path / "broken"
    (broken / "specs").mkdir(parents=True)
    (broken / "specs" / "relu.yaml").write_text((REPO / "specs" / "relu.yaml").read_text())
    (broken / "specs" / "acosh.yaml").write_text((REPO / "specs" / "acosh.yaml").read_text().replace(
        "op: acosh", "op: acosh\nnot_a_field: 1", 1))
    check.assert_complete(check.audit_generated_case(broken, "specs/relu.yaml", "torch.relu", (4,)))
    with pytest.raises(SpecError, match=r"acosh\.yaml.*not_a_field"):
        check.audit_generated_case(broken, "specs/acosh.yaml", "torch.acosh", (4,))
