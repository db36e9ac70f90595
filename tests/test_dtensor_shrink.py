"""The shrink search (shardverify.features.dtensor.shrink), the root causes' minimal repros and drop-in
tests (docs/upstream/), and the in-process fix proofs (shardverify.features.dtensor.fixes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardverify.features.dtensor.root_examples import ROOT_EXAMPLES
from shardverify.features.dtensor.shrink import Example, Family, Outcome, neighbours, shrink
from shardverify.features.dtensor.upstream import load_reports

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = ROOT / "docs" / "upstream"


def _planted(family: Family, example: Example) -> Outcome:
    """A planted bug: silent whenever operand 0 (required) is sharded on dim 1 on a mesh axis of size 2
    and its dim 1 has at least 2 elements; everything else is right."""
    sizes = dict(example.sizes)
    if not example.is_present(0):
        return Outcome("invalid")
    sharded = any(text == "S(1)" and example.mesh[axis] == 2 for axis, text in enumerate(example.placements[0]))
    return Outcome("silent") if sharded and sizes["b"] >= 2 else Outcome("right")


def test_shrink_reaches_a_smaller_example_that_still_fails():
    family = Family("planted", lambda s: ((s["a"], s["b"]), (s["b"],)), lambda x, y: x)
    start = Example((2, 3), (("a", 8), ("b", 12)), (("S(1)", "S(0)"), ("R", "S(0)")), (True, True))
    found = shrink(family, start, judge=_planted)
    assert found.example.weight < start.weight
    assert _planted(family, found.example).kind == "silent"
    # the planted condition's minimum: one mesh axis of 2, b = 2, a = 1, the second operand dropped
    assert found.example == Example((2,), (("a", 1), ("b", 2)), (("S(1)",), ("R",)), (True, False))
    assert found.steps > 0 and found.tried >= found.steps


def test_shrink_refuses_a_start_that_does_not_fail():
    family = Family("planted", lambda s: ((s["a"], s["b"]),), lambda x: x)
    with pytest.raises(ValueError, match="does not fail"):
        shrink(family, Example((2,), (("a", 4), ("b", 1)), (("S(1)",),)), judge=_planted)


def test_neighbours_are_simpler_and_prefer_the_public_shard():
    start = Example((2, 2), (("a", 4),), (("_S(0, sf=2)", "S(0)"),))
    found = neighbours(start)
    assert found and all(n.weight < start.weight for n in found)
    assert Example((2, 2), (("a", 4),), (("S(0)", "S(0)"),)) in found


def test_shrink_on_dtensor_keeps_cumsum_negative_dim_silent():
    family, _ = ROOT_EXAMPLES["cumsum-negative-dim"]
    start = Example((2,), (("a", 2), ("b", 1), ("c", 4)), (("S(2)",),))
    found = shrink(family, start, max_tries=12)
    assert found.outcome.kind == "silent" and found.example.weight < start.weight


def _block(text: str) -> str:
    return re.search(r"^## Repro\b.*?^```python\n(.*?)^```", text, re.S | re.M).group(1)


def test_every_root_cause_has_a_short_repro_its_page_embeds_and_a_drop_in_test():
    pages = {r.name for r in load_reports(UPSTREAM)}
    assert pages == set(ROOT_EXAMPLES)
    for slug in ROOT_EXAMPLES:
        script = (UPSTREAM / "repros" / f"{slug}.py").read_text()
        assert len(script.splitlines()) <= 20, slug
        assert "shardverify" not in script and "torchrun" not in script
        assert _block((UPSTREAM / f"{slug}.md").read_text()) == script, f"{slug}.md's repro differs from repros/{slug}.py"
        test = (UPSTREAM / "tests" / f"test_{slug.replace('-', '_')}.py").read_text()
        assert "DTensorTestBase" in test and "@with_comms" in test and "shardverify" not in test
        assert f"{slug}.md" in (UPSTREAM / "README.md").read_text()


def test_drop_in_tests_are_not_collected_by_this_project():
    import tomllib

    paths = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    assert not any(Path(p).parts[0] == "docs" for p in paths)


def test_the_cumsum_fix_removes_every_silent_combination_and_breaks_none():
    from shardverify.features.dtensor.fixes import FIXES, prove
    from shardverify.spec.catalogue import load_op_specs

    spec, = load_op_specs(ROOT, None, ["cumsum"])
    proof = prove(FIXES["cumsum-negative-dim"], spec, [(4,)], limit=6, cases={"torch.cumsum-dim_-1"})
    assert proof.stock["silent-wrong"] > 0
    assert proof.fixed["silent-wrong"] == 0 and not proof.newly_failing
    assert "fixed: 0 silent-wrong" in proof.line()


def test_a_multi_output_op_is_held_to_its_reference_and_the_nll_loss_fix_makes_the_weighted_mean_right():
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shardverify.features.dtensor.attribute import OpTrace
    from shardverify.features.dtensor.fixes import FIXES, patched
    from shardverify.features.dtensor.shrink import outcome
    from shardverify.features.dtensor.world import local_world

    x, t, w = torch.tensor([[2.0, 0.0], [0.0, 0.0]]), torch.tensor([0, 1]), torch.tensor([1.0, 3.0])
    with local_world((2,)) as (mesh, mode), mode:
        trace = OpTrace()
        with trace:
            torch.nn.functional.cross_entropy(distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(t, mesh, [Shard(0)]),
                                              weight=distribute_tensor(w, mesh, [Replicate()]))
    # nll_loss_forward returns (loss, total_weight): the loss is judged although the output is a tuple
    assert trace.culprit is not None and trace.culprit.op == "aten.nll_loss_forward.default"
    assert trace.culprit.blame == "forward rule" and trace.culprit.output == "[P(avg)]"
    family, start = ROOT_EXAMPLES["nll-loss-weighted-mean"]
    assert outcome(family, start).kind == "silent"
    with patched(FIXES["nll-loss-weighted-mean"]):
        assert outcome(family, start).kind == "right"
