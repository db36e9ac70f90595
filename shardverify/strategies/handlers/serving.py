"""Which registered handler serves a call, and whether its grid verified the call: a bound
parameter at a value the grid never held or an argument the spec does not declare puts the
call outside the grid (:func:`outside_grid`: verified where it is met, or refused); a bound
parameter computed by graph nodes cannot be checked at all (:func:`refusal`)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

from shardverify.strategies.handlers.base import Computed, HandlerDef, candidates, comparable
from shardverify.strategies.handlers.call_values import MISSING, call_value, resolve_operands, resolve_params, takes_call

if TYPE_CHECKING:
    from torch.fx import GraphModule, Node

__all__ = ["handler_for_node", "refusal", "off_grid", "outside_grid"]


def handler_for_node(node: Node, graph_module: GraphModule) -> HandlerDef | None:
    """The handler registered for the node's target that serves this call, or None when the
    target has none. With several (rules bound to parameter values), the first whose grid
    verified the call; when none did, the one whose verified values the call is nearest
    (:func:`_distance`): its strategies are then verified at the call or refused
    (:func:`outside_grid`)."""
    found = candidates(node, graph_module)
    if len(found) > 1:
        found = tuple(h for h in found if takes_call(h, node)) or found
    if len(found) > 1:
        for handler in found:
            if refusal(handler, node, graph_module) is None and outside_grid(handler, node, graph_module) is None:
                return handler
        return min(found, key=lambda handler: _distance(handler, node, graph_module))
    return found[0] if found else None


def _distance(handler: HandlerDef, node: Node, graph_module: GraphModule) -> tuple[int, int, int]:
    """How far a call is from what a handler verified: (bound parameters at a value the grid
    never held that the rule serves only at verified values, all such parameters, those of a
    type no verified value has); a transposed convolution is nearer the rule verified transposed
    at another stride than the one verified at its stride but not transposed; embedding with
    padding_idx=1 is nearer the rule verified at padding_idx=0 than the one verified without it."""
    params = _bound_values(handler, node, graph_module)
    off = [(name, params.get(name), values) for name, values in handler.bound().items()
           if comparable(params.get(name)) not in {comparable(v) for v in values}]
    every = {p.name for p in handler.params if p.any_value}
    return (sum(1 for name, _, _ in off if name not in every), len(off),
            sum(1 for _, value, values in off if type(value) not in {type(v) for v in values}))


def _bound_values(handler: HandlerDef, node: Node, graph_module: GraphModule | None) -> dict[str, object]:
    """The call's parameters, and for a variadic operand how many tensors the call passes (the
    grid binds that count like a parameter: another count is verified where it is met)."""
    params = resolve_params(handler, node, graph_module)
    for decl in handler.operands:
        if decl.variadic:
            value, _ = call_value(node, decl.index, decl.keyword)
            params[decl.role] = len(value) if isinstance(value, (list, tuple)) else value
    return params


def refusal(handler: HandlerDef, node: Node, graph_module: GraphModule | None = None) -> str | None:
    """Why ``handler``'s strategies cannot be checked at this call at all, or None: a bound
    parameter computed by graph nodes has no value before the call runs."""
    params = _bound_values(handler, node, graph_module)
    for name, values in handler.bound().items():
        value = params.get(name)
        if isinstance(value, Computed):
            return (f"{handler.name} ({handler.spec_file or 'its spec'}): node {node.name!r} passes {name} computed "
                    f"in the graph (by {', '.join(value.nodes)}), known only when the model runs; the rule was "
                    f"verified for {name} in {_shown(values)}, so the call cannot be checked ahead: pass {name} "
                    f"as a constant")
    return None


def off_grid(handler: HandlerDef, node: Node, graph_module: GraphModule | None = None) -> tuple[str, ...]:
    """The bound parameters this call passes at a value its grid never held (computed ones aside:
    :func:`refusal` speaks for those)."""
    params = _bound_values(handler, node, graph_module)
    return tuple(name for name, values in handler.bound().items()
                 if not isinstance(params.get(name), Computed)
                 and comparable(params.get(name)) not in {comparable(v) for v in values})


def outside_grid(handler: HandlerDef, node: Node, graph_module: GraphModule | None = None) -> str | None:
    """Why this call is outside what ``handler``'s grid verified, or None: a bound parameter at a
    value the grid never held, or an argument the spec does not declare (unless it leaves the
    rule unchanged, or equals its schema default: a default spelled out is the default). Such
    a call is verified when it is met (``strategies_for_node(..., on_demand=...)``) or refused."""
    params = _bound_values(handler, node, graph_module)
    for name in off_grid(handler, node, graph_module):
        return (f"{handler.name}: node {node.name!r} passes {name}={_show(params.get(name))}; the rule was verified "
                f"for {name} in {_shown(handler.bound()[name])} only ({handler.spec_file or 'its spec'})")
    apart = _kinds_apart(handler, node, graph_module)
    if apart:
        return (f"{handler.name}: node {node.name!r} passes {'; '.join(apart)} ({handler.spec_file or 'its spec'}): "
                f"the rule may not hold for another kind of value (an integer divisor of zero, a mask where ids "
                f"were drawn)")
    extra = _undeclared_arguments(handler, node) or _undeclared_attributes(handler, node, graph_module)
    if extra:
        return (f"{handler.name}: node {node.name!r} passes {', '.join(extra)}, which "
                f"{handler.spec_file or 'its spec'} does not declare; the rule may not hold with "
                f"{'it' if len(extra) == 1 else 'them'} (declare it, or list it under 'ignores' if it does not change the rule)")
    return None


def _kinds_apart(handler: HandlerDef, node: Node, graph_module: GraphModule | None) -> list[str]:
    """The tensor operands this call passes with a dtype of another kind (bool, integer, floating,
    complex) than the spec's grid drew them with, each said with both: ``x[mask] = v`` is not
    ``x[ids] = v``, and an integer divisor holds zeros a float one was never drawn with."""
    drawn = dict(handler.dtypes)
    if not drawn or graph_module is None:
        return []
    try:
        operands = resolve_operands(handler, node, graph_module)
    except Exception:  # noqa: BLE001 - operands that do not resolve are the handler's to refuse, with its reason
        return []
    ranged = {role for role, values, _ in handler.drawn if values is not None}
    found = []
    for role in sorted(set(drawn) & set(operands)):
        dtype, verified = operands[role].dtype, getattr(torch, drawn[role])
        if _kind(dtype) != _kind(verified):
            what = "ids drawn below a size" if role in ranged and _kind(verified) == "integer" else \
                f"{drawn[role]} tensors"
            found.append(f"{role} as {str(dtype).removeprefix('torch.')}, where the rule was verified for {what}")
    return found


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "complex" if dtype.is_complex else "floating" if dtype.is_floating_point else "integer"


def _undeclared_arguments(handler: HandlerDef, node: Node) -> list[str]:
    """Arguments of the call that no operand or parameter declares and ``ignores`` does not
    list, an ATen argument equal to its schema default excepted."""
    if node.op not in ("call_function", "call_method"):
        return []
    decls = [*handler.operands, *handler.params]
    keywords = {d.keyword for d in decls if d.keyword} | set(handler.ignores)
    indices = {d.index for d in decls if d.index is not None}
    if any(getattr(d, "varargs", False) for d in handler.params):
        indices |= set(range(min(d.index for d in handler.params if d.varargs), len(node.args)))  # type: ignore[type-var]
    defaults = _defaults(node)

    def schema_default(position: int | None, keyword: str | None, value: object) -> bool:
        for i, (name, default) in enumerate(defaults):
            if position == i or keyword == name:
                return name in handler.ignores or (default is not MISSING and comparable(value) == comparable(default))
        return False

    extra = [f"argument {i} ({_show(value)})" for i, value in enumerate(node.args)
             if i not in indices and not schema_default(i, None, value)]
    extra += [f"keyword {key}={_show(value)}" for key, value in node.kwargs.items()
              if key not in keywords and not schema_default(None, key, value)]
    return extra


def _undeclared_attributes(handler: HandlerDef, node: Node, graph_module: GraphModule | None) -> list[str]:
    """For a module call: the constructor arguments the spec neither declares nor ignores whose
    value on this module differs from the constructor's default (``CrossEntropyLoss(
    reduction="sum")``, ``Embedding(max_norm=1.0)``): the module's maths changed, the rule was
    not verified for it. A flag whose attribute is a tensor slot (``bias=True`` -> a Parameter
    or None) is the operand's business, resolved with the operands."""
    if node.op != "call_module" or graph_module is None:
        return []
    module = graph_module.get_submodule(str(node.target))
    try:
        parameters = inspect.signature(type(module).__init__).parameters.values()
    except (TypeError, ValueError):
        return []
    declared = {d.name for d in handler.params} | {d.keyword for d in handler.params if d.keyword} | set(handler.ignores)
    extra = []
    for p in parameters:
        if p.default is inspect.Parameter.empty or p.name in declared or p.name in ("device", "dtype") \
                or p.name.startswith("_") or not hasattr(module, p.name):
            continue
        value = getattr(module, p.name)
        if isinstance(p.default, bool) and (value is None or isinstance(value, torch.Tensor)):
            continue
        same = comparable(value) == comparable(p.default) or (
            isinstance(value, tuple) and value and all(comparable(v) == comparable(p.default) for v in value))
        if not same:
            extra.append(f"attribute {p.name}={_show(value)}")
    return extra


