"""Soundness of the check itself: a rank's result must have the single-device op's dtype
and the rank's device, and a random op cannot be checked against a reference (the gap between
two draws would be taken for rounding and a wrong rule would pass)."""

from __future__ import annotations

import pytest
import torch

from shardverify import DeviceMesh, strategies_for_node
from shardverify.backends import SimulatedBackend
from shardverify.errors import VerificationError
from shardverify.spec.loader import load_yaml_text
from shardverify.spec.op import parse_op_spec
from shardverify.verify import rank as rank_module
from shardverify.verify.engine import verify_case

RELU = """\
op: relu_probe
description: relu.
targets: [torch.relu]
operands:
  input: {kind: input, index: 0, keyword: input}
  output: {kind: output}
generator: {family: rules, options: {pointwise: true}}
verify:
  inputs: {input: {shape: [8, 4]}}
  meshes: [[2]]
"""

DROPOUT = """\
op: dropout_probe
description: dropout in training, p > 0.
targets: [torch.nn.functional.dropout]
operands:
  input: {kind: input, index: 0, keyword: input}
  output: {kind: output}
params:
  p: {index: 1, keyword: p, default: 0.5}
generator: {family: rules, options: {%s}}
verify:
  inputs: {input: {shape: [4, 4, 4]}}
  grid: {p: [%s]}
  meshes: [[2]]
"""


def _case(text: str):
    spec = parse_op_spec(load_yaml_text(text, "probe.yaml"))
    (_, case), *_ = spec.op_cases()
    return case


def _offered(text: str, mesh=(2,)):
    """The case and the strategies the spec's own rule offers (no registered handler involved)."""
    from shardverify.features.audit.run import offered_strategies

    spec = parse_op_spec(load_yaml_text(text, "probe.yaml"))
    (_, case), *_ = spec.op_cases()
    graph_module, name = case.build()
    node = next(n for n in graph_module.graph.nodes if n.name == name)
    return case, offered_strategies(spec, graph_module, node, DeviceMesh(mesh))[1]


def test_a_rank_returning_float64_for_float32_fails(monkeypatch):
    case = _case(RELU)
    graph_module, name = case.build()
    strategies = strategies_for_node(graph_module, name, DeviceMesh((2,)))
    real = rank_module.call_op

    def widened(node, module, local, **kwargs):   # the planted bug: exact values, wrong dtype
        out = real(node, module, local, **kwargs)
        return out.double() if isinstance(out, torch.Tensor) else out

    monkeypatch.setattr(rank_module, "call_op", widened)
    results = verify_case(SimulatedBackend(DeviceMesh((2,))), case, strategies)
    assert results and not any(r.passed for r in results)
    assert "output: dtype float64, the single-device op gives float32" in str(results[0])


@pytest.mark.parametrize("options", ["pointwise: true", 'einsum: "a b c -> c b a"'])
def test_a_random_op_fails_every_layout_that_splits_its_draw_and_passes_the_whole_one(options):
    """dropout(p=0.5) in training: before, every strategy passed, a wrong one (`a b c -> c b a`)
    included, because the gap between two random masks set the allowance. Every call of it now
    draws from one fixed generator state, in the ranks' dtype (capture/randomness.py): the rank
    that makes the whole result matches, a rank drawing its block does not."""
    case, strategies = _offered(DROPOUT % (options, "0.5"))
    results = {r.strategy: r for r in verify_case(SimulatedBackend(DeviceMesh((2,))), case, strategies)}
    whole = [s.name for s in strategies if not any(spec.dim_partition for _, spec in s.sharding_specs)
             and not s.partial_inputs]
    assert whole and all(results[name].passed for name in whole), results
    split = [r for name, r in results.items() if name not in whole]
    assert split and not any(r.passed for r in split), split


def test_the_same_op_where_it_is_deterministic_verifies():
    case, strategies = _offered(DROPOUT % ("pointwise: true", "0.0"))
    assert all(r.passed for r in verify_case(SimulatedBackend(DeviceMesh((2,))), case, strategies))


def test_a_wrong_rule_fails_where_the_op_is_deterministic():
    case, strategies = _offered(DROPOUT % ('einsum: "a b c -> c b a"', "0.0"))
    results = verify_case(SimulatedBackend(DeviceMesh((2,))), case, strategies)
    assert any(not r.passed for r in results)


def test_a_partial_max_rule_fails_on_the_shipped_amax_data_which_ties():
    """amax splits the gradient among tied maxima; a rank splits it among its own ties only, so a
    partial max is wrong wherever the maximum ties across ranks. The shipped spec's data ties
    (a Hardtanh clips to +-2), so the old rule fails on it, and the shipped rule keeps the
    reduced dims whole."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "specs" / "amax.yaml").read_text()
    assert "reduce_op: none" in text and "torch.nn.Hardtanh" in text
    partial = text.replace("reduce_op: none", "reduce_op: max").split("  strategies:")[0].replace(
        "  meshes: [[4], [2, 2], [2, 2, 2]]", "  meshes: [[2, 2]]")
    case, strategies = _offered(partial, (2, 2))
    results = verify_case(SimulatedBackend(DeviceMesh((2, 2))), case, strategies)
    failed = [r for r in results if not r.passed]
    assert failed and all("P" in r.strategy for r in failed), [r.strategy for r in failed]
    assert "grad of" in str(failed[0])


def test_embedding_ids_look_up_every_row_of_the_table():
    """Ids drawn in [0, 8) never looked up rows 8-15 of a 16-row table, so a wrong vocab-parallel
    rule for those rows passed; the shipped specs draw ids over the whole table."""
    from pathlib import Path

    from shardverify.spec.loader import load_yaml
    from shardverify.verify.reference import reference

    specs = Path(__file__).resolve().parents[1] / "specs"
    for name, rows in (("embedding", 16), ("embedding_padded", 16), ("index_select", 16)):
        spec = parse_op_spec(load_yaml(specs / f"{name}.yaml", display=f"specs/{name}.yaml"))
        (_, case), *_ = spec.op_cases()
        ref = reference(case, None, torch.device("cpu"))
        ids = [v for v in ref.values.values() if not v.is_floating_point()][0]
        assert int(ids.min()) >= 0 and int(ids.max()) == rows - 1, name
        if name != "index_select":          # 8 ids cannot cover 16 rows; 64 can
            assert set(ids.flatten().tolist()) == set(range(rows)), name
