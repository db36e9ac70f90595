"""Handlers are data: which torch targets an op covers, where its operands and parameters
sit in the call, and which generic strategy generator builds its strategies.

Generated handler modules (``handlers/generated/``) only call :func:`register_handler`;
all op knowledge lives in the :class:`HandlerDef` and the generator options.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardverify.errors import HandlerError
from shardverify.sharding.strategy import OperandLocator, OperationData, OperationDataType

if TYPE_CHECKING:
    from torch.fx import GraphModule, Node

__all__ = [
    "HandlerDef", "OperandDecl", "ParamDecl", "Computed", "register_handler", "unregister_handler",
    "handler_for_node", "registered_handlers", "resolve_operands", "resolve_params", "param_locator", "target_key", "element_decls",
    "refusal", "outside_grid", "off_grid", "bound_apart", "signature_apart", "flags_apart", "takes_call",
]

OPERAND_KINDS = ("input", "param", "output")
_MISSING = object()


@dataclass(frozen=True)
class OperandDecl:
    """Where one operand comes from.

    ``kind="input"``: a call argument at positional ``index`` or ``keyword``.
    ``kind="param"``: on a ``call_module`` node the module attribute ``attribute``; on a
    function/method call the argument at ``index``/``keyword`` (F.linear's weight).
    ``kind="output"``: the node's result; with ``index`` the element ``index`` of a tuple
    result (``torch.max(x, dim)``: values 0, indices 1); without it a tuple result gives one
    operand per element (split/chunk), with roles ``<role>.<i>``.
    ``element``: the operand is element ``element`` of the list argument at ``index``
    (torch.cat's tensors). ``variadic``: every element of that list argument is an operand of
    this one role, however many the call passes; they resolve as ``<role>.<i>`` in order, each
    with its own layout, and a rule option naming the role names them all. For ``call_method``
    nodes index 0 is ``self``. An optional input
    that the call fills with a number (``torch.add(x, 2.0)``) is absent, like an omitted one.
    """

    role: str
    kind: str
    index: int | None = None
    keyword: str | None = None
    attribute: str | None = None
    optional: bool = False
    element: int | None = None
    variadic: bool = False

    def __post_init__(self) -> None:
        if self.variadic and (self.kind != "input" or self.element is not None or self.index is None):
            raise HandlerError(f"operand {self.role!r}: a variadic operand is every element of the list "
                               f"argument at its index (an input, with an index and no element)")
        if self.kind not in OPERAND_KINDS:
            raise HandlerError(f"operand {self.role!r}: kind {self.kind!r} is not one of {OPERAND_KINDS}")
        if self.kind == "input" and self.index is None and self.keyword is None:
            raise HandlerError(f"input operand {self.role!r} needs an index or a keyword")
        if self.kind == "param" and self.index is None and self.keyword is None and self.attribute is None:
            raise HandlerError(f"param operand {self.role!r} needs an attribute, an index or a keyword")


@dataclass(frozen=True)
class ParamDecl:
    """A non-tensor call parameter (``dim``, ``keepdim``) read from the call, else ``default``.
    ``varargs``: the parameter is every positional argument from ``index`` on when the call
    passes them unpacked (``x.view(8, 16)``), or the one sequence there (``x.view((8, 16))``)."""

    name: str
    index: int | None = None
    keyword: str | None = None
    default: object = None
    varargs: bool = False


@dataclass(frozen=True)
class Computed:
    """A call parameter computed by graph nodes (``x.reshape(x.shape[0], 4, 4)``): known only at
    run time, so a rule that needs its value refuses the node, naming the nodes; a rule that
    only needs where it sits (a view's shape, replaced by the local one) takes it."""

    name: str
    nodes: tuple[str, ...]

    def refuse(self, handler: str, node: str) -> HandlerError:
        return HandlerError(f"handler {handler!r}: parameter {self.name!r} of node {node!r} is computed by "
                            f"node(s) {', '.join(self.nodes)}; only constants are supported")


@dataclass(frozen=True)
class HandlerDef:
    name: str
    targets: tuple[object, ...]
    operands: tuple[OperandDecl, ...]
    params: tuple[ParamDecl, ...] = ()
    generator: str = ""
    options: tuple[tuple[str, object], ...] = ()
    spec_file: str = ""
    #: (target, operands, params) for a target that takes them at other positions than the
    #: handler's own (an ATen overload whose schema orders them differently)
    overrides: tuple[tuple[object, tuple[OperandDecl, ...], tuple[ParamDecl, ...]], ...] = ()
    #: (target, ((parameter, the values verified), ...)) per target: a call passing another
    #: value of a listed parameter is refused (:func:`refusal`); unlisted parameters serve any value
    bindings: tuple[tuple[object, tuple[tuple[str, tuple[object, ...]], ...]], ...] = ()
    #: keyword arguments the spec does not declare that leave its rule unchanged (a device)
    ignores: tuple[str, ...] = ()
    #: (role, [low, high) its values are drawn from or None, whether it takes a gradient) of each
    #: operand the spec's grid draws: how a call outside the grid is given data when it is
    #: verified where it is met (ids below a vocabulary, positive variances)
    drawn: tuple[tuple[str, tuple[float, float] | None, bool], ...] = ()

    def __post_init__(self) -> None:
        if not self.targets:
            raise HandlerError(f"handler {self.name!r} declares no targets")
        strange = [target for target, _, _ in self.overrides if target not in self.targets]
        if strange:
            raise HandlerError(f"handler {self.name!r} overrides positions of {strange}, which are not its targets")
        roles = [d.role for d in self.operands]
        if len(set(roles)) != len(roles):
            raise HandlerError(f"handler {self.name!r} repeats an operand role: {roles}")
        outputs = [d for d in self.operands if d.kind == "output"]
        if not outputs:
            raise HandlerError(f"handler {self.name!r} needs an output operand, got roles {roles}")
        if len(outputs) > 1 and any(d.index is None for d in outputs):
            raise HandlerError(f"handler {self.name!r}: with several outputs each needs its tuple index")
        if not self.generator:
            raise HandlerError(f"handler {self.name!r} names no generator")

    @property
    def option_dict(self) -> dict[str, object]:
        return dict(self.options)

    def for_target(self, target: object) -> HandlerDef:
        """The handler as ``target``'s calls are read: its positions overridden where it has them,
        its bindings that target's."""
        bindings = tuple((t, b) for t, b in self.bindings if t == target)
        narrowed = dataclasses.replace(self, targets=(target,), bindings=bindings, overrides=())
        for overridden, operands, params in self.overrides:
            if overridden == target:
                return dataclasses.replace(narrowed, operands=operands, params=params)
        return narrowed

    def bound(self) -> dict[str, tuple[object, ...]]:
        """The verified values of each bound parameter, for the handler of one target
        (:meth:`for_target`: the registry holds one per target)."""
        if len(self.targets) != 1:
            return {}
        return {name: values for target, bound in self.bindings if target == self.targets[0] for name, values in bound}


_REGISTRY: dict[object, tuple[HandlerDef, ...]] = {}   # target key -> the handlers as that target's calls are read
_DEFS: dict[str, HandlerDef] = {}          # name -> the handler as registered


def target_key(target: object) -> object:
    """Registry key: method descriptors such as ``torch.Tensor.sum`` become the method name
    (how ``call_method`` nodes name their target); callables and classes are used as is."""
    if isinstance(target, str):
        return target
    if type(target).__name__ in ("method_descriptor", "getset_descriptor") or (
            getattr(target, "__qualname__", "").startswith(("Tensor.", "TensorBase."))):
        return target.__name__  # type: ignore[attr-defined]
    return target


def _operator_twin(target: object) -> object | None:
    """``operator.mul`` for ``torch.Tensor.__mul__``: a torch.fx graph records ``x * y`` as a call
    of the Python operator, the same call as the method; None for any other target."""
    name = getattr(target, "__name__", "")
    if not (name.startswith("__") and name.endswith("__")) or not str(
            getattr(target, "__qualname__", "")).startswith(("Tensor.", "TensorBase.")):
        return None
    return getattr(operator, name, None)


def register_handler(defn: HandlerDef) -> HandlerDef:
    """Register ``defn`` for every target. Another handler may claim a target only when both
    are bound to disjoint values of one parameter there (batch norm in training and in eval
    mode: two rules, each served only the calls it was verified on); otherwise it is an error."""
    narrowed = [(target_key(t), defn.for_target(t)) for t in defn.targets]
    narrowed += [(twin, mine) for t, (_, mine) in zip(defn.targets, list(narrowed))
                 if (twin := _operator_twin(t)) is not None]
    for key, mine in narrowed:
        for owner in _REGISTRY.get(key, ()):
            if owner.name != defn.name and not bound_apart(owner.bound(), mine.bound()) and \
                    not signature_apart(owner.operands, owner.params, mine.operands, mine.params) and \
                    not flags_apart(owner.params, owner.bound(), mine.params, mine.bound()):
                raise HandlerError(f"target {key!r} of handler {defn.name!r} is already handled by {owner.name!r}"
                                   f" (two handlers of one target must be bound to disjoint values of a parameter,"
                                   f" or read a call apart: a tensor where the other takes a number or nothing, a flag"
                                   f" where the other takes a number, a tuple result where the other one tensor)")
    for key, mine in narrowed:
        others = tuple(d for d in _REGISTRY.get(key, ()) if d.name != defn.name)
        _REGISTRY[key] = others + (mine,)
    _DEFS[defn.name] = defn
    return defn


def bound_apart(a: Mapping[str, tuple], b: Mapping[str, tuple]) -> bool:
    """Do two bindings (parameter -> the values a rule serves) serve disjoint values of some
    parameter, so that no call could be served by both? The one test, for the registry and for
    the specs that ``generate`` checks."""
    return any(not {_normal(v) for v in a[name]} & {_normal(v) for v in values}
               for name, values in b.items() if name in a)


def signature_apart(operands_a, params_a, operands_b, params_b) -> bool:
    """Do two declarations of one target read a position differently, one a tensor and the other a
    number (``torch.max(x, y)`` and ``torch.max(x, dim)``; clamp's bounds as tensors or numbers)?
    Then a call passing a value there is taken by one of them only (:func:`takes_call`); a call
    that passes nothing there is served by the nearer one, verified at the call where outside its grid.
    Or does one read a tuple result's elements and the other one result (``torch.max(x, dim)``'s
    values and indices, ``torch.max(x)``'s one extremum)? A call returning one tensor is the other's."""
    def apart(operands, others, params) -> bool:
        tensor_keywords = {o.keyword for o in others if o.kind != "output" and o.keyword}
        places = {o.index for o in others if o.kind != "output" and o.index is not None} | \
            {p.index for p in params if p.index is not None}
        return any(o.kind == "input" and o.index is not None and o.element is None
                   and (any(p.index == o.index for p in params)
                        or (not o.optional and o.index not in places))   # a tensor where the other reads nothing
                   and (o.keyword is None or o.keyword not in tensor_keywords)
                   for o in operands)
    def tuple_result(operands) -> bool:
        return any(o.kind == "output" and o.index is not None for o in operands)

    def one_result(operands) -> bool:
        return any(o.kind == "output" and o.index is None for o in operands)
    return apart(operands_a, operands_b, params_b) or apart(operands_b, operands_a, params_a) or \
        (tuple_result(operands_a) and one_result(operands_b)) or (tuple_result(operands_b) and one_result(operands_a))


def _is_tensor(value: object) -> bool:
    if not isinstance(value, torch.fx.Node):
        return False
    return hasattr(value.meta.get("tensor_meta"), "shape") or isinstance(value.meta.get("val"), torch.Tensor)


def takes_call(handler: HandlerDef, node: Node) -> bool:
    """Does the call pass tensors exactly where ``handler`` declares tensor operands: every
    required one a tensor, an optional one a tensor or nothing, no tensor where it declares a
    number, none it does not declare? Picks among the handlers of one target that
    :func:`signature_apart` tells apart."""
    if node.op not in ("call_function", "call_method"):
        return True
    tensors = [d for d in handler.operands if d.kind != "output" and d.attribute is None]
    for decl in tensors:
        value, _ = _call_value(node, decl.index, decl.keyword)
        if decl.element is None and not _is_tensor(value) and not (decl.optional and (value is _MISSING or value is None)):
            return False
    for decl in handler.params:
        if _is_tensor(_call_value(node, decl.index, decl.keyword, decl.varargs)[0]):
            return False
    indices = {d.index for d in tensors if d.index is not None}
    keywords = {d.keyword for d in tensors if d.keyword}
    if not (all(i in indices for i, value in enumerate(node.args) if _is_tensor(value)) and
            all(key in keywords for key, value in node.kwargs.items() if _is_tensor(value))):
        return False
    return _reads_call(handler, node)


def _reads_call(handler: HandlerDef, node: Node) -> bool:
    """Does ``handler`` read what the call passes and returns: an argument at every position and
    keyword (other than None) the call fills, a bool where it reads a flag (a parameter verified at
    bools only), one tensor or a tuple result as it declares? Tells apart the rules of one target
    that :func:`flags_apart` and :func:`signature_apart` (by the result) allow."""
    declared = [*handler.operands, *handler.params]
    if any(d.kind == "output" and d.index is not None for d in handler.operands) and \
            hasattr(node.meta.get("tensor_meta"), "shape"):
        return False                 # it reads a tuple result's elements; the call returns one tensor
    if not any(getattr(d, "varargs", False) for d in handler.params):
        places = {d.index for d in declared if d.index is not None}
        if any(i not in places for i in range(len(node.args))):
            return False
    names = {d.keyword for d in declared if d.keyword} | set(handler.ignores)
    if any(key not in names for key, value in node.kwargs.items() if value is not None):
        return False
    bound = handler.bound()
    for decl in handler.params:
        if bound.get(decl.name) and all(isinstance(v, bool) for v in bound[decl.name]):
            value, _ = _call_value(node, decl.index, decl.keyword, decl.varargs)
            if value is not _MISSING and value is not None and not isinstance(value, bool):
                return False
    return True


def flags_apart(params_a, bound_a: Mapping[str, tuple], params_b, bound_b: Mapping[str, tuple]) -> bool:
    """Does one rule of a target read a position as a flag (a parameter verified at bools only)
    where the other reads a parameter never verified at a bool (``torch.var(x, True)``, the
    unbiased variance of every element, against ``torch.var(x, 1)``, over dim 1)? A call is then
    taken by one of them only where it passes a number there (:func:`takes_call`)."""
    def flags(params, bound) -> set:
        return {p.index for p in params if p.index is not None and bound.get(p.name)
                and all(isinstance(v, bool) for v in bound[p.name])}

    def others(params, bound) -> set:
        return {p.index for p in params if p.index is not None
                and not any(isinstance(v, bool) for v in bound.get(p.name, ()))}
    return bool(flags(params_a, bound_a) & others(params_b, bound_b)) or \
        bool(flags(params_b, bound_b) & others(params_a, bound_a))


def unregister_handler(name: str) -> None:
    for key in list(_REGISTRY):
        kept = tuple(d for d in _REGISTRY[key] if d.name != name)
        if kept:
            _REGISTRY[key] = kept
        else:
            del _REGISTRY[key]
    _DEFS.pop(name, None)


def registered_handlers() -> dict[str, HandlerDef]:
    return dict(_DEFS)


def _candidates(node: Node, graph_module: GraphModule) -> tuple[HandlerDef, ...]:
    if node.op == "call_module":
        module_type = type(graph_module.get_submodule(str(node.target)))
        for cls in module_type.__mro__:
            if cls in _REGISTRY:
                return _REGISTRY[cls]
        return ()
    if node.op in ("call_function", "call_method"):
        try:
            return _REGISTRY.get(node.target, ())
        except TypeError:  # unhashable target
            return ()
    return ()


def handler_for_node(node: Node, graph_module: GraphModule) -> HandlerDef | None:
    """The handler registered for the node's target that serves this call, or None when the
    target has none. With several (rules bound to parameter values), the first whose grid
    verified the call; when none did, the one whose verified values the call is nearest
    (:func:`_distance`): its strategies are then verified at the call or refused
    (:func:`outside_grid`)."""
    found = _candidates(node, graph_module)
    if len(found) > 1:
        found = tuple(h for h in found if takes_call(h, node)) or found
    if len(found) > 1:
        for handler in found:
            if refusal(handler, node, graph_module) is None and outside_grid(handler, node, graph_module) is None:
                return handler
        return min(found, key=lambda handler: _distance(handler, node, graph_module))
    return found[0] if found else None


def _distance(handler: HandlerDef, node: Node, graph_module: GraphModule) -> tuple[int, int]:
    """How far a call is from what a handler verified: (bound parameters at a value the grid
    never held, those of a type no verified value has); embedding with padding_idx=1 is
    nearer the rule verified at padding_idx=0 than the one verified without it."""
    params = _bound_values(handler, node, graph_module)
    off = [(name, params.get(name), values) for name, values in handler.bound().items()
           if _normal(params.get(name)) not in {_normal(v) for v in values}]
    return len(off), sum(1 for _, value, values in off if type(value) not in {type(v) for v in values})


def _bound_values(handler: HandlerDef, node: Node, graph_module: GraphModule | None) -> dict[str, object]:
    """The call's parameters, and for a variadic operand how many tensors the call passes (the
    grid binds that count like a parameter: another count is verified where it is met)."""
    params = resolve_params(handler, node, graph_module)
    for decl in handler.operands:
        if decl.variadic:
            value, _ = _call_value(node, decl.index, decl.keyword)
            params[decl.role] = len(value) if isinstance(value, (list, tuple)) else value
    return params


def refusal(handler: HandlerDef, node: Node, graph_module: GraphModule | None = None) -> str | None:
    """Why ``handler``'s strategies cannot be checked at this call at all, or None: a bound
    parameter computed by graph nodes has no value before the call runs."""
    params = _bound_values(handler, node, graph_module)
    for name, values in handler.bound().items():
        value = params.get(name)
        if isinstance(value, Computed):
            return (f"{handler.name}: parameter {name!r} of node {node.name!r} is computed by node(s) "
                    f"{', '.join(value.nodes)}; the rule was verified for {name} in {_shown(values)}")
    return None


def off_grid(handler: HandlerDef, node: Node, graph_module: GraphModule | None = None) -> tuple[str, ...]:
    """The bound parameters this call passes at a value its grid never held (computed ones aside:
    :func:`refusal` speaks for those)."""
    params = _bound_values(handler, node, graph_module)
    return tuple(name for name, values in handler.bound().items()
                 if not isinstance(params.get(name), Computed)
                 and _normal(params.get(name)) not in {_normal(v) for v in values})


def outside_grid(handler: HandlerDef, node: Node, graph_module: GraphModule | None = None) -> str | None:
    """Why this call is outside what ``handler``'s grid verified, or None: a bound parameter at a
    value the grid never held, or an argument the spec does not declare (unless it leaves the
    rule unchanged, or equals its schema default: a default spelled out is the default). Such
    a call is verified when it is met (``strategies_for_node(..., on_demand=...)``) or refused."""
    params = _bound_values(handler, node, graph_module)
    for name in off_grid(handler, node, graph_module):
        return (f"{handler.name}: node {node.name!r} passes {name}={_show(params.get(name))}; the rule was verified "
                f"for {name} in {_shown(handler.bound()[name])} only ({handler.spec_file or 'its spec'})")
    extra = _undeclared_arguments(handler, node) or _undeclared_attributes(handler, node, graph_module)
    if extra:
        return (f"{handler.name}: node {node.name!r} passes {', '.join(extra)}, which "
                f"{handler.spec_file or 'its spec'} does not declare; the rule may not hold with "
                f"{'it' if len(extra) == 1 else 'them'} (declare it, or list it under 'ignores' if it does not change the rule)")
    return None


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
                return name in handler.ignores or (default is not _MISSING and _normal(value) == _normal(default))
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
        same = _normal(value) == _normal(p.default) or (
            isinstance(value, tuple) and value and all(_normal(v) == _normal(p.default) for v in value))
        if not same:
            extra.append(f"attribute {p.name}={_show(value)}")
    return extra


def _defaults(node: Node) -> list[tuple[str, object]]:
    """(name, default or _MISSING) of each argument of the node's op, in order: from an ATen
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
    return [(p.name, _MISSING if p.default is inspect.Parameter.empty else p.default) for p in parameters
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _schema_defaults(schema) -> list[tuple[str, object]]:
    return [(a.name, a.default_value if a.has_default_value() else _MISSING) for a in schema.arguments]


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


def _normal(value: object) -> object:
    """A parameter value as comparable: sequences as tuples, dtypes by name, numbers as numbers."""
    if isinstance(value, (list, tuple, torch.Size)):
        return tuple(_normal(v) for v in value)
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, bool) or value is None:
        return (type(value).__name__, value)
    if isinstance(value, (torch.device, torch.layout, torch.memory_format)):
        return str(value)
    try:
        hash(value)
    except TypeError:                   # a mapping or another unhashable value: by its text
        return repr(value)
    return value


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _shown(values: tuple[object, ...]) -> str:
    return "{" + ", ".join(_show(v) for v in values) + "}"


# ---- reading operands and parameters off a node ---------------------------------------

def _tensor_metas(node: Node) -> list[tuple[tuple[int, ...], torch.dtype]] | None:
    """(shape, dtype) of each tensor of a tuple result, or None for a single tensor."""
    meta = node.meta.get("tensor_meta")
    if isinstance(meta, (list, tuple)) and not hasattr(meta, "shape"):
        if not all(hasattr(m, "shape") for m in meta):
            raise HandlerError(f"node {node.name!r} returns a tuple holding non-tensors; only tensors are supported")
        return [(tuple(m.shape), m.dtype) for m in meta]
    return None


def _tensor_meta(node: Node, index: int | None = None) -> tuple[tuple[int, ...], torch.dtype]:
    meta = node.meta.get("tensor_meta")
    if index is not None:
        metas = _tensor_metas(node)
        if metas is None and hasattr(meta, "shape"):
            raise HandlerError(f"node {node.name!r} returns one tensor where the spec reads element {index} of a "
                               f"tuple result: the call is another overload of the op than the spec serves")
        if metas is None or not 0 <= index < len(metas):
            raise HandlerError(f"node {node.name!r} has no tuple result element {index}")
        return metas[index]
    if meta is None or not hasattr(meta, "shape"):
        raise HandlerError(f"node {node.name!r} has no tensor shape; trace the module with shardverify.trace()")
    return tuple(meta.shape), meta.dtype


def _resolve_outputs(decl: OperandDecl, node: Node) -> list[tuple[str, OperationData]]:
    """(role, data) of the output(s) a declaration stands for."""
    if decl.index is not None:
        shape, dtype = _tensor_meta(node, decl.index)
        return [(decl.role, OperationData(f"{node.name}.{decl.index}", OperationDataType.OUTPUT, decl.role,
                                          shape, dtype, locator=OperandLocator("output", decl.index)))]
    metas = _tensor_metas(node)
    if metas is None:
        shape, dtype = _tensor_meta(node)
        return [(decl.role, OperationData(node.name, OperationDataType.OUTPUT, decl.role, shape, dtype,
                                          locator=OperandLocator("output")))]
    return [(f"{decl.role}.{i}", OperationData(f"{node.name}.{i}", OperationDataType.OUTPUT, f"{decl.role}.{i}",
                                               shape, dtype, locator=OperandLocator("output", i)))
            for i, (shape, dtype) in enumerate(metas)]


def _call_value(node: Node, index: int | None, keyword: str | None,
                varargs: bool = False) -> tuple[object, OperandLocator | None]:
    if varargs and index is not None and len(node.args) > index:
        rest = node.args[index:]
        if len(rest) > 1 or not isinstance(rest[0], (list, tuple, torch.Size)):
            return tuple(rest), OperandLocator("varargs", index)
    if index is not None and index < len(node.args):
        return node.args[index], OperandLocator("arg", index)
    if keyword is not None and keyword in node.kwargs:
        return node.kwargs[keyword], OperandLocator("kwarg", keyword)
    return _MISSING, None


def passes_nothing(handler: HandlerDef, node: Node, graph_module: GraphModule, role: str) -> bool:
    """Whether the call leaves operand ``role`` out altogether (omitted, None, a module
    attribute that is None), as opposed to filling its place with a number (``x + 2.0``): an op
    linear in a group of operands stays linear in the rest when one is left out, not when a
    constant takes its place."""
    decl = next((d for d in handler.operands if d.role == role), None)
    if decl is None:           # an element of a variadic operand (``tensors.1``): the call passes it
        return False
    if node.op == "call_module" and decl.attribute is not None:
        return getattr(graph_module.get_submodule(str(node.target)), decl.attribute, None) is None
    value, _ = _call_value(node, decl.index, decl.keyword)
    if decl.element is not None and isinstance(value, (list, tuple)):
        value = value[decl.element] if 0 <= decl.element < len(value) else None
    return value is _MISSING or value is None


def _attr_kind(graph_module: GraphModule, target: str) -> OperationDataType:
    try:
        graph_module.get_parameter(target)
    except AttributeError:
        return OperationDataType.BUFFER
    return OperationDataType.PARAM


def _resolve_one(decl: OperandDecl, handler: HandlerDef, node: Node,
                 graph_module: GraphModule) -> OperationData | None:
    if node.op == "call_module" and decl.attribute is not None:
        module = graph_module.get_submodule(str(node.target))
        value = getattr(module, decl.attribute, None)
        if value is None:
            if decl.optional:
                return None
            raise HandlerError(f"handler {handler.name!r}: module {node.target!r} ({type(module).__name__}) "
                               f"has no tensor attribute {decl.attribute!r} for operand {decl.role!r}")
        if not isinstance(value, torch.Tensor):
            raise HandlerError(f"handler {handler.name!r}: {node.target}.{decl.attribute} is a "
                               f"{type(value).__name__}, not a tensor")
        is_param = isinstance(value, torch.nn.Parameter)
        return OperationData(decl.attribute, OperationDataType.PARAM if is_param else OperationDataType.BUFFER,
                             decl.role, tuple(value.shape), value.dtype,
                             locator=OperandLocator("param" if is_param else "buffer", decl.attribute))
    value, locator = _call_value(node, decl.index, decl.keyword)
    if decl.element is not None and value is not _MISSING:
        if not isinstance(value, (list, tuple)) or not 0 <= decl.element < len(value):
            if decl.optional:
                return None
            raise HandlerError(f"handler {handler.name!r}: operand {decl.role!r} is element {decl.element} of "
                               f"a list argument, node {node.name!r} passes {value!r}")
        value, locator = value[decl.element], OperandLocator("item", (locator.key, decl.element))
        if value is None and not decl.optional:
            raise HandlerError(f"handler {handler.name!r}: node {node.name!r} passes None as element "
                               f"{decl.element} of its list argument, where the spec requires a tensor for "
                               f"operand {decl.role!r}")
    if value is _MISSING or value is None or (decl.optional and isinstance(value, (bool, int, float, complex))):
        if decl.optional:
            return None
        raise HandlerError(f"handler {handler.name!r}: node {node.name!r} has no argument for operand "
                           f"{decl.role!r} (index {decl.index}, keyword {decl.keyword!r})")
    if not isinstance(value, torch.fx.Node):
        raise HandlerError(f"handler {handler.name!r}: operand {decl.role!r} of node {node.name!r} is "
                           f"{value!r}, not a traced tensor")
    shape, dtype = _tensor_meta(value)
    kind = _attr_kind(graph_module, str(value.target)) if value.op == "get_attr" else OperationDataType.ARG
    return OperationData(value.name, kind, decl.role, shape, dtype, locator=locator)


def element_decls(decl: OperandDecl, node: Node) -> list[OperandDecl]:
    """A variadic operand as one declaration per element the call passes (``<role>.<i>``); any
    other operand as itself."""
    if not decl.variadic:
        return [decl]
    value, _ = _call_value(node, decl.index, decl.keyword)
    if not isinstance(value, (list, tuple)) or not value:
        raise HandlerError(f"operand {decl.role!r} is every element of a list argument; node {node.name!r} "
                           f"passes {value!r} there")
    return [dataclasses.replace(decl, role=f"{decl.role}.{i}", element=i, variadic=False) for i in range(len(value))]


def resolve_operands(handler: HandlerDef, node: Node, graph_module: GraphModule) -> dict[str, OperationData]:
    """Operand data by role, in declaration order with the output last; absent optionals
    omitted; a variadic operand as one operand per element (``tensors.0``, ``tensors.1``...)."""
    found: dict[str, OperationData] = {}
    decls = [one for decl in handler.operands for one in element_decls(decl, node)]
    for decl in sorted(decls, key=lambda d: d.kind == "output"):
        if decl.kind == "output":
            found.update(_resolve_outputs(decl, node))
            continue
        data = _resolve_one(decl, handler, node, graph_module)
        if data is not None:
            if any(other.name == data.name for other in found.values()):
                # one graph value in two operand slots (torch.cat((x, x))): each slot is its own
                # operand, with its own layout and resharding, named by its role
                data = dataclasses.replace(data, name=f"{data.name}@{decl.role}")
            found[decl.role] = data
    return found


def resolve_params(handler: HandlerDef, node: Node, graph_module: GraphModule | None = None) -> dict[str, object]:
    """Call parameters by name, defaults filled in (values exactly as written in the call); on a
    module call, a parameter the call does not pass is read from the module's attribute of
    the same name. A parameter computed by graph nodes is a :class:`Computed`."""
    params: dict[str, object] = {}
    module = graph_module.get_submodule(str(node.target)) if graph_module is not None and \
        node.op == "call_module" else None
    for decl in handler.params:
        value, _ = _call_value(node, decl.index, decl.keyword, decl.varargs)
        if value is _MISSING and module is not None and hasattr(module, decl.name):
            value = getattr(module, decl.name)      # nn.Softmax(dim=...), nn.LayerNorm.normalized_shape
        nested: list = []
        if value is not _MISSING:
            torch.fx.node.map_arg(value, nested.append)
        params[decl.name] = Computed(decl.name, tuple(n.name for n in nested)) if nested else \
            decl.default if value is _MISSING else value
    return params


def param_locator(handler: HandlerDef, node: Node, name: str) -> OperandLocator | None:
    """Where the call passes parameter ``name`` (None when it relies on the default), so a
    strategy can give the ranks a local value for it (:class:`shardverify.sharding.strategy.LocalArg`):
    on a module call that does not pass it, the module's attribute of that name (``groups``)."""
    decl = next((d for d in handler.params if d.name == name), None)
    if decl is None:
        raise HandlerError(f"handler {handler.name!r} declares no parameter {name!r}")
    found = _call_value(node, decl.index, decl.keyword, decl.varargs)[1]
    if found is None and node.op == "call_module":
        module = node.graph.owning_module.get_submodule(str(node.target))
        value = getattr(module, decl.name, None)
        if value is not None and not isinstance(value, torch.Tensor):
            return OperandLocator("attr", decl.name)
    return found
