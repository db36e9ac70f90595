"""Rules at the edges of the ranks and sizes their ops accept: 0-d tensors,
zero-size dims and data-dependent shapes are served where the rule can say them, every served
strategy verified at the call, and refused with a reader's reason otherwise; never a raw
exception."""

from __future__ import annotations

import pytest
import torch

from shardverify import DeviceMesh
from shardverify.capture.export import export_graph
from shardverify.capture.fx import trace
from shardverify.errors import HandlerError, ShardVerifyError
from shardverify.strategies.for_node import strategies_for_node
from shardverify.verify.on_demand import verify_node

MESH = DeviceMesh((2, 2))


class _Call(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _one(fn, *values, capture="fx"):
    """The graph of ``fn`` over ``values`` (tensors) and its one op node."""
    if capture == "export":
        graph_module = export_graph(_Call(fn), values)
    else:
        names = ", ".join(f"x{i}" for i in range(len(values)))
        namespace: dict = {}
        exec(f"def forward(self, {names}):\n    return self.fn({names})\n", namespace)   # noqa: S102
        module = type("Call", (_Call,), {"forward": namespace["forward"]})(fn)
        graph_module = trace(module, {f"x{i}": v for i, v in enumerate(values)})
    node = next(n for n in graph_module.graph.nodes if n.op in ("call_function", "call_method")
                and "tensor_meta" in n.meta)
    return graph_module, node


def _verified(fn, *values, capture="fx", mesh=MESH) -> int:
    graph_module, node = _one(fn, *values, capture=capture)
    results = verify_node(graph_module, node, mesh)
    wrong = [r.strategy for r in results if not r.passed]
    assert results and not wrong, wrong
    return len(results)


EDGES = {   # the calls that raised IndexError inside the rule engine
    "cumsum 0-d": (lambda x: torch.cumsum(x, 0), (torch.randn(()),)),
    "softmax 0-d": (lambda x: torch.softmax(x, 0), (torch.randn(()),)),
    "log_softmax 0-d": (lambda x: torch.log_softmax(x, -1), (torch.randn(()),)),
    "amax 0-d": (lambda x: torch.amax(x, 0), (torch.randn(()),)),
    "transpose 0-d": (lambda x: torch.transpose(x, 0, 0), (torch.randn(()),)),
    "unflatten zero-size": (lambda x: torch.unflatten(x, 1, (2, 0, 0, 0)), (torch.randn(4, 0),)),
}


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("name", sorted(EDGES))
def test_zero_dim_and_empty_calls_are_served_and_verified(name, capture):
    fn, values = EDGES[name]
    _verified(fn, *values, capture=capture)


def test_gather_of_a_0d_tensor_yields_strategies():
    """Its ids must all be 0, which verification on demand does not draw yet (it raises a
    HandlerError naming the op's refusal): the rule itself is instantiated."""
    graph_module, node = _one(lambda x, i: torch.gather(x, 0, i), torch.randn(()), torch.zeros((), dtype=torch.int64))
    strategies = strategies_for_node(graph_module, node.name, MESH, on_demand=_PassThrough())
    assert strategies[-1].name == "- x - -> -"


def test_an_empty_view_keeps_the_shared_leading_dim_shardable():
    """[4, 0] unflattened: the leading 4 passes its shard, the empty dims stay whole."""
    graph_module, node = _one(lambda x: torch.unflatten(x, 1, (2, 0)), torch.randn(4, 0))
    names = [s.name for s in strategies_for_node(graph_module, node.name, MESH, on_demand=_PassThrough())]
    assert "S0R -> S0RR" in names and all("S" not in n.split("->")[1][2:] for n in names), names


class _PassThrough:
    """An on-demand verifier that verifies nothing (to read the rule's strategies only)."""

    cache_key = "pass-through"

    def __call__(self, call):
        return call.strategies


def test_a_data_dependent_shape_is_refused_with_its_reason():
    graph_module, _ = _one(lambda x, m: x[m], torch.randn(4, 3), torch.rand(4, 3) > 0.5, capture="export")
    node = next(n for n in graph_module.graph.nodes if str(n.target) == "aten.index.Tensor")
    with pytest.raises(HandlerError, match=r"node 'index' has a data-dependent shape \[u\d+\].*boolean mask"):
        strategies_for_node(graph_module, node.name, MESH)
    reader = next(n for n in graph_module.graph.nodes if str(n.target) == "aten.sym_size.int")
    with pytest.raises(HandlerError, match=r"its input 'index'\) has a data-dependent shape"):
        strategies_for_node(graph_module, reader.name, MESH)


F = torch.nn.functional
RANKS = {   # ranks the specs' grids (4-d images, [B, S] ids) never held, served by their "..." terms
    "conv2d unbatched": (lambda x, w, b: F.conv2d(x, w, b), (torch.randn(4, 5, 5), torch.randn(4, 4, 3, 3),
                                                            torch.randn(4))),
    "max_pool2d unbatched": (lambda x: F.max_pool2d(x, 2), (torch.randn(4, 4, 4),)),
    "adaptive_avg_pool2d unbatched": (lambda x: F.adaptive_avg_pool2d(x, 2), (torch.randn(4, 4, 4),)),
    "batch_norm eval [N, C]": (lambda x, m, v: F.batch_norm(x, m, v, training=False),
                               (torch.randn(4, 6), torch.randn(6), torch.rand(6) + 0.5)),
    "batch_norm train [N, C, L]": (lambda x, m, v: F.batch_norm(x, m, v, training=True),
                                   (torch.randn(4, 6, 3), torch.randn(6), torch.rand(6) + 0.5)),
    "matmul vector @ matrix": (torch.matmul, (torch.randn(4), torch.randn(4, 6))),
    "matmul batch @ vector": (torch.matmul, (torch.randn(2, 6, 4), torch.randn(4))),
    "matmul vector @ vector": (torch.matmul, (torch.randn(6), torch.randn(6))),
    "einsum one operand": (lambda x: torch.einsum("bij->jb", x), (torch.randn(2, 4, 3),)),
    "addmm 2-d bias": (torch.addmm, (torch.randn(4, 6), torch.randn(4, 2), torch.randn(2, 6))),
    "addmm 0-d bias": (torch.addmm, (torch.randn(()), torch.randn(4, 2), torch.randn(2, 6))),
    "baddbmm [1] input": (torch.baddbmm, (torch.randn(1), torch.randn(2, 4, 2), torch.randn(2, 2, 6))),
    "index_select 1-d input": (lambda x, i: torch.index_select(x, 0, i), (torch.randn(8), torch.tensor([1, 5, 2, 7]))),
    "embedding 1-d ids": (lambda i, w: F.embedding(i, w), (torch.randint(0, 8, (6,)), torch.randn(8, 4))),
}


@pytest.mark.parametrize("name", sorted(RANKS))
def test_ranks_the_grid_never_held_are_served_and_verified(name):
    fn, values = RANKS[name]
    capture = "export" if name.startswith("batch_norm") else "fx"   # its specs name the module and aten's op
    graph_module, node = _one(fn, *values, capture=capture)
    assert len(strategies_for_node(graph_module, node.name, MESH, on_demand=_PassThrough())) > 1   # something shards
    _verified(fn, *values, capture=capture)


def test_optional_factors_are_held_where_the_tensor_has_the_dim():
    from shardverify.strategies.rules.notation import parse_equation
    from shardverify.strategies.rules.rule import bind

    eq = parse_equation("...m?k,...kn?->...m?n?")
    assert parse_equation(str(eq)) == eq and eq.letters == ("m", "k", "n")
    vector_matrix = bind(eq, [(4,), (4, 6)], [(6,)])
    assert vector_matrix.inputs == ((("k",),), (("k",), ("n",))) and vector_matrix.outputs == ((("n",),),)
    batch_vector = bind(eq, [(2, 6, 4), (4,)], [(2, 6)])
    assert batch_vector.outputs == ((("_b0",), ("m",)),) and dict(batch_vector.reduce) == {"k": "sum"}
    bias = bind(parse_equation("m? n?, m k, k n -> m n"), [(6,), (4, 2), (2, 6)], [(4, 6)])
    assert bias.inputs[0] == (("n",),)          # held from the right, as broadcasting aligns


def test_a_rank_the_rule_cannot_say_is_refused_naming_the_spec_and_the_operand():
    graph_module, node = _one(lambda x, t: F.cross_entropy(x, t), torch.randn(3), torch.tensor(1))
    with pytest.raises(ShardVerifyError, match=r"cross_entropy \(specs/cross_entropy.yaml:\d+\): node 'cross_entropy': "
                       r"operand 'input' of shape \[3\] \(rule n c \.\.\., n \.\.\. -> \) has 1 dim\(s\); the rule describes it with at least 2, so it "
                       r"does not cover a tensor of 1 dim\(s\)"):
        strategies_for_node(graph_module, node.name, MESH, on_demand=_PassThrough())
