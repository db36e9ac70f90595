"""Strategies shared across graphs by value.

A node whose every input is a graph input or an attribute has strategies that depend only on
what the node calls, with which arguments, on which shapes, on which mesh: not on the graph it
sits in. A spec's following op is checked in one graph per case, each with its own copy of the
same predecessor (a Linear of the same shapes), whose hundreds of layouts would be derived again
for every case. The layouts a following op reads of such a node are derived once per process
and handed to every graph calling the same thing on the same shapes (``for_node`` asks only for
those: a node's own, costed strategies are derived in each graph).

The same holds one level down, for what a generator measures of a call on meta tensors of a
layout's local shapes (its FLOPs and output shapes: generators/common.py): the answer depends on
the call and the shapes, not on the graph. A spec's every case, and a model's every layer, make
the same calls on the same local shapes; each is measured once per process (:func:`call_key`,
:func:`shared_call`).

Only what can be keyed completely is shared: a call whose arguments are numbers, strings, dtypes
and the like, or a torch.nn module with no submodules and no hooks (its public attributes and the
shapes of its parameters and buffers in the key). Anything else is derived per graph, as before.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch.fx import GraphModule, Node

from shardverify.capture.call import called_module
from shardverify.capture.meta import output_metas
from shardverify.sharding.sharding_spec import forget_interned
from shardverify.sharding.strategy import ShardingStrategy

__all__ = ["value_key", "shared", "call_key", "shared_call", "forget"]

T = TypeVar("T")

#: key -> (what the key holds by id, the strategies); oldest evicted first
_SHARED: OrderedDict = OrderedDict()
_MOST = 256
#: (call key, the caller's part) -> what the caller measured of that call; oldest evicted first
_CALLS: OrderedDict = OrderedDict()
_MOST_CALLS = 8192
#: node -> its call key (None: not keyable), worked out once per node
_CALL_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SOURCES = ("placeholder", "get_attr")
_PLAIN = (int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class _Unkeyable(Exception):
    """A value the key cannot hold completely: the node's strategies are not shared."""


def value_key(graph_module: GraphModule, node: Node, handler: object, extra: tuple) -> tuple | None:
    """Everything ``node``'s strategies are derived from, or None when that is not known in full
    (an input computed in the graph, an argument or a module the key cannot hold). ``handler``
    is keyed by identity; ``extra`` is the caller's part (the mesh)."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return None
    if any(n.op not in _SOURCES for n in node.all_input_nodes):
        return None
    try:
        return (id(handler), _metas(node), _target(graph_module, node), _frozen(node.args), _frozen(node.kwargs),
                *(_metas(n) for n in node.all_input_nodes), extra)
    except _Unkeyable:
        return None


def shared(key: tuple | None, holds: object, derive: Callable[[], Sequence[ShardingStrategy]]
           ) -> Sequence[ShardingStrategy]:
    """``derive()``'s strategies, derived once per ``key`` (every time when ``key`` is None).
    ``holds`` (the handler) is kept with them, so that no id in the key is reused while they are."""
    if key is None:
        return derive()
    if key in _SHARED:
        _SHARED.move_to_end(key)
        return _SHARED[key][1]
    strategies = tuple(derive())     # strategies are frozen: a tuple of them is safe to hand out
    _SHARED[key] = (holds, strategies)
    if len(_SHARED) > _MOST:
        _SHARED.popitem(last=False)
    return strategies


def call_key(graph_module: GraphModule, node: Node) -> tuple | None:
    """The call ``node`` makes, as a key a node of another graph making the same call shares: its
    kind, its target (a module by its kind, public attributes and tensor shapes) and its recorded
    arguments, each fx node in them a bare place, since the caller gives every operand a value of
    its own; None where that is not known in full (see the module docstring)."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return None
    try:
        return _CALL_KEYS[node]
    except KeyError:
        pass
    try:
        key = (node.op, _target(graph_module, node), _frozen(node.args, places=True),
               _frozen(node.kwargs, places=True))
    except _Unkeyable:
        key = None
    _CALL_KEYS[node] = key
    return key


def shared_call(key: tuple | None, part: tuple, measure: Callable[[], T]) -> T:
    """``measure()``, once per (``key``, ``part``) (every time when ``key`` is None): ``part`` is
    what the caller's answer depends on besides the call (the operands' local shapes and dtypes,
    the local arguments). What ``measure`` raises is not kept."""
    if key is None:
        return measure()
    full = (key, part)
    found = _CALLS.get(full)
    if found is None:
        found = _CALLS[full] = measure()
        if len(_CALLS) > _MOST_CALLS:
            _CALLS.popitem(last=False)
    return found


def forget() -> None:
    """Let every shared derivation, measured call and interned layout go (a measurement that must
    derive them again)."""
    _SHARED.clear()
    _CALLS.clear()
    forget_interned()


def _target(graph_module: GraphModule, node: Node) -> object:
    if node.op != "call_module":
        try:
            hash(node.target)
        except TypeError:
            raise _Unkeyable from None
        return node.target
    module = called_module(graph_module, node)
    kind = type(module)
    hooked = any(getattr(module, name, None) for name in vars(module) if name.endswith("_hooks"))
    if not kind.__module__.startswith("torch.nn.modules.") or module._modules or hooked:
        raise _Unkeyable          # a module of the user's may read anything in its forward
    tensors = [(name, type(t), tuple(t.shape), t.dtype, t.requires_grad)
               for name, t in (*module.named_parameters(), *module.named_buffers())]
    public = sorted((name, _frozen(value)) for name, value in vars(module).items() if not name.startswith("_"))
    return kind, tuple(public), tuple(tensors)


def _frozen(value: object, places: bool = False) -> object:
    """``value`` as a hashable key: a node by its name (``places``: as a bare place), a number with
    its type (1, 1.0 and True are one dict key otherwise), sequences and dicts item by item;
    anything else is unkeyable."""
    if isinstance(value, Node):
        return ("node",) if places else ("node", value.name)
    if isinstance(value, _PLAIN):
        return type(value), value
    if isinstance(value, (tuple, list)):
        return type(value), tuple(_frozen(v, places) for v in value)
    if isinstance(value, dict):
        return dict, tuple(sorted((str(k), _frozen(v, places)) for k, v in value.items()))
    if isinstance(value, slice):
        return slice, _frozen((value.start, value.stop, value.step), places)
    if value is Ellipsis:
        return Ellipsis
    raise _Unkeyable


def _metas(node: Node) -> tuple:
    """The node's name, kind and each output's shape, dtype, strides and grad flag."""
    metas = output_metas(node)
    if metas is None:
        raise _Unkeyable
    return node.name, node.op, tuple(None if m is None else (tuple(m.shape), m.dtype, tuple(m.stride), m.requires_grad)
                                     for m in metas)
