"""The OpInfo sweep (shardverify/features/opinfo): PyTorch's own samples of a spec's targets, captured and
served as a plan serves them, every served strategy verified at the call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardverify.spec.catalogue import load_op_specs
from shardverify.features.opinfo.report import markdown, reason_class, user_words
from shardverify.features.opinfo.samples import entries_for, one_op_module, samples_of
from shardverify.features.opinfo.samples import op_db as samples_op_db
from shardverify.features.opinfo.sweep import sweep_spec
from shardverify.sharding.mesh import DeviceMesh
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
    from shardverify.features.opinfo.store import claim_entry, load_entry, release_entry, save_entry, settings_key
    from shardverify.features.opinfo.sweep import entry_name, sweep_entry

    # var, var_all and var_dim all list torch.var's entries: each entry once, its calls counted once
    names = [entry_name(entry) for entry, _, _, _ in _entries([_spec("var"), _spec("var_all"), _spec("var_dim")])[0]]
    assert len(names) == len(set(names)) and "var" in names
    entry, op, targets, _ = next(e for e in _entries([_spec("softmax")])[0] if entry_name(e[0]) == "softmax")
    with OnDemandVerifier(cache_dir=tmp_path / "verdicts") as verifier:
        result = sweep_entry(entry, op, targets, meshes=((4,),), captures=("fx",), limit=2, verifier=verifier)
    assert len(result.outcomes) == 2 and {o.served_by for o in result.outcomes} == {("softmax",)}
    settings = settings_key(2, ((4,),), ("fx",), 0)
    save_entry(tmp_path, "softmax", settings, result)
    stored, _ = load_entry(tmp_path, "softmax", settings)
    assert stored.outcomes == result.outcomes
    assert load_entry(tmp_path, "softmax", settings_key(3, ((4,),), ("fx",), 0)) is None   # other settings: stale
    assert claim_entry(tmp_path, "softmax") == (True, "")
    claimed, why = claim_entry(tmp_path, "softmax")
    assert not claimed and "is sweeping" in why
    release_entry(tmp_path, "softmax")
    assert claim_entry(tmp_path, "softmax") == (True, "")


def _dead_pid() -> int:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(done.stdout)


def test_a_lock_of_a_dead_sweeper_or_of_a_reused_pid_is_taken_over(tmp_path):
    """A sweep killed mid-entry leaves its lock: every later run skipped that entry for good. A
    lock names its owner's pid and start time, and a gone owner's lock is taken over, said."""
    import os

    from shardverify.backends.liveness import process_start
    from shardverify.features.opinfo.store import claim_entry, held

    (tmp_path / "softmax.lock").write_text(f"{_dead_pid()} 12345")
    assert held(tmp_path, "softmax") is None
    claimed, why = claim_entry(tmp_path, "softmax")
    assert claimed and "is gone" in why
    assert (tmp_path / "softmax.lock").read_text() == f"{os.getpid()} {process_start(os.getpid())}"
    # a live pid that started at another time: a stranger reusing a dead sweeper's pid
    (tmp_path / "softmax.lock").write_text(f"{os.getpid()} {process_start(os.getpid()) + 1}")
    claimed, why = claim_entry(tmp_path, "softmax")
    assert claimed and f"process {os.getpid()}" in why and "is gone" in why


@pytest.mark.parametrize("text", ["garbage", "", "-5", "1 2 3", "99999999999999999999999"])
def test_a_lock_naming_no_process_is_stale_said_and_taken_over(tmp_path, text):
    from shardverify.features.opinfo.store import claim_entry

    (tmp_path / "softmax.lock").write_text(text)
    claimed, why = claim_entry(tmp_path, "softmax")
    assert claimed and "names no process" in why and "treated as stale" in why


def test_a_lock_that_is_not_a_regular_file_is_stale_and_not_followed(tmp_path):
    from shardverify.features.opinfo.store import claim_entry

    outside = tmp_path / "outside"
    outside.write_text("kept")
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "softmax.lock").symlink_to(outside)
    claimed, why = claim_entry(tmp_path / "store", "softmax")
    assert claimed and "unreadable" in why and outside.read_text() == "kept"


def _opinfo(capsys, *argv: str) -> tuple[int, str]:
    from shardverify.cli.main import main

    code = main(["verify", "--opinfo", *argv, "--mesh", "4", "--opinfo-samples", "1", "--root", str(REPO)])
    out, err = capsys.readouterr()
    return code, out + err


def test_an_entry_a_live_process_holds_is_not_swept_and_fails_the_run(tmp_path, capsys):
    import subprocess
    import sys

    from shardverify.backends.liveness import process_start

    sweeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for entry in ("softmax", "softmax.with_dtype"):
            (tmp_path / f"{entry}.lock").write_text(f"{sweeper.pid} {process_start(sweeper.pid)}")
        code, text = _opinfo(capsys, "softmax", "--opinfo-results", str(tmp_path))
    finally:
        sweeper.kill()
        sweeper.wait()
    assert code == 1 and f"softmax (process {sweeper.pid} is sweeping it)" in text
    assert "FAILED: 2 of 2 requested entries not swept" in text and "Traceback" not in text


def test_stored_results_only_on_an_empty_folder_fail_naming_every_entry(tmp_path, capsys):
    code, text = _opinfo(capsys, "softmax", "--opinfo-results", str(tmp_path), "--opinfo-stored")
    assert code == 1
    assert "softmax (no current stored results)" in text and "softmax.with_dtype (no current stored results)" in text


def test_a_stored_entry_of_no_call_is_not_a_pass(tmp_path, capsys):
    from shardverify.features.opinfo.store import save_entry, settings_key
    from shardverify.features.opinfo.sweep import SweepResult

    settings = settings_key(1, ((4,),), ("fx", "export"), 0)
    for entry in ("softmax", "softmax.with_dtype"):
        save_entry(tmp_path, entry, settings, SweepResult())      # a file edited down to no outcome
    code, text = _opinfo(capsys, "softmax", "--opinfo-results", str(tmp_path), "--opinfo-stored")
    assert code == 1 and "softmax (its stored results hold no call)" in text


def test_a_named_spec_without_an_opinfo_entry_is_said_and_no_pass(tmp_path, capsys):
    code, text = _opinfo(capsys, "cdist", "--opinfo-results", str(tmp_path))
    assert code == 1 and "spec cdist (its targets have no OpInfo entry)" in text


def test_every_op_db_entry_is_swept_by_what_its_samples_call(tmp_path, capsys, monkeypatch):
    """--opinfo-every-entry: an entry no spec lists counts every op node its captures hold, what no
    spec serves decomposed as a plan's capture decomposes it (torch.deg2rad: a mul under both
    captures); one that nothing serves nor decomposes (geqrf) is counted unserved with its
    reason; one with no CPU sample in a swept dtype (view_as_real: complex only) and one whose op is
    a CUDA function (the jiterator's) are skipped and named with why; the share over the specs' own entries is given beside the share over all."""
    import shardverify.features.opinfo.samples as samples
    from shardverify.features.opinfo.sweep import entry_name

    every = samples.op_db()
    monkeypatch.setattr(samples, "op_db", lambda: [e for e in every if entry_name(e) in
                                                   ("softmax", "deg2rad", "geqrf", "view_as_real",
                                                                        "jiterator_unary")])
    report = tmp_path / "opinfo.md"
    code, text = _opinfo(capsys, "softmax", "--opinfo-every-entry", "--opinfo-results", str(tmp_path / "results"),
                         "--report", str(report))
    assert code == 0, text
    assert "Over every op_db entry swept (3):" in text and "Over the entries the specs' targets list (1 of them):" \
        in text
    assert "view_as_real (no CPU sample in float64, float32, int64, bool: its CPU dtypes are complex" in text
    assert "jiterator_unary (its op is a CUDA function (torch.cuda.jiterator._JittedFunction), which no CPU runs)" \
        in text
    page = report.read_text()
    assert "| deg2rad | mul | 2 | 2 (100%) |" in page, page
    assert "| geqrf | geqrf | 2 | 0 (0%) |" in page and \
        "| no-handler | aten.geqrf.default: no spec serves it, and it decomposes into no op that is served | 2 |" in page
    assert "--opinfo-every-entry" in page and "**Skipped: 2 OpInfo entries**" in page


def test_an_entry_whose_sweeper_died_is_swept_again_in_a_child_process(tmp_path, capsys):
    """A sweeper that died holding an entry may have died of the entry (a kernel corrupting the
    heap on the data drawn for it: max_pool2d_with_indices_backward): the next run sweeps it in a
    child process, whose death would be said and fail that entry alone. Here the child lives and
    stores the entry's results, which the run then counts."""
    for entry in ("softmax", "softmax.with_dtype"):
        (tmp_path / f"{entry}.lock").write_text(f"{_dead_pid()} 12345")
    code, text = _opinfo(capsys, "softmax", "--opinfo-results", str(tmp_path))
    assert code == 0, text
    assert text.count("swept in a child process") == 2 and "took its lock over" in text
    assert not list(tmp_path.glob("*.lock"))
    again, text = _opinfo(capsys, "softmax", "--opinfo-results", str(tmp_path), "--opinfo-stored")
    assert again == 0 and text.count("stored (swept at") == 2


def test_a_raw_exception_verifying_at_the_call_is_counted_and_the_sweep_goes_on(tmp_path, monkeypatch):
    """unravel_index's samples once ended a whole sweep: a kernel raising a bare RuntimeError on
    the data drawn (a remainder by zero) while a grid-served call was verified. It is the call's
    raw-error, which fails the run by name, and the sweep goes on."""
    import shardverify.features.opinfo.sweep as sweep

    def raising(*args, **kwargs):
        raise RuntimeError("ZeroDivisionError")

    monkeypatch.setattr(sweep, "verify_case", raising)
    with OnDemandVerifier(cache_dir=tmp_path) as verifier:
        result = sweep_spec(_spec("softmax"), meshes=((4,),), captures=("fx", "export"), limit=2, verifier=verifier)
    raw = [o for o in result.outcomes if o.outcome == "raw-error"]
    assert raw and {o.outcome for o in result.outcomes} == {"raw-error", "on-demand"}, result.counts()   # the
    # grid-served calls (the on-demand ones were verified as they were served)
    assert all(o.reason == "verifying at the call: RuntimeError: ZeroDivisionError" for o in raw)


def test_a_call_returning_a_number_computed_from_tensors_is_an_op_never_folded():
    """``torch.equal`` under fx returns a bool, no tensor: it is still a call a layout changes (each
    rank compares its own block), so the sweep counts it, not a folded constant; ``x.size()`` is no op."""
    from shardverify.capture.fx import trace
    from shardverify.features.opinfo.sweep import _op_nodes

    class Equal(torch.nn.Module):
        def forward(self, x, y):
            return torch.equal(x, y), x.size()

    gm = trace(Equal(), {"x": torch.ones(2, 3), "y": torch.ones(2, 3)})
    assert [n.name for n in _op_nodes(gm, set())] == ["equal"]


def test_a_random_op_is_served_with_every_rank_drawing_the_whole_tensor():
    """Every call of a drawing op draws from one fixed generator state (capture/randomness.py):
    randn_like is served where each rank makes the whole tensor, and nowhere sharded."""
    from shardverify.features.opinfo.sweep import entry_name, sweep_entry

    entry = next(e for e in samples_op_db() if entry_name(e) == "randn_like")
    result = sweep_entry(entry, "randn_like", [], meshes=[(4,)], limit=2)
    assert result.outcomes and {o.outcome for o in result.outcomes} <= {"grid", "on-demand"}, result.outcomes
    assert all(o.strategies and not o.sharded and not o.wrong for o in result.outcomes), result.outcomes


def test_a_random_op_no_spec_serves_is_unserved_with_why():
    from shardverify.features.opinfo.report import totals
    from shardverify.features.opinfo.sweep import CallOutcome, RANDOM, SweepResult, _node_outcome

    class Counts(torch.nn.Module):
        def forward(self, x):
            return torch.poisson(x)

    graph_module = torch.export.export(Counts(), (torch.ones(4, 3),)).module()
    node = next(n for n in graph_module.graph.nodes if n.target is torch.ops.aten.poisson.default)
    with OnDemandVerifier() as verifier:
        found = _node_outcome(node, graph_module, DeviceMesh((4,)), verifier, check_grid=False)
    assert found["outcome"] == "no-handler"
    assert found["reason"].startswith(f"aten.poisson.default {RANDOM} and no spec serves it: ")
    assert "whole_tensors" in found["reason"]
    result = SweepResult([CallOutcome("poisson", "poisson#0(float64[4, 3])", "export", (4,), **found)])
    assert all("0 of 1 calls served (0.0%)" in line and "1 draw random numbers" in line for line in totals(result)), \
        totals(result)


def test_a_capture_torch_refused_and_an_op_no_spec_serves_are_said_in_a_readers_words():
    assert user_words("not-captured", "TraceError: symbolically traced variables cannot be used as inputs to "
                                      "control flow") == ("torch.fx cannot trace it: the call branches in Python on a "
                                                          "tensor's value (torch.export can)")
    assert user_words("not-captured", "CaptureError: torch.export cannot capture OneOp_1: GuardOnDataDependentSymNode: "
                                      "Could not extract specialized integer").startswith("torch.export cannot capture it")
    assert user_words("no-handler", "captured as aten.nonzero.default") == \
        "aten.nonzero.default: its output's shape depends on the input's values; no spec serves it"
    assert user_words("no-handler", "captured as torch.cov") == \
        "torch.cov: no spec serves it, and it traces to no ATen ops that are served"
    assert user_words("refused", "sub (specs/sub.yaml): ...") == "sub (specs/sub.yaml): ..."
