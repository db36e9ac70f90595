"""The OpInfo sweep (shardverify/opinfo): PyTorch's own samples of a spec's targets, captured and
served as a plan serves them, every served strategy verified at the call."""

from __future__ import annotations

from pathlib import Path

from shardverify.spec.catalogue import load_op_specs
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


def test_an_entry_is_swept_once_its_results_stored_and_read_back_while_current(tmp_path):
    from shardverify.cli.opinfo_run import _entries
    from shardverify.opinfo.store import claim_entry, load_entry, release_entry, save_entry, settings_key
    from shardverify.opinfo.sweep import entry_name, sweep_entry

    # var, var_all and var_dim all list torch.var's entries: each entry once, its calls counted once
    names = [entry_name(entry) for entry, _, _ in _entries([_spec("var"), _spec("var_all"), _spec("var_dim")])]
    assert len(names) == len(set(names)) and "var" in names
    entry, op, targets = next(e for e in _entries([_spec("softmax")]) if entry_name(e[0]) == "softmax")
    with OnDemandVerifier(cache_dir=tmp_path / "verdicts") as verifier:
        result = sweep_entry(entry, op, targets, meshes=((4,),), captures=("fx",), limit=2, verifier=verifier)
    assert len(result.outcomes) == 2 and {o.served_by for o in result.outcomes} == {("softmax",)}
    settings = settings_key(2, ((4,),), ("fx",), 0)
    save_entry(tmp_path, "softmax", settings, result)
    stored, _ = load_entry(tmp_path, "softmax", settings)
    assert stored.outcomes == result.outcomes
    assert load_entry(tmp_path, "softmax", settings_key(3, ((4,),), ("fx",), 0)) is None   # other settings: stale
    assert claim_entry(tmp_path, "softmax") is None and "is sweeping" in claim_entry(tmp_path, "softmax")
    release_entry(tmp_path, "softmax")
    assert claim_entry(tmp_path, "softmax") is None
    (tmp_path / "softmax.lock").write_text("999999999")          # its sweeper died (a crash): not taken over
    assert "died sweeping it" in claim_entry(tmp_path, "softmax")
