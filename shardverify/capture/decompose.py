"""A node of an exported (ATen) graph that nothing serves, decomposed in place with PyTorch's own
decompositions: the Core ATen table ``torch.export`` uses (``ExportedProgram.run_decompositions``:
``torch.export.default_decompositions()``), else the op's CompositeImplicitAutograd kernel
(``OpOverload.decompose``), or, for a library's custom op torch has no decomposition of, ours
(:mod:`shardverify.capture.custom_ops`: transformers' grouped matmul of experts). Only that node:
the decomposition is traced with ``make_fx`` (pre-dispatch, the level of export's training IR:
``aten.linear`` stays whole) on fake tensors of the node's shapes, and its sub-graph spliced where
the node was, each new node named ``<node>_<piece>`` and marked with the node it came from
(:data:`ORIGIN`). A piece nothing serves either is decomposed again, until every piece is served
or nothing more decomposes; a node that cannot be decomposed stays, with the reason
(:data:`NOT_DECOMPOSED`). The caller says what is served (this room knows no handlers).

A torch.fx graph's targets are torch-level calls (``torch.addcmul``, ``x.deg2rad()``), for which
the table has nothing: such a node is traced as it is called, at the ATen level (pre-dispatch, as
export's training IR), and its ATen pieces spliced in its place (decomposed again where nothing
serves them). A module called by an fx graph (``nn.LSTM``) is not decomposed: capture with
torch.export.

The single-device reference runs the decomposed graph too: the check is of the sharding of the
pieces, against PyTorch's own decomposition of the op (which torch.export, Inductor and DTensor
rely on), not of the decomposition itself.
"""

from __future__ import annotations

import functools
import inspect
import operator
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import fx

from shardverify.capture.meta import tensor_meta
from shardverify.capture.call import target_name
from shardverify.capture.custom_ops import custom_decomposition
from shardverify.capture.export import annotate, inplace_as_functional, tuple_views_as_slices

__all__ = ["ORIGIN", "NOT_DECOMPOSED", "MAX_DEPTH", "decompose_unserved", "origin", "not_decomposed", "torch_level"]

ORIGIN = "shardverify_decomposed_from"       # node.meta: (node name, target) of the model node it came from
NOT_DECOMPOSED = "shardverify_not_decomposed"  # node.meta: why a node nothing serves was not decomposed
MAX_DEPTH = 6                                  # decompositions of decompositions, at most


@dataclass(frozen=True)
class _Traced:
    graph: fx.GraphModule | None
    reason: str = ""


def origin(node: fx.Node) -> tuple[str, str] | None:
    """(name, target) of the model node ``node`` was decomposed from, or None."""
    return node.meta.get(ORIGIN)


def not_decomposed(node: fx.Node) -> str:
    """Why ``node`` (nothing serves it) was not decomposed; "" when it was never tried."""
    return node.meta.get(NOT_DECOMPOSED, "")


@functools.cache
def _table() -> dict:
    """export's table as a plain dict, made once (about a second: made only when a node needs it)."""
    return dict(torch.export.default_decompositions().items())


def _rule(target: torch._ops.OpOverload, table) -> Callable | None:
    if target in table:
        return table[target]
    custom = custom_decomposition(target)      # a library's custom op torch has none for
    if custom is not None:
        return custom
    if target._can_decompose():                # a CompositeImplicitAutograd kernel
        return lambda *args, **kwargs: target.decompose(*args, **kwargs)
    return None


def torch_level(node: fx.Node) -> Callable | None:
    """The callable of an fx graph's torch-level call (a tensor method, a tensor's computed
    attribute or index, a function of torch's own, an ATen op called as its packet, or a Python
    operator on tensors), which tracing at the ATen level decomposes; None for an ATen op, a
    module's call, or a function of the user's (one ``torch.fx.wrap`` kept whole: its body is the
    user's, not torch's, and may do what a trace cannot see)."""
    if node.op == "call_method" and isinstance(node.target, str):
        name = node.target
        return lambda self, *args, **kwargs: getattr(self, name)(*args, **kwargs)
    target = node.target
    if node.op == "call_function" and target is getattr:   # a tensor's computed attribute: x.T, x.mH, x.real
        return target
    if node.op == "call_function" and target is operator.getitem and node.args \
            and isinstance(node.args[0], fx.Node) and tensor_meta(node.args[0]) is not None:   # x[:, :2], x[ids]
        return target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverloadPacket):
        return target        # torch.ops.aten.foo called as a packet: traced, it is the overload it picks
    if node.op != "call_function" or not callable(target) or target is operator.getitem \
            or isinstance(target, torch._ops.OpOverload):
        return None
    module = getattr(target, "__module__", None) or ""
    return target if module == "_operator" or module == "torch" or module.startswith("torch.") else None


