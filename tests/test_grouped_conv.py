"""Grouped and depthwise convolution: ``size_params`` binds a factor's size from a call parameter
(conv's ``groups``) and has each rank pass its own block's size there, at a function's argument or
a module's attribute; the optional output dims no input names (a conv's ``od?``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardverify import DeviceMesh
from shardverify.capture.export import export_graph
from shardverify.capture.fx import trace
from shardverify.strategies.for_node import strategies_for_node
from shardverify.strategies.rules.notation import parse_equation
from shardverify.strategies.rules.rule import bind
from shardverify.verify.on_demand import verify_node

MESH = DeviceMesh((2,))


class _Depthwise(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1, groups=4)

    def forward(self, x):
        return self.conv(x)


class _Grouped1d(torch.nn.Module):
    def forward(self, x, w):
        return F.conv1d(x, w, None, 1, 1, 1, 2)


def _node(graph_module, op: str):
    return next(n for n in graph_module.graph.nodes if n.op == op)


def _group_sharded(strategies):
    return [s for s in strategies if s.local_args]


def test_a_rank_holding_whole_groups_runs_its_own_count_of_them_module_attribute():
    graph_module = trace(_Depthwise(), {"x": torch.randn(2, 4, 5, 5)})
    node = _node(graph_module, "call_module")
    sharded = _group_sharded(strategies_for_node(graph_module, node.name, MESH))
    assert sharded, "the depthwise conv offers no channel shard"
    assert {(a.locator.kind, a.locator.key, a.value) for s in sharded for a in s.local_args} == {("attr", "groups", 2)}
    results = verify_node(graph_module, node, MESH)
    assert results and all(r.passed for r in results), [r.strategy for r in results if not r.passed]


def test_a_function_passes_its_own_groups_and_an_export_covers_1d():
    x, w = torch.randn(2, 4, 6), torch.randn(6, 2, 3)
    for graph_module, op in ((trace(_Grouped1d(), {"x": x, "w": w}), "call_function"),
                             (export_graph(_Grouped1d(), (x, w)), "call_function")):
        node = next(n for n in graph_module.graph.nodes if n.op == op and "conv" in str(n.target))
        sharded = _group_sharded(strategies_for_node(graph_module, node.name, MESH))
        assert sharded and all(a.value == 1 for s in sharded for a in s.local_args)   # 2 groups over 2 ranks
        results = verify_node(graph_module, node, MESH)
        assert results and all(r.passed for r in results), [r.strategy for r in results if not r.passed]


def test_without_the_local_groups_the_group_shard_would_be_wrong():
    # the rule's local argument is what makes it right: a rank's half of the channels with the call's
    # groups=4 is not the rank's half of the output (the op refuses it outright)
    x, w = torch.randn(1, 4, 5, 5), torch.randn(8, 1, 3, 3)
    try:
        F.conv2d(x[:, :2], w[:4], None, 1, 1, 1, 4)
    except RuntimeError:
        pass
    else:
        raise AssertionError("conv2d took a half of the channels with the global groups")
    assert torch.allclose(F.conv2d(x[:, :2], w[:4], None, 1, 1, 1, 2), F.conv2d(x, w, None, 1, 1, 1, 4)[:, :4])


def test_size_params_fix_a_compound_factor_and_output_only_optional_dims_follow_the_rank():
    eq = parse_equation("n (g i) d? h? w, (g o) i kd? kh? kw, (g o) -> n (g o) od? oh? ow")
    rule = bind(eq, [(2, 6, 9), (9, 2, 3), (9,)], [(2, 9, 7)], sizes={"g": 3})
    assert rule.size["g"] == 3 and rule.size["i"] == 2 and rule.size["o"] == 3
    assert rule.outputs == ((("n",), ("g", "o"), ("ow",)),)       # 1-d: no od, no oh
    rule3 = bind(eq, [(2, 6, 4, 5, 5), (9, 2, 3, 3, 3), (9,)], [(2, 9, 2, 3, 3)], sizes={"g": 3})
    assert rule3.outputs[0][2:] == (("od",), ("oh",), ("ow",))
