"""Models as transformers builds them by default, and the ATen calls their capture makes.

Mixtral and OLMoE built with transformers' default experts (``grouped_mm``; the zoo's Mixtral asks
for ``batched_mm``) run their expert matmuls through ``torch.ops.transformers.grouped_mm_fallback``
under torch.export: a custom op no spec can name (it exists only once transformers is loaded), so
the capture decomposes it (shardverify/capture/custom_ops.py) into ops the specs serve, and both
models pass ``shardverify plan --strict`` on (2, 2). Also served under torch.export:
``aten.einsum.default`` (specs/einsum_aten.yaml; an equation its rule cannot describe, a diagonal or
three operands, is decomposed), ``aten.lift_fresh_copy.default`` (specs/lift_fresh_copy.yaml); and
uninitialised memory (``empty_like``) is counted once, as not compared, never as an op without a
handler."""

from __future__ import annotations

import sys

import pytest
import torch

from shardverify.capture.custom_ops import grouped_mm_rows
from shardverify.cli.main import main
from shardverify.plan import verify_plan
from shardverify.plan.capture_model import capture_model
from shardverify.plan.verify import describe_plan

pytestmark = pytest.mark.slow   # whole MoE models planned and checked: tens of seconds each

#: tiny builds as the HF zoo's (shardverify/plan/hf_zoo.py: width 64, 4 heads, 4 experts, top 2,
#: one layer, 128 tokens of vocabulary), the experts left to transformers' default
FACTORIES = '''
import transformers as t

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=4, num_experts_per_tok=2, max_position_embeddings=32, attn_implementation="sdpa",
             use_cache=False)


def mixtral():
    return t.MixtralForCausalLM(t.MixtralConfig(num_local_experts=4, **SIZES))


def olmoe():
    return t.OlmoeForCausalLM(t.OlmoeConfig(num_experts=4, eos_token_id=127, **SIZES))
'''
IDS = "input_ids=int64[4,16]:0..128"     # the zoo's batch 4 of 16 tokens


@pytest.fixture
def factories(tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="the HF models need the models extra: pip install -e '.[models]'")
    (tmp_path / "moe_defaults_models.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)       # a factory file under the current folder, as a user runs it
    monkeypatch.delitem(sys.modules, "moe_defaults_models", raising=False)
    import moe_defaults_models

    return moe_defaults_models


def _fallback():
    pytest.importorskip("transformers", reason="the HF models need the models extra: pip install -e '.[models]'")
    import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers)

    return torch.ops.transformers.grouped_mm_fallback.default


def test_the_default_experts_are_captured_as_grouped_mm_fallback_and_decomposed(factories):
    """The premise, and what the capture makes of it: every fallback node decomposed, its pieces
    named after it, none left."""
    model = factories.mixtral().eval()
    assert model.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    exported = torch.export.export(model, (ids,), strict=False).module()
    fallback = _fallback()
    assert sum(n.target is fallback for n in exported.graph.nodes) == 2     # the up and the down projection
    graph = capture_model(model, (ids,), "export").graph
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert "transformers.grouped_mm_fallback.default" not in targets
    assert {"aten.bmm.default", "aten.index.Tensor"} <= targets


@pytest.mark.parametrize("rows, ends", [
    (10, [3, 3, 10]),          # an expert with no row, the last ending at the last row
    (10, [0, 4, 7]),           # the first expert empty, rows past the last end (left zero)
    (6, [6, 6, 6]),            # every row to the first expert
    (0, [0, 0, 0]),            # no row at all
])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_decomposition_computes_what_the_op_computes(rows, ends, dtype):
    """The reference runs the decomposed graph too, so its agreement with transformers' own op is
    checked here: forward and both gradients, in float64 (the plan check's precision)."""
    fallback = _fallback()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 4, dtype=torch.float64, generator=gen)
    w = torch.randn(3, 4, 5, dtype=torch.float64, generator=gen)
    offs = torch.tensor(ends, dtype=dtype)
    grad = torch.randn(rows, 5, dtype=torch.float64, generator=gen)
    found = []
    for op in (fallback, grouped_mm_rows):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = op(xi, wi, offs)
        out.backward(grad)
        found.append((out.detach(), xi.grad, wi.grad))
    for expected, got in zip(*found):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("model", ["mixtral", "olmoe"])
