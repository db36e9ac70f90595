"""`shardverify plan`'s text: the verdict in its first lines, in the user's words; the op-by-op
listing behind -v; a status line on a terminal only; the zoo's tiny configs built without
transformers' warnings."""

from __future__ import annotations

import io
import logging
import warnings

import pytest
import torch

from shardverify.cli.main import main
from shardverify.plan.report import VERDICT_LINES, plan_text, verdict_lines

LINEAR = ["plan", "shardverify.plan.zoo.linear_chain", "--input", "8,32", "--mesh", "4"]
#: words of the engine a default report must not use: the reader has no way to know them
ENGINE_WORDS = ("handler", "grid", "verdict cache", "strategy(ies)", "partial max", "reduced by max or min")


@pytest.fixture
def sharding_plan(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text('fc1: "RS0 = RR x RS0"\nfc2: "RR = RS0 x S0R"\n')
    return str(path)


def test_the_verdict_comes_first_and_the_listing_only_with_verbose(capsys, sharding_plan):
    assert main([*LINEAR, "--plan", sharding_plan]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    head = lines[:VERDICT_LINES]
    assert head[0].startswith("PASS: the plan for shardverify.plan.zoo.linear_chain on mesh [4] matches the "
                              "single-device model, forward and backward (checked on 4 simulated ranks)"), head
    assert head[1] == "sharded: 2 of 2 ops split across the 4 devices; replicated: 0", head
    assert head[2].startswith("predicted cost: ") and " per training step " in head[2] and "per device" in head[2]
    assert head[3] == "coverage: all 2 ops that compute have verified sharding strategies", head
    assert head[4].startswith("detail: -v lists every op's layout")
    assert "op by op" not in captured.out and "fc1 " not in captured.out     # the listing is -v's
    assert len(lines) <= VERDICT_LINES + 1, captured.out                     # and the CPU seconds
    assert not any(word in captured.out for word in ENGINE_WORDS), captured.out
    assert captured.err == ""       # no status line: stderr is not a terminal here

    assert main([*LINEAR, "--plan", sharding_plan, "-v"]) == 0
    verbose = capsys.readouterr().out
    assert verbose.splitlines()[0] == lines[0]
    assert "plan on mesh [4], op by op (" in verbose
    assert "  weights and inputs (1): held whole on every device until an op takes its piece" in verbose
    assert "  fc1              RS0 = RR x RS0" in verbose and "  fc2              RR = RS0 x S0R" in verbose
    assert "  output           the model's output, whole on every device" in verbose


def test_a_failure_names_its_first_culprit_in_the_first_lines(sv_backend):
    from test_plan import _chain

    from shardverify.plan import run_plan
    from shardverify.plan.verify import plan_with_coverage

    module, inputs = _chain()
    plan, coverage = plan_with_coverage(module, inputs, (2, 2), {"fc1": "RS0 = RR x RS0", "fc2": "RR = RR x RR"})
    (reshard,) = plan.node("fc2").reshards
    wrong = reshard.__class__(**{**reshard.__dict__, "steps": (reshard.steps[0].__class__("all_gather", (1,), (1,)),)})
    result = run_plan(sv_backend((2, 2), "simulated"), module, inputs, plan.replace_node("fc2", reshards=(wrong,)),
                      coverage=coverage)
    head = verdict_lines(result, "linear_chain")
    assert len(head) == VERDICT_LINES
    assert head[0].startswith("FAIL: the plan for linear_chain on mesh [2, 2] differs from the single-device model: "
                              "the forward output is first wrong at node 'fc2'"), head
    assert head[4].startswith("first culprit: node 'fc2' (") and "layout RR = RR x RR" in head[4], head
    assert "fc1 moved [R, S0] -> [R, R] by all_gather(axes=(1,), dim=1)" in head[4], head
    text = plan_text(result, "linear_chain")
    assert text.splitlines()[:VERDICT_LINES] == head and "op by op" not in text


def test_the_status_line_names_each_phase_on_a_terminal_only():
    from shardverify.cli.plan_cmd import PHASE_WORDS, _phase_started
    from shardverify.cli.progress import Progress
    from shardverify.plan.phases import PHASES, PhaseClock

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert list(PHASE_WORDS) == list(PHASES)
    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        status = Progress(len(PHASES), stream)
        clock = PhaseClock(on_start=lambda name: _phase_started(status, name))
        with clock.phase("capture"):
            pass
        with clock.phase("solve"):
            pass
        status.close()
        text = stream.getvalue()
        assert ("capturing its graph" in text and "choosing the plan" in text
                and "3/5" in text) is shown, text
        assert (text == "") is not shown


def _transformers_says(build) -> list[str]:
    """What transformers logs and warns while ``build`` runs (its logger does not propagate)."""
    said = io.StringIO()
    handler = logging.StreamHandler(said)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build()
    finally:
        logger.removeHandler(handler)
    return [line for line in said.getvalue().splitlines() if line] + [str(w.message) for w in caught]


def test_the_zoos_tiny_configs_build_without_transformers_warnings():
    """GPT-2's special ids (50256) outside a 128-token vocabulary made transformers warn on every
    `plan zoo:gpt2`; no zoo model, tiny or at its real size, may."""
    pytest.importorskip("transformers")
    from shardverify.plan.hf_zoo import HF_MODELS, REAL_MODELS, hf_model

    for name in HF_MODELS:
        assert _transformers_says(lambda: hf_model(name)) == [], name
    for name, build in REAL_MODELS.items():
        with torch.device("meta"):   # the real size's structure, nothing allocated
            assert _transformers_says(lambda: build(256, 64, 2)) == [], name
