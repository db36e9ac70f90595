"""Values an op leaves undefined, which a check never compares.

Nodes whose value is uninitialised memory (``torch.empty_like(x)``, ``x.new_empty(...)``, their
ATen overloads): the contents are whatever the allocator returned, different on every rank and on
the single device; the consumers that write into them (a ``copy_``, a fill, an indexed store) and
read them are compared instead.

Tuple outputs an op defines only in some of its modes (:func:`undefined_outputs`): batch norm in
eval mode computes no saved statistics (the CPU kernel returns them empty, the meta kernel as
``[C]``); ``_embedding_bag`` fills ``offset2bag`` and ``bag_size`` for the mean and max modes and
``max_indices`` for max mode only (else scratch, of another shape on the CPU than on meta). Their
values are no result of the call, so only the defined outputs are compared."""

from __future__ import annotations

import torch
from torch import fx

from shardverify.capture.schema import schema_values

__all__ = ["is_uninitialised", "uninitialised_nodes", "undefined_outputs"]

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


# ATen op -> the tuple outputs it never defines
_UNDEFINED: dict[str, tuple[int, ...]] = {
    "aten::_native_batch_norm_legit_no_training": (1, 2),   # eval mode: no saved statistics
}
# ATen op -> (the argument that decides, its default, {its value: the tuple outputs left undefined})
_UNDEFINED_BY_ARGUMENT: dict[str, tuple[str, object, dict]] = {
    "aten::_native_batch_norm_legit": ("training", True, {False: (1, 2)}),
    "aten::native_batch_norm": ("training", True, {False: (1, 2)}),
    **{name: ("mode", 0, {0: (1, 2, 3), 1: (3,)})      # 0 sum, 1 mean, 2 max: every output defined
       for name in ("aten::_embedding_bag", "aten::_embedding_bag_forward_only", "aten::embedding_bag")},
}
#: the ops above by their bare names, which a torch builtin of the same op has (torch.native_batch_norm)
_NAMED = frozenset(name.removeprefix("aten::") for name in (*_UNDEFINED, *_UNDEFINED_BY_ARGUMENT))


def undefined_outputs(node: fx.Node) -> frozenset[int]:
    """The positions of the node's tuple outputs whose values its op leaves undefined at this call
    (empty for every other op): a check neither compares them nor takes gradients through them.
    A torch builtin of an ATen op's name (``torch.native_batch_norm``, as torch.fx records it) is
    read as that op's default overload, whose positions it takes."""
    overload = _overload(node)
    if overload is None:
        return frozenset()
    name = overload.name()
    if name in _UNDEFINED:
        return frozenset(_UNDEFINED[name])
    if name not in _UNDEFINED_BY_ARGUMENT:
        return frozenset()
    argument, default, undefined = _UNDEFINED_BY_ARGUMENT[name]
    return frozenset(undefined.get(schema_values(overload, node.args, node.kwargs).get(argument, default), ()))


def _overload(node: fx.Node) -> torch._ops.OpOverload | None:
    if node.op != "call_function":
        return None
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target
    name = getattr(node.target, "__name__", None)
    if name not in _NAMED or getattr(torch, name, None) is not node.target:
        return None
    return getattr(getattr(torch.ops.aten, name), "default", None)
