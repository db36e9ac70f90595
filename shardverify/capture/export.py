"""Capture a model with ``torch.export``: the capture real models need (HF transformers'
language models cannot be symbolically traced: ``**kwargs`` forwards, control flow on shapes),
and the one PyTorch's own DTensor-based auto-parallel work uses.

The result is the exported program's training IR, un-lifted (``ExportedProgram.module()``):
ATen ops, not decomposed (``aten.linear``, ``aten.layer_norm``,
``aten.scaled_dot_product_attention`` stay whole), parameters and buffers as ``get_attr`` nodes of
the module, example inputs in their own dtypes (token ids stay int64). Every node whose value is a
tensor (or a tuple of tensors) gets ``node.meta['tensor_meta']``, as :func:`shardverify.capture.fx.trace`
gives, from the shapes export propagated, so the handlers read both graphs alike.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import torch
from torch.fx import GraphModule
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from shardverify.capture.meta import tensor_meta
from shardverify.capture.call import tuple_element
from shardverify.errors import InvalidArgument

__all__ = ["export_graph", "CaptureError", "annotate", "tuple_views_as_slices", "inplace_as_functional"]


class CaptureError(InvalidArgument):
    """The model cannot be captured with torch.export (the reason is torch's, shortened)."""


def _metadata(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return _extract_tensor_metadata(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(_extract_tensor_metadata(v) for v in value)
    return None


def export_graph(module: torch.nn.Module, args: Sequence[object] = (), kwargs: Mapping[str, object] | None = None,
                 *, strict: bool = False) -> GraphModule:
    """``torch.export.export(module, args, kwargs).module()`` with ``tensor_meta`` on every
    tensor node. ``strict=False`` (the default) traces the Python code as it runs, which HF
    models need; a model that cannot be captured raises :class:`CaptureError` naming why."""
    if not isinstance(module, torch.nn.Module):
        raise InvalidArgument(f"export_graph() needs a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, torch.export.ExportedProgram):
        program = module
    else:
        try:
            program = torch.export.export(module, tuple(args), dict(kwargs or {}), strict=strict)
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds; the user needs the reason
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CaptureError(f"torch.export cannot capture {type(module).__name__}: "
                               f"{type(exc).__name__}: {first}") from exc
    return tuple_views_as_slices(inplace_as_functional(annotate(program.module())))


def _out_of_place(target: object) -> object | None:
    """``aten.add.Tensor`` for ``aten.add_.Tensor``: the same overload without the mutation."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    arguments = target._schema.arguments
    if not arguments or arguments[0].alias_info is None or not arguments[0].alias_info.is_write:
        return None
    name = target.overloadpacket.__name__
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    if packet is None:
        return None
    same = getattr(packet, target._overloadname, None)
    if same is not None:
        return same
    # another overload name for the same arguments (transpose_.default, transpose.int)
    wanted = [(a.name, str(a.type)) for a in arguments]
    return next((overload for overload in (getattr(packet, o) for o in packet.overloads())
                 if [(a.name, str(a.type)) for a in overload._schema.arguments] == wanted), None)


def _is_view(node: torch.fx.Node) -> bool:
    """Does ``node`` return a view of (share memory with) one of its inputs?"""
    element = tuple_element(node)
    if element is not None:                  # topk's values: a view only where topk returns one
        return _is_view(element[0])
    if not isinstance(node.target, torch._ops.OpOverload):
        return True                          # unknown: assume it may alias
    return any(r.alias_info is not None for r in node.target._schema.returns)


def inplace_as_functional(graph_module: GraphModule) -> GraphModule:
    """An in-place op on an intermediate value that nothing reads afterwards (ResNet's
    ``hidden += residual``: ``aten.add_``) becomes its out-of-place twin (``aten.add``): the same
    values, and no rank's or the reference's recorded tensor is mutated behind the verifier's back.
    An in-place op on a model input, a weight, a view, a value read again later, or a value a
    view was taken of (the view would see the change) stays as it is. An op that changes only a
    value's shape or strides (``transpose_``, ``squeeze_``: tagged ``inplace_view``) changes no
    data another view could see: it becomes its twin where nothing reads the value afterwards."""
    graph = graph_module.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        twin = _out_of_place(node.target) if node.op == "call_function" else None
        mutated = node.args[0] if node.args else None
        if twin is None or not isinstance(mutated, torch.fx.Node) or mutated.op != "call_function":
            continue
        others = [u for u in mutated.users if u is not node]
        if torch.Tag.inplace_view in node.target.tags:
            if any(order[u] > order[node] for u in others):
                continue
        elif _is_view(mutated) or any(order[u] > order[node] or _is_view(u) for u in others):
            continue
        element = tuple_element(mutated)
        if element is not None and sum(1 for u in element[0].users if tuple_element(u) == element) > 1:
            continue                         # another getitem of the same tensor would see the change
        with graph.inserting_before(node):
            functional = graph.call_function(twin, node.args, node.kwargs)
        functional.meta.update(node.meta)
        node.replace_all_uses_with(functional)
        graph.erase_node(node)
    graph_module.recompile()
    return graph_module


def _pieces(node: torch.fx.Node) -> list[tuple[int, int]] | None:
    """(start, end) of each piece a split returns along its dim, from the input's shape."""
    source = node.args[0]
    meta = tensor_meta(source) if isinstance(source, torch.fx.Node) else None
    shape = None if meta is None else meta.shape
    if shape is None:
        return None
    args = list(node.args) + [None] * 3
    dim = args[2] if args[2] is not None else node.kwargs.get("dim", 0)
    size = shape[dim]
    if node.target is torch.ops.aten.split_with_sizes.default:
        lengths = list(args[1] if args[1] is not None else node.kwargs["split_sizes"])
    else:
        if node.target is torch.ops.aten.chunk.default:    # torch.chunk: pieces of ceil(size / chunks)
            chunks = args[1] if args[1] is not None else node.kwargs["chunks"]
            step = -(-size // chunks) if chunks > 0 else 0
        else:
            step = args[1] if args[1] is not None else node.kwargs["split_size"]
        lengths = [min(step, size - start) for start in range(0, size, step)] if step > 0 else []
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [(start, start + length) for start, length in zip(starts, lengths)]


_SPLITS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, torch.ops.aten.chunk.default,
           torch.ops.aten.unbind.int)


def tuple_views_as_slices(graph_module: GraphModule) -> GraphModule:
    """Each piece taken from a split or a chunk (``q, k, v = x.split(d, dim=2)``: ``split`` then
    ``getitem`` nodes) becomes the slice it is (``aten.slice``; ``aten.select`` for ``unbind``),
    the same view of the same values, so the rule of one slice serves each piece and no piece
    falls back for want of a handler for a tuple element."""
    graph = graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _SPLITS or not node.users:
            continue
        users = list(node.users)
        if not all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
                   for u in users):
            continue
        dim = (list(node.args) + [None] * 3)[1 if node.target is torch.ops.aten.unbind.int else 2]
        dim = node.kwargs.get("dim", 0) if dim is None else dim
        pieces = None if node.target is torch.ops.aten.unbind.int else _pieces(node)
        if node.target is not torch.ops.aten.unbind.int and pieces is None:
            continue
        for user in users:
            if not user.users:           # a piece nothing reads (``a, _, c = x.chunk(3)``) is no op
                graph.erase_node(user)
                continue
            index = user.args[1]
            with graph.inserting_before(user):
                if pieces is None:
                    piece = graph.call_function(torch.ops.aten.select.int, (node.args[0], dim, index))
                else:
                    start, end = pieces[index]
                    piece = graph.call_function(torch.ops.aten.slice.Tensor, (node.args[0], dim, start, end))
            piece.meta.update(user.meta)
            user.replace_all_uses_with(piece)
            graph.erase_node(user)
        graph.erase_node(node)
    graph_module.recompile()
    return graph_module


def annotate(graph_module: GraphModule) -> GraphModule:
    """Fill ``tensor_meta`` from export's ``val`` on every node that has one (a graph module a
    user exported with torch.export is annotated as it is, not captured again)."""
    for node in graph_module.graph.nodes:
        if "tensor_meta" not in node.meta and "val" in node.meta:
            found = _metadata(node.meta["val"])
            if found is not None:
                node.meta["tensor_meta"] = found
    return graph_module