def _trace(node: fx.Node, table) -> _Traced:
    """The decomposition of ``node`` traced on fake tensors of its operands' shapes, its
    placeholders the node's graph inputs in ``pytree`` order."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        rule = _rule(target, table)
        if rule is None:
            return _Traced(None, "PyTorch has no decomposition of it")
    else:
        rule = torch_level(node)
        if rule is None:
            return _Traced(None, "not an ATen op nor a torch-level call")
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    flat = [_constant(v) for v in flat]
    where = [i for i, v in enumerate(flat) if isinstance(v, fx.Node)]
    metas = [tensor_meta(flat[i]) for i in where]
    for i, meta in zip(where, metas):
        if meta is None:
            return _Traced(None, f"operand {flat[i].name!r} is not a single tensor")
    # a floating operand asks for a gradient, as in the training step a plan checks: a composite
    # kernel picks its differentiable path (embedding_bag's _embedding_bag, not _forward_only)
    graded = {i for i, meta in zip(where, metas) if meta.dtype.is_floating_point or meta.dtype.is_complex}

    def call(*tensors):
        values = list(flat)
        for i, tensor in zip(where, tensors):
            values[i] = tensor
        args, kwargs = pytree.tree_unflatten(values, spec)
        result = rule(*args, **kwargs)
        if result is NotImplemented:
            raise NotImplementedError("its decomposition declines these arguments")
        return result

    from torch.fx.experimental.proxy_tensor import make_fx

    # pre-dispatch first, the level of export's training IR (linear, chunk stay whole); a composite
    # op traced there is recorded as itself, so below autograd, where its kernel's ops are seen
    for pre_dispatch in (True, False):
        mkldnn = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)    # the portable decomposition (LSTM's), not oneDNN's kernel
        try:
            while True:
                examples = [torch.empty(tuple(meta.shape), dtype=meta.dtype, requires_grad=i in graded)
                            for i, meta in zip(where, metas)]
                try:
                    graph = make_fx(call, tracing_mode="fake", pre_dispatch=pre_dispatch)(*examples)
                    break
                except RuntimeError as error:   # an operand no gradient flows to (a loss's target)
                    named = _not_differentiable(error, node, flat, graded)
                    if not named:
                        raise
                    graded -= named
        except Exception as error:  # noqa: BLE001 - any failure of torch's tracing is a reason to say
            text = str(error).strip().splitlines()
            return _Traced(None, f"its decomposition does not trace: {type(error).__name__}: "
                                 f"{text[0] if text else ''}"[:200])
        finally:
            torch._C._set_mkldnn_enabled(mkldnn)
        # the export idioms the capture rewrites, rewritten in the pieces too: chunk/unbind pieces as
        # the slices they are, an in-place op on a value nothing reads again as its out-of-place twin
        graph = inplace_as_functional(tuple_views_as_slices(annotate(_untupled(graph))))
        ops = [n for n in graph.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
        if not (len(ops) == 1 and ops[0].target is target):
            return _Traced(graph)
    return _Traced(None, "it decomposes into itself")


def _constant(value: object) -> object:
    """An argument made in the graph from constants alone, as no tensor (a settings object the
    model builds before the call, ``LinearCrossEntropyOptions(...)``): its value, which tracing
    the call takes as the call's own; any other argument as it is."""
    if not isinstance(value, fx.Node) or value.op != "call_function" or value.all_input_nodes \
            or tensor_meta(value) is not None or value.meta.get("type") is torch.Tensor:
        return value
    try:
        made = value.target(*value.args, **value.kwargs)
    except Exception:  # noqa: BLE001 - it cannot be made here: it stays a graph value, said so below
        return value
    return value if isinstance(made, torch.Tensor) else made


def _not_differentiable(error: RuntimeError, node: fx.Node, flat: list, graded: set[int]) -> set[int]:
    """The operands to trace without a gradient when ``error`` says the kernel takes none through
    one (``nll_loss``'s ``weight``, ``soft_margin_loss``'s ``target``): the one it names, found by
    the call's keyword or the torch function's signature, else every one still asking."""
    found = re.search(r"is not differentiable with respect to argument '(\w+)'", str(error))
    if found is None or not graded:
        return set()
    value = node.kwargs.get(found.group(1))
    if value is None:
        try:
            value = inspect.signature(node.target).bind_partial(*node.args, **node.kwargs).arguments.get(found.group(1))
        except (TypeError, ValueError):   # a builtin without a signature, or another call form
            value = None
    named = {i for i in graded if isinstance(value, fx.Node) and flat[i] is value}
    return named or set(graded)


def _untupled(graph: fx.GraphModule) -> fx.GraphModule:
    """A named tuple a decomposition builds (``log_sigmoid_forward``'s return type) and its
    pieces read back: each piece read as the value it was built from."""
    for node in list(graph.graph.nodes):
        if node.op == "call_function" and isinstance(node.target, type) and issubclass(node.target, tuple) \
                and all(u.op == "output" or (u.target is operator.getitem and isinstance(u.args[1], int))
                        for u in node.users):
            pieces = tuple(node.args) + tuple(node.kwargs[f] for f in getattr(node.target, "_fields", ())[len(node.args):])
            for user in list(node.users):
                if user.op == "output":
                    user.args = (fx.node.map_arg(user.args[0], lambda n: pieces if n is node else n),)
                    continue
                user.replace_all_uses_with(node.args[user.args[1]])
                graph.graph.erase_node(user)
            if not node.users:
                graph.graph.erase_node(node)
    graph.recompile()
    return graph


