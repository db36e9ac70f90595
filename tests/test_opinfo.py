"""The OpInfo sweep (shardverify/opinfo): PyTorch's own samples of a spec's targets, captured and
served as a plan serves them, every served strategy verified at the call."""

from __future__ import annotations

from pathlib import Path

from shardverify.codegen.generate import load_op_specs
from shardverify.opinfo.report import markdown, reason_class
from shardverify.opinfo.samples import entries_for, one_op_module, samples_of
from shardverify.opinfo.sweep import sweep_spec
from shardverify.verify.on_demand import OnDemandVerifier

REPO = Path(__file__).resolve().parents[1]


def _spec(name):
    return load_op_specs(REPO, None, [name])[0]


def test_a_specs_targets_find_their_opinfo_entries_and_samples():
    import torch

    entries = entries_for([torch.softmax, torch.ops.aten.softmax.int])
    assert {e.name for e in entries} >= {"softmax"}
    sample = next(samples_of(entries[0], limit=2))
    module = one_op_module(sample)
    expected = sample.call(*sample.arguments(sample.tensors)[0], **sample.arguments(sample.tensors)[1])
    assert torch.equal(module(*sample.tensors), expected)


def test_the_sweep_serves_grid_and_on_demand_calls_and_checks_every_served_strategy(tmp_path):
    # log_softmax's OpInfo samples pass dtype= (outside its grid: verified on demand) and plain calls
    with OnDemandVerifier(cache_dir=tmp_path) as verifier:
        result = sweep_spec(_spec("log_softmax"), meshes=((2, 2),), captures=("fx",), limit=3, verifier=verifier)
    counts = result.counts()
    assert counts["on-demand"] >= 1 and counts["grid"] >= 1
    assert not result.wrong and counts["raw-error"] == 0
    grid = [o for o in result.outcomes if o.outcome == "grid"]
    assert all(o.checked == o.strategies > 0 for o in grid)   # the grid's strategies verified at the call
    page = markdown(result, "shardverify verify --opinfo", "2.13.0")
    assert "| log_softmax | log_softmax |" in page and "on-demand" in page


def test_refusal_reasons_are_grouped_without_what_varies():
    assert reason_class("x: node 'a' passes dim=1; the rule was verified for dim in {0} only (specs/x.yaml)") == \
        reason_class("x: node 'b' passes dim=2; the rule was verified for dim in {0} only (specs/x.yaml)")
