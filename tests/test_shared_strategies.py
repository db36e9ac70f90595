"""A producer whose inputs are all graph inputs or attributes is read for its layouts once per
process, not once per graph: a spec's following op is checked in one graph per case, each with its
own copy of the same predecessor."""

from collections import OrderedDict

import pytest
import torch

from shardverify import DeviceMesh, strategies_for_node, trace
from shardverify.strategies import by_value, for_node


class LinearThen(torch.nn.Module):
    def __init__(self, reduce, linear=None):
        super().__init__()
        self.linear = linear if linear is not None else torch.nn.Linear(16, 32, bias=False)
        self.reduce = reduce

    def forward(self, input):
        return self.reduce(self.linear(input))


def _graph(reduce, linear=None, shape=(4, 4, 16)):
    gm = trace(LinearThen(reduce, linear), meta_args={"input": torch.empty(shape, device="meta")})
    node = next(n for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
    return gm, node.name


@pytest.fixture
def derivations(monkeypatch):
    """The nodes whose strategies were derived, in order, with an empty shared store."""
    monkeypatch.setattr(by_value, "_SHARED", OrderedDict())
    derived = []
    real = for_node.handler_strategies

    def counted(handler, graph_module, node, *args, **kwargs):
        derived.append(node.name)
        return real(handler, graph_module, node, *args, **kwargs)

    monkeypatch.setattr(for_node, "handler_strategies", counted)
    return derived


def _key(gm, name="linear", mesh=DeviceMesh((2, 2))):
    node = for_node.find_node(gm, name)
    return by_value.value_key(gm, node, for_node.handler_for_node(node, gm), (mesh,))


def test_graphs_calling_the_same_producer_derive_its_layouts_once_and_offer_what_each_would_alone(
        derivations, monkeypatch):
    mesh = DeviceMesh((2, 2))
    graphs = [_graph(lambda x: torch.sum(x, 0)), _graph(lambda x: x.sum(-1, keepdim=True)),
              _graph(lambda x: torch.sum(x))]
    shared = [strategies_for_node(gm, name, mesh).names for gm, name in graphs]
    assert derivations.count("linear") == 1, derivations
    assert len(derivations) == 4             # each sum, and the Linear once
    producers = [for_node._layouts(gm, for_node.find_node(gm, "linear"), mesh) for gm, _ in graphs]
    assert all(list(p) == list(producers[0]) for p in producers)
    assert [p.node for p in producers] == [for_node.find_node(gm, "linear") for gm, _ in graphs]

    monkeypatch.setattr(for_node, "value_key", lambda *args: None)      # every graph on its own
    alone = [strategies_for_node(gm, name, mesh).names for gm, name in
             [_graph(lambda x: torch.sum(x, 0)), _graph(lambda x: x.sum(-1, keepdim=True)), _graph(lambda x: torch.sum(x))]]
    assert shared == alone
    assert derivations.count("linear") == 4


def test_another_mesh_or_other_shapes_derive_again(derivations):
    gm, name = _graph(lambda x: torch.sum(x, 0))
    strategies_for_node(gm, name, DeviceMesh((2, 2)))
    gm, name = _graph(lambda x: torch.sum(x, 0))
    strategies_for_node(gm, name, DeviceMesh((4,)))
    gm, name = _graph(lambda x: torch.sum(x, 0), shape=(8, 4, 16))
    strategies_for_node(gm, name, DeviceMesh((4,)))
    assert derivations.count("linear") == 3


def test_the_key_tells_apart_what_the_strategies_depend_on():
    plain = _key(_graph(torch.sum)[0])
    assert plain is not None and plain == _key(_graph(lambda x: x.sum(1))[0])
    assert plain != _key(_graph(torch.sum, torch.nn.Linear(16, 32, bias=True))[0])       # another operand
    assert plain != _key(_graph(torch.sum, torch.nn.Linear(16, 8, bias=False))[0])       # another weight shape
    assert plain != _key(_graph(torch.sum, shape=(2, 4, 16))[0])                         # another input shape
    assert plain != _key(_graph(torch.sum)[0], mesh=DeviceMesh((4,)))
    evaluating = torch.nn.Linear(16, 32, bias=False).eval()
    assert plain != _key(_graph(torch.sum, evaluating)[0])                               # a public attribute


def test_what_the_key_cannot_hold_is_derived_per_graph():
    hooked = torch.nn.Linear(16, 32, bias=False)
    hooked.register_forward_hook(lambda module, args, out: out * 2)
    assert _key(_graph(torch.sum, hooked)[0]) is None
    gm, name = _graph(torch.sum)
    assert _key(gm, name) is None            # its input is computed in the graph


def test_the_store_is_bounded(monkeypatch):
    monkeypatch.setattr(by_value, "_SHARED", OrderedDict())
    monkeypatch.setattr(by_value, "_MOST", 2)
    for k in range(5):
        by_value.shared(("key", k), None, lambda: [])
    assert list(by_value._SHARED) == [("key", 3), ("key", 4)]
    made = []
    assert by_value.shared(None, None, lambda: made.append(1) or ["x"]) == ["x"]
    assert by_value.shared(None, None, lambda: made.append(1) or ["x"]) == ["x"] and made == [1, 1]


def _call_key(gm, name):
    return by_value.call_key(gm, for_node.find_node(gm, name))


@pytest.fixture
def measured(monkeypatch):
    """The local shapes each meta call measured, in order, with an empty store of calls."""
    from shardverify.strategies.generators import common

    monkeypatch.setattr(by_value, "_CALLS", OrderedDict())
    shapes = []
    real = common._counted_call

    def counted(ctx, module, inputs, sizes, *args, **kwargs):
        shapes.append((ctx.node.name, tuple(sizes[d.name] for d in inputs)))
        return real(ctx, module, inputs, sizes, *args, **kwargs)

    monkeypatch.setattr(common, "_counted_call", counted)
    return shapes


def test_a_call_another_graph_made_on_the_same_local_shapes_is_measured_once(measured, monkeypatch):
    mesh = DeviceMesh((2, 2, 2))
    first = strategies_for_node(*_graph(lambda x: torch.sum(x, 0)), mesh)
    made = len(measured)
    assert made and any(name.startswith("sum") for name, _ in measured)
    again = strategies_for_node(*_graph(lambda x: torch.sum(x, 0)), mesh)
    assert len(measured) == made             # the second graph's sum measured nothing
    other = strategies_for_node(*_graph(lambda x: torch.sum(x, 1)), mesh)
    assert len(measured) > made              # another call: measured
    # what a graph is offered is what it is offered with nothing shared
    monkeypatch.setattr(by_value, "call_key", lambda *args: None)
    alone = strategies_for_node(*_graph(lambda x: torch.sum(x, 0)), mesh)
    assert [(s.name, s.compute_cost, s.memory_cost, s.communication_cost) for s in again] == \
        [(s.name, s.compute_cost, s.memory_cost, s.communication_cost) for s in alone] == \
        [(s.name, s.compute_cost, s.memory_cost, s.communication_cost) for s in first]
    assert other.names != first.names


def test_the_call_key_holds_the_call_not_the_graph():
    sum0 = _call_key(*_graph(lambda x: torch.sum(x, 0)))
    assert sum0 is not None and sum0 == _call_key(*_graph(lambda x: torch.sum(x, 0), shape=(2, 4, 16)))
    assert sum0 != _call_key(*_graph(lambda x: torch.sum(x, 1)))                      # another argument
    assert sum0 != _call_key(*_graph(lambda x: torch.sum(x, 0, keepdim=True)))
    assert _call_key(*_graph(lambda x: x.pow(2))) != _call_key(*_graph(lambda x: x.pow(2.0)))   # 2 and 2.0
    gm, _ = _graph(torch.sum)
    linear = _call_key(gm, "linear")
    assert linear is not None and linear == _call_key(_graph(torch.sum)[0], "linear")
    assert linear != _call_key(_graph(torch.sum, torch.nn.Linear(16, 8, bias=False))[0], "linear")
    hooked = torch.nn.Linear(16, 32, bias=False)
    hooked.register_forward_hook(lambda module, args, out: out * 2)
    assert _call_key(_graph(torch.sum, hooked)[0], "linear") is None     # a hook may read anything
    assert by_value.call_key(gm, next(n for n in gm.graph.nodes if n.op == "placeholder")) is None


def test_layouts_are_one_object_each_and_forget_lets_them_and_the_calls_go(measured):
    from shardverify.sharding.sharding_spec import ShardingSpec, interned

    spec = interned((2, 2), (4, 8), ((0, (0,)),))
    assert spec is interned((2, 2), (4, 8), ((0, (0,)),)) and spec == ShardingSpec((2, 2), (4, 8), ((0, (0,)),))
    assert spec is not interned((2, 2), (4, 8), ((1, (0,)),))
    strategies_for_node(*_graph(lambda x: torch.sum(x, 0)), DeviceMesh((2, 2)))
    assert by_value._CALLS
    by_value.forget()
    assert not by_value._CALLS and spec is not interned((2, 2), (4, 8), ((0, (0,)),))