def _splice(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule, root: tuple[str, str]) -> list[fx.Node] | None:
    """``sub`` in place of ``node`` (its getitem users read the pieces, an output returning the whole
    tuple returns them); the new op nodes, or None
    when a user of the node cannot be rewired (it is left as it was)."""
    graph = gm.graph
    out_node = next(n for n in sub.graph.nodes if n.op == "output")
    result = out_node.args[0]
    single = not isinstance(result, (tuple, list))
    pieces_read = all(u.op == "output" or (u.op == "call_function" and u.target is operator.getitem
                                            and isinstance(u.args[1], int) and u.args[1] < len(result)
                                            and isinstance(result[u.args[1]], fx.Node)) for u in node.users) \
        if not single else not any(u.target is operator.getitem for u in node.users)
    leaves = [v for v in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(v, fx.Node)]
    inputs = [v for v in leaves if isinstance(_constant(v), fx.Node)]   # a constant made in the graph: traced in
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if not pieces_read or len(placeholders) != len(inputs):
        return None
    env: dict[fx.Node, fx.Node] = dict(zip(placeholders, inputs))
    made: list[fx.Node] = []
    try:
        _copy_pieces(gm, node, sub, root, env, made)
    except Exception:  # noqa: BLE001 - a piece that cannot be copied leaves the node as it was
        for new in reversed(made):
            graph.erase_node(new)
        return None
    mapped = fx.node.map_arg(result, env.__getitem__)
    if single:
        node.replace_all_uses_with(mapped)
    else:
        for user in list(node.users):
            if user.op == "output":   # the graph returns the whole tuple (torch.linalg.svd's named one): its pieces
                user.args = (fx.node.map_arg(user.args[0], lambda n: tuple(mapped) if n is node else n),)
                continue
            user.replace_all_uses_with(mapped[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(node)
    for made_here in set(leaves) - set(inputs):   # the settings object nothing else reads
        if not made_here.users:
            graph.erase_node(made_here)
    erased = set()
    for new in reversed(made):         # pieces of results nothing reads (LSTM's final states, unused)
        if not new.users and not new.is_impure():
            graph.erase_node(new)
            erased.add(new)
    return [new for new in made if new not in erased]


def _copy_pieces(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule, root: tuple[str, str], env: dict,
                 made: list) -> None:
    """Every op of ``sub`` copied before ``node`` (``made`` holds them as they are made)."""
    graph = gm.graph
    with graph.inserting_before(node):
        for piece in sub.graph.nodes:
            if piece.op in ("placeholder", "output"):
                continue
            if piece.op == "get_attr":     # a constant the decomposition made (torch.tensor(...))
                name = f"_decomposed_{node.name}_{piece.target}"
                setattr(gm, name, getattr(sub, str(piece.target)))
                with warnings.catch_warnings():   # a plain attribute, not a buffer: a plan redraws buffers as weights
                    warnings.filterwarnings("ignore", "Attempted to insert a get_attr Node with no underlying reference")
                    new = graph.get_attr(name)
            else:
                new = graph.create_node(piece.op, piece.target, fx.node.map_arg(piece.args, env.__getitem__),
                                        fx.node.map_arg(piece.kwargs, env.__getitem__), name=f"{node.name}_{piece.name}")
            new.meta = {k: v for k, v in piece.meta.items() if k in ("val", "tensor_meta")}
            new.meta[ORIGIN] = root
            env[piece] = new
            made.append(new)


def decompose_unserved(gm: fx.GraphModule, unserved: Callable[[fx.Node], bool]) -> fx.GraphModule:
    """Every node for which ``unserved(node)`` holds decomposed (see the module docstring), in place."""
    work = [(n, (n.name, target_name(n)), 0) for n in gm.graph.nodes
            if n.op in ("call_function", "call_method") and unserved(n)]
    table = _table() if work else {}
    changed = False
    while work:
        node, root, depth = work.pop(0)
        if depth >= MAX_DEPTH:
            node.meta[NOT_DECOMPOSED] = f"still unserved after {MAX_DEPTH} decompositions"
            continue
        traced = _trace(node, table)
        made = _splice(gm, node, traced.graph, root) if traced.graph is not None else None
        if made is None:
            node.meta[NOT_DECOMPOSED] = traced.reason or "its decomposition cannot be spliced in its place"
            continue
        changed = True
        annotate(gm)
        work += [(n, root, depth + 1) for n in made if n.op == "call_function" and n.target is not operator.getitem
                 and unserved(n)]
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm

