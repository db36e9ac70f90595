"""Nodes whose value is uninitialised memory (``torch.empty_like(x)``, ``x.new_empty(...)``, their
ATen overloads): the contents are whatever the allocator returned, different on every rank and on
the single device, so a check never compares them; the consumers that write into them (a
``copy_``, a fill, an indexed store) and read them are compared instead."""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["is_uninitialised", "uninitialised_nodes"]

_FUNCTIONS = (torch.empty, torch.empty_like, torch.empty_strided)
_METHODS = ("new_empty", "new_empty_strided")
_ATEN = ("aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
         "aten::empty_permuted")


def is_uninitialised(node: fx.Node) -> bool:
    """Does ``node`` allocate a tensor without writing its values?"""
    if node.op == "call_method":
        return node.target in _METHODS
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target.name() in _ATEN
    return any(node.target is f for f in _FUNCTIONS)


def uninitialised_nodes(graph_module: fx.GraphModule) -> frozenset[str]:
    """The names of the graph's nodes that allocate uninitialised memory."""
    return frozenset(node.name for node in graph_module.graph.nodes if is_uninitialised(node))