def test_a_default_moe_model_passes_strict_on_2x2(factories, capsys, model):
    status = main(["plan", f"moe_defaults_models.{model}", "--mesh", "2,2", f"--input={IDS}", "--strict", "-v"])
    out = capsys.readouterr()
    assert status == 0, out.out + out.err
    assert "0 refused by their spec, 0 no spec covers" in out.out, out.out
    assert "'grouped_mm_fallback' transformers.grouped_mm_fallback.default -> " in out.out
    assert "1 not compared (uninitialised memory)" in out.out      # the inverse of the experts' sort
    assert out.out.startswith("PASS: "), out.out


class Einsums(torch.nn.Module):
    """torch.einsum three ways under torch.export (a batched matmul, a diagonal, three operands)
    and a tensor built in forward from a Python list (``aten.lift_fresh_copy``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 16, 16) * 0.2)

    def forward(self, a):
        scale = torch.tensor([0.5, 1.0, 2.0, 4.0] * 4)
        return torch.einsum("bij,bjk->bik", a, self.w) * scale + torch.einsum("bii->bi", a).unsqueeze(-1) \
            + torch.einsum("bij,bjk,bkl->bil", a, self.w, self.w)


def test_aten_einsum_and_lift_fresh_copy_are_served_under_export():
    """Each sharded by the plan: the batched matmul over the batch and its contracted dim (a partial
    sum), the constant's copy over the other axis."""
    torch.manual_seed(0)
    plan = {"einsum": "S0RS1 x S0S1R -> S0RR | P1 sum", "lift_fresh_copy": "S1 -> S1"}
    result = verify_plan(Einsums(), (torch.randn(8, 16, 16),), (2, 2), plan, capture="export", strict=True)
    assert result.passed, result.summary() + "\n" + "\n".join(result.coverage.lines())
    status = {s.node: s for s in result.coverage.statuses}
    assert status["einsum"].target == "aten.einsum.default"
    assert status["lift_fresh_copy"].target == "aten.lift_fresh_copy.default"
    assert {"einsum", "lift_fresh_copy"} <= set(result.coverage.sharded)
    # a diagonal and a three-operand einsum: the rule does not describe them, so they are decomposed
    decomposed = {node for node, _ in result.coverage.decompositions()}
    assert {"einsum_1", "einsum_2"} <= decomposed, decomposed
    assert not result.coverage.fallbacks


class Unsorted(torch.nn.Module):
    """Rows sorted by a score and put back in order through the inverse permutation, written as
    the MoE experts write it: ``inverse = empty_like(order); inverse[order] = arange(n)``."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 64)

    def forward(self, x):
        h = self.up(x)
        _, order = torch.sort(h[:, 0])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.shape[0])
        return h[order][inverse] * h


def test_uninitialised_memory_is_counted_once_as_not_compared():
    torch.manual_seed(0)
    result = verify_plan(Unsorted(), torch.randn(32, 8), (2,), capture="export", strict=True, min_sharded=1)
    assert result.passed, result.summary()
    coverage = result.coverage
    assert coverage.uninitialised == ("empty_like",)
    assert coverage.count("not compared") == 1 and coverage.count("unhandled") == 0
    assert not coverage.fallbacks and not coverage.unhandled_targets()
    assert "0 no spec covers" in coverage.headline() and "1 not compared" in coverage.headline()
    assert coverage.to_json()["not_compared"] == 1 and coverage.to_json()["unhandled"] == 0
    assert "empty_like       runs as is: aten.empty_like.default allocates uninitialised memory" in \
        describe_plan(result.plan, coverage)
