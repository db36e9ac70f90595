"""Verification on demand (shardverify/verify/on_demand.py): a call outside its spec's grid is
verified where it is met; its strategies that fail are a rule defect, never served, and named."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
import pytest

from shardverify.strategies.rules.sources import parse_rule
from shardverify import DeviceMesh, trace
from shardverify.errors import HandlerError
from shardverify.plan.coverage import classify_nodes
from shardverify.plan.verify import verify_plan
from shardverify.strategies.for_node import strategies_for_node
from shardverify.strategies.handlers.base import (
    HandlerDef,
    OperandDecl,
    ParamDecl,
    register_handler,
    registered_handlers,
    unregister_handler,
)
from shardverify.strategies.handlers.serving import handler_for_node, outside_grid
from shardverify.verify.on_demand import OnDemandVerifier, verify_node

MESH = DeviceMesh((2, 2))


class Fn(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _graph(fn, *shapes, dtypes=None):
    dtypes = dtypes or [torch.float32] * len(shapes)
    meta = {f"x{i}": torch.empty(s, dtype=d, device="meta") for i, (s, d) in enumerate(zip(shapes, dtypes))}
    graph_module = trace(_Positional(fn, len(shapes)), meta_args=meta)
    node = next(n for n in graph_module.graph.nodes if n.op in ("call_function", "call_method", "call_module"))
    return graph_module, node


def _Positional(fn, count):
    """A module whose forward takes ``count`` named inputs and calls ``fn`` on them."""
    names = ", ".join(f"x{i}" for i in range(count))
    namespace: dict = {}
    exec(f"def forward(self, {names}):\n    return self.fn({names})\n", namespace)
    return type("Call", (Fn,), {"forward": namespace["forward"]})(fn)


@pytest.fixture
def planted():
    """Wrong rules right only at the values their grid verified: triu written as pointwise
    (verified at diagonal=-8, the identity on 8x8) and max pooling that shards the rows
    (verified at kernel 1: each pixel its own window), in place of the shipped avg_pool2d spec."""
    shipped = registered_handlers()["avg_pool2d"]
    unregister_handler(shipped.name)
    triu = register_handler(HandlerDef(
        name="triu_pointwise", targets=(torch.triu,), spec_file="specs/triu_pointwise.yaml",
        operands=(OperandDecl("input", "input", 0, "input"), OperandDecl("output", "output")),
        params=(ParamDecl("diagonal", 1, "diagonal", 0),), generator="rules", rule=parse_rule({"pointwise": True}),
        bindings=((torch.triu, (("diagonal", (-8,)),)),)))
    pool = register_handler(HandlerDef(
        name="avg_pool_rows", targets=(F.avg_pool2d,), spec_file="specs/avg_pool_rows.yaml",
        operands=(OperandDecl("input", "input", 0, "input"), OperandDecl("output", "output")),
        params=(ParamDecl("kernel_size", 1, "kernel_size", None), ParamDecl("stride", 2, "stride", None),
                ParamDecl("padding", 3, "padding", 0)),
        generator="rules", rule=parse_rule({"pointwise": True}),
        bindings=((F.avg_pool2d, (("kernel_size", (1,)), ("stride", (1,)), ("padding", (0,)))),)))
    yield triu, pool
    unregister_handler(triu.name)
    unregister_handler(pool.name)
    register_handler(shipped)


def test_a_wrong_rule_is_never_served_wrong_at_another_value(planted, tmp_path):
    graph_module, node = _graph(lambda x: torch.triu(x, 1), (8, 8))
    assert "passes diagonal=1" in outside_grid(handler_for_node(node, graph_module), node, graph_module)
    with pytest.raises(HandlerError, match="--verified-only"):
        strategies_for_node(graph_module, node.name, MESH)       # strict: refused
    verifier = OnDemandVerifier(cache_dir=tmp_path)
    with verifier:
        served = strategies_for_node(graph_module, node.name, MESH, on_demand=verifier)
    assert [s.name for s in served] == ["RR -> RR"]              # every sharded layout of triu is wrong
    (record,) = verifier.records
    assert record.offered > 1 and len(record.failed) == record.offered - 1
    defect = record.defect()
    assert defect.startswith("specs/triu_pointwise.yaml: ") and "wrong at torch.triu(float32[8, 8], 1)" in defect
    assert "'S0R -> S0R'" in defect and "not offered" in defect
    assert any("rule defect: specs/triu_pointwise.yaml" in line for line in verifier.lines())


def test_a_row_sharded_pool_keeps_only_the_layouts_that_hold_at_the_call(planted, tmp_path):
    graph_module, node = _graph(lambda x: F.avg_pool2d(x, 3, stride=1, padding=1), (4, 6, 8, 8))
    with OnDemandVerifier(cache_dir=tmp_path) as verifier:
        served = list(strategies_for_node(graph_module, node.name, MESH, on_demand=verifier))
    wrong = {name for name, _ in verifier.records[0].failed}
    assert wrong and not {s.name for s in served} & wrong
    # the batch and channel shards hold (each rank pools its own planes), the rows and columns never
    sharded = [set(dict(s.get_sharding_spec_by_name(s.inputs[0].name).dim_partition)) for s in served]
    assert {0, 1} <= set().union(*sharded) and not any(dims & {2, 3} for dims in sharded)
    results = verify_node(graph_module, node, MESH)                # every strategy, as the verifier saw them
    assert {r.strategy for r in results if not r.passed} == wrong


def test_verdicts_are_cached_on_disk(tmp_path):
    graph_module, node = _graph(lambda x: torch.softmax(x, -1, dtype=torch.float64), (4, 6, 8))
    first = OnDemandVerifier(cache_dir=tmp_path)
    with first:
        served = [s.name for s in strategies_for_node(graph_module, node.name, MESH, on_demand=first)]
    assert first.summary()["verified"] == 1 and first.summary()["cache_hits"] == 0
    assert first.summary()["strategies_wrong"] == 0
    graph_module, node = _graph(lambda x: torch.softmax(x, -1, dtype=torch.float64), (4, 6, 8))   # a new capture
    second = OnDemandVerifier(cache_dir=tmp_path)
    again = [s.name for s in strategies_for_node(graph_module, node.name, MESH, on_demand=second)]
    assert again == served
    assert second.summary()["verified"] == 0 and second.summary()["cache_hits"] == 1
    assert list(tmp_path.rglob("*.json"))


def test_a_random_call_is_served_only_where_every_rank_makes_the_whole_draw(tmp_path):
    """dropout in training draws: every call of it draws from one fixed generator state, so a
    rank making the whole result matches the single device and a rank drawing its block does not
    (a rank holding a piece of a partial input draws the whole mask too: linear and monotone in
    its input under one mask, those pass)."""
    graph_module, node = _graph(lambda x: torch.ops.aten.dropout.default(x, 0.5, True), (8, 8))
    with OnDemandVerifier(cache_dir=tmp_path) as verifier:
        served = strategies_for_node(graph_module, node.name, MESH, on_demand=verifier)
    assert "RR -> RR" in [s.name for s in served]
    assert all(not spec.dim_partition for s in served for _, spec in s.sharding_specs), [s.name for s in served]


def test_a_default_spelled_out_is_the_default():
    # torch.fx records F.max_pool2d's return_indices=False as a keyword; sdpa's defaults spelled out
    graph_module, node = _graph(lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=False), (2, 4, 8, 8))
    assert node.kwargs.get("return_indices") is False
    assert outside_grid(handler_for_node(node, graph_module), node, graph_module) is None
    graph_module, node = _graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.0,
                                                                                is_causal=False),
                                (2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16))
    assert outside_grid(handler_for_node(node, graph_module), node, graph_module) is None


def test_verify_node_takes_what_a_grid_cannot_say():
    # ids into a table of its own size (the spec's ids are drawn below its grid's 16 rows: here
    # below the call's 11, every row looked up), and a zero-size dim
    graph_module, node = _graph(lambda ids, table: F.embedding(ids, table), (3, 5), (11, 6),
                                dtypes=[torch.int64, torch.float32])
    results = verify_node(graph_module, node, MESH)
    assert len(results) > 10 and all(r.passed for r in results)
    graph_module, node = _graph(lambda x: torch.relu(x), (4, 0, 6))
    results = verify_node(graph_module, node, MESH)
    assert results and all(r.passed for r in results)


def test_counts_that_cut_a_dim_are_drawn_for_a_keyword_only_tensor():
    """segment_reduce's keyword-only lengths must add up to the rows they cut: ids drawn in a range
    never do, so the search goes on to counts that cut a dim of the data; offsets, to bounds."""
    for keyword in ("lengths", "offsets"):
        graph_module, node = _graph(lambda x, n, k=keyword: torch.ops.aten.segment_reduce.default(x, "max", **{k: n}),
                                    (7, 4), (3,), dtypes=[torch.float32, torch.int64])
        results = verify_node(graph_module, node, MESH)
        assert len(results) > 1 and all(r.passed for r in results), (keyword, results)


def test_square_matrices_are_made_positive_definite_where_the_op_needs_it():
    """cholesky refuses a normal draw (not positive definite): the search ends on matrices that are."""
    graph_module, node = _graph(lambda a: torch.cholesky(a), (6, 5, 5), dtypes=[torch.float64])
    results = verify_node(graph_module, node, MESH)
    assert len(results) > 1 and all(r.passed for r in results)


def test_a_scatter_whose_index_is_smaller_than_its_input_keeps_that_dim_whole():
    """scatter_add of a [3, 4, 5] source into the first 3 of 6 rows along dim 2: the rows' dim is
    whole in every tensor (a rank holding rows 3-5 would add the source's rows 0-2 into them), the
    dim all hold alike passes its shard; every strategy offered verifies."""
    graph_module, node = _graph(lambda x, i, s: torch.scatter_add(x, 2, i, s), (6, 4, 5), (3, 4, 5), (3, 4, 5),
                                dtypes=[torch.float32, torch.int64, torch.float32])
    outputs = {s.name.split(" -> ")[1].split(" |")[0] for s in strategies_for_node(graph_module, node.name, MESH)}
    assert outputs == {"RRR", "RS0R", "RS1R", "RS01R", "RS10R"}, outputs   # the rows' dim never cut
    results = verify_node(graph_module, node, MESH)
    assert len(results) > 1 and all(r.passed for r in results)


def test_a_plan_serves_a_call_outside_the_grid_and_counts_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDVERIFY_CACHE_DIR", str(tmp_path))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 16)

        def forward(self, x):
            return torch.log_softmax(self.fc(x), -1, dtype=torch.float64)

    model, x = Model(), torch.randn(4, 8)
    result = verify_plan(model, (x,), (2,), shard_weights=True)
    assert result.passed
    assert result.coverage.on_demand["verified"] == 1 and result.coverage.count("refused") == 0
    assert any("verified on demand: 1 call(s)" in line for line in result.coverage.lines())
    again = verify_plan(model, (x,), (2,), shard_weights=True)
    assert again.coverage.on_demand["verified"] == 0 and again.coverage.on_demand["cache_hits"] == 1
    strict = verify_plan(model, (x,), (2,), verified_only=True)
    assert strict.coverage.on_demand is None and strict.coverage.count("refused") == 1


def test_a_weight_kept_as_a_buffer_is_no_gradient_to_check():
    """F.linear(x, self.w) with ``w`` a buffer: the call reads module state that takes no
    gradient, so no strategy is failed for the weight gradient it never owes."""

    class BufferWeight(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("w", torch.randn(6, 8))

        def forward(self, x):
            return F.linear(x, self.w)

    graph_module = trace(BufferWeight(), {"x": torch.empty(4, 8, device="meta")})
    node = next(n for n in graph_module.graph.nodes if n.op == "call_function")
    results = verify_node(graph_module, node, MESH)
    assert len(results) > 10 and all(r.passed for r in results), [r.strategy for r in results if not r.passed]


# ---------------------------------------------------------------- the verdict cache is evidence, not a verdict

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("edit", [
    lambda record: {**record, "failed": []},            # the wrong strategies edited away
    lambda record: {"failed": [], "refused": "", "call": record["call"]},   # as the old format had it
    lambda record: {**record, "failed": [1]},
    lambda record: {**record, "failed": "S0R -> S0R"},
    lambda record: {**record, "offered": record["offered"][:1], "failed": []},
    lambda record: DEEP,
    lambda record: "{",
], ids=["failed-emptied", "old-format", "failed-int", "failed-text", "offered-cut", "deep", "half"])
def test_an_edited_verdict_is_verified_again_and_no_wrong_strategy_is_served(planted, tmp_path, edit):
    graph_module, node = _graph(lambda x: torch.triu(x, 1), (8, 8))
    with OnDemandVerifier(cache_dir=tmp_path) as first:
        strategies_for_node(graph_module, node.name, MESH, on_demand=first)
    (path,) = tmp_path.rglob("*.json")
    edited = edit(json.loads(path.read_text()))
    path.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with OnDemandVerifier(cache_dir=tmp_path) as second:
        served = [s.name for s in strategies_for_node(graph_module, node.name, MESH, on_demand=second)]
    assert served == ["RR -> RR"]                 # verified again: every sharded layout of triu fails
    (record,) = second.records
    assert not record.cached and len(record.failed) == record.offered - 1
    assert second.summary()["discarded"] == 1 and str(path) in second.discarded[0]
    assert any("did not check, discarded and verified again" in line for line in second.lines())
    with OnDemandVerifier(cache_dir=tmp_path) as third:   # written anew, whole: believed again
        strategies_for_node(graph_module, node.name, MESH, on_demand=third)
    assert third.records[0].cached and not third.discarded


def test_a_verdict_made_by_other_generator_or_engine_code_is_not_read(monkeypatch, tmp_path):
    from shardverify.verify import on_demand

    graph_module, node = _graph(lambda x: torch.softmax(x, -1, dtype=torch.float64), (4, 6, 8))
    with OnDemandVerifier(cache_dir=tmp_path) as first:
        strategies_for_node(graph_module, node.name, MESH, on_demand=first)
    assert len(on_demand.code_digest()) == 64 and on_demand.code_digest() is on_demand.code_digest()   # once
    monkeypatch.setattr(on_demand, "code_digest", lambda: "0" * 64)    # the generator or engine code changed
    with OnDemandVerifier(cache_dir=tmp_path) as second:
        strategies_for_node(graph_module, node.name, MESH, on_demand=second)
    assert second.summary()["verified"] == 1 and second.summary()["cache_hits"] == 0


def test_without_a_home_there_is_no_verdict_cache_and_it_is_said(monkeypatch, planted, capsys):
    from shardverify.cli.main import main
    from shardverify.features.opinfo.store import default_results_dir
    from shardverify.errors import SpecError
    from shardverify.verify.on_demand import CACHE_ENV, default_cache_dir

    monkeypatch.delenv(CACHE_ENV, raising=False)
    for home in ("", "relative"):
        monkeypatch.setenv("HOME", home)
        assert default_cache_dir() is None           # never /.cache nor a folder relative to where it runs
        with pytest.raises(SpecError, match="give --opinfo-results DIR"):
            default_results_dir()
    graph_module, node = _graph(lambda x: torch.triu(x, 1), (8, 8))
    with OnDemandVerifier() as verifier:
        strategies_for_node(graph_module, node.name, MESH, on_demand=verifier)
    assert verifier.cache_dir is None
    assert any("no verdict cache: $HOME is 'relative'; set $SHARDVERIFY_CACHE_DIR" in line for line in verifier.lines())
    assert main(["verify", "neg", "--opinfo"]) == 2        # where to keep the sweep: one line, no traceback
    assert capsys.readouterr().err == ("error: --opinfo-results: no default folder ($HOME is 'relative'; set "
                                       "$SHARDVERIFY_CACHE_DIR to keep verdicts): give --opinfo-results DIR\n")
    monkeypatch.setenv(CACHE_ENV, "/somewhere")
    assert str(default_cache_dir()) == "/somewhere"


class _MaskedStore(torch.nn.Module):
    def forward(self, x, mask, values):
        return torch.index_put(x, (mask,), values)


def test_a_bool_mask_where_the_grid_drew_ids_is_outside_the_grid(tmp_path):
    """index_put's grid draws its index as ids below the rows; ``x[mask] = v`` (a bool mask, the
    values broadcast along the last dim: PyTorch's OpInfo sample) once took the grid's column
    splits, which are wrong there. Outside the grid, it is verified at the call and those are not
    served."""
    x, values = torch.randn(5, 5), torch.randn(5)
    mask = torch.tensor([True, False, True, True, False])
    gm = trace(_MaskedStore(), {"x": x, "mask": mask, "values": values})
    node = next(n for n in gm.graph.nodes if n.target is torch.index_put)
    assert "passes i0 as bool, where the rule was verified for ids drawn below a size" in \
        outside_grid(handler_for_node(node, gm), node, gm)
    with pytest.raises(HandlerError, match="i0 as bool"):
        strategies_for_node(gm, node.name, DeviceMesh((2, 2)))
    with OnDemandVerifier(cache_dir=tmp_path) as verifier:
        served = {s.name for s in strategies_for_node(gm, node.name, DeviceMesh((2, 2)), on_demand=verifier)}
        assert verifier.records and verifier.records[-1].failed
    assert served and "RS1 x R x R -> RS1" not in served and "RR x R x R -> RR" in served


class _Divide(torch.nn.Module):
    def forward(self, x, count):
        return torch.div(x, count)


def test_an_integer_divisor_where_the_grid_drew_floats_is_outside_the_grid(tmp_path):
    """div's grid draws its divisor as floats, never zero. nanmean divides by a count of int64,
    which can be zero: a partial-sum dividend then gives inf on one rank and -inf on another
    (NaN after the sum) where one device gives inf. The call is verified where it is met and the
    partial strategies are not served; a float divisor stays on the grid."""
    x, count = torch.randn(1, 5, dtype=torch.float64), torch.tensor([[3, 0, 2, 1, 0]])

    def traced(divisor):
        gm = trace(_Divide(), {"x": x, "count": divisor})
        return gm, next(n for n in gm.graph.nodes if n.op == "call_function")

    gm, node = traced(count.double())
    assert outside_grid(handler_for_node(node, gm), node, gm) is None
    gm, node = traced(count)
    assert "passes other as int64, where the rule was verified for float32 tensors" in \
        outside_grid(handler_for_node(node, gm), node, gm)
    with OnDemandVerifier(cache_dir=tmp_path) as verifier:
        served = {s.name for s in strategies_for_node(gm, node.name, MESH, on_demand=verifier)}
        assert verifier.records and verifier.records[-1].failed
    assert served and not any("+P" in name for name in served) and "RS1 x RS1 -> RS1" in served