def _defaults(node: Node) -> list[tuple[str, object]]:
    """(name, default or MISSING) of each argument of the node's op, in order: from an ATen
    overload's schema, else from the Python signature (torch.fx records F.embedding's defaults;
    F.max_pool2d's ``return_indices=False`` reads its dispatched function's), else from the
    schemas of the ATen operator a builtin or a method calls (``torch.softmax``,
    ``F.scaled_dot_product_attention``, ``x.to(...)``)."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return _schema_defaults(schema)
    target = node.target
    dispatched = getattr(torch._jit_internal, "boolean_dispatched", {}).get(target) if callable(target) else None
    try:
        parameters = inspect.signature(dispatched["if_false"] if dispatched else target).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return _builtin_defaults(node)
    return [(p.name, MISSING if p.default is inspect.Parameter.empty else p.default) for p in parameters
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _schema_defaults(schema) -> list[tuple[str, object]]:
    return [(a.name, a.default_value if a.has_default_value() else MISSING) for a in schema.arguments]


def _builtin_defaults(node: Node) -> list[tuple[str, object]]:
    """The defaults of the ATen overload a builtin function or a Tensor method resolves to: of
    the operator's overloads, the first that can take the call's arguments (as many positions,
    every keyword), ``self`` first as a method call passes it."""
    if node.op == "call_method":
        name = f"aten::{node.target}"
    else:
        try:
            from torch.jit._builtins import _find_builtin

            name = _find_builtin(node.target)
        except Exception:  # noqa: BLE001 - not a builtin torch knows: no defaults
            return []
    try:
        schemas = torch._C._jit_get_schemas_for_operator(name) if name else []
    except RuntimeError:
        return []
    for schema in schemas:
        names = [a.name for a in schema.arguments]
        if len(names) >= len(node.args) and set(node.kwargs) <= set(names):
            return _schema_defaults(schema)
    return []


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _shown(values: tuple[object, ...]) -> str:
    return "{" + ", ".join(_show(v) for v in values) + "}"
