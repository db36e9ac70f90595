"""Handlers are data: which torch targets an op covers, where its operands and parameters
sit in the call, and which generic strategy generator builds its strategies; and the registry
that holds them by target.

Generated handler modules (``handlers/generated/``) only call :func:`register_handler`;
all op knowledge lives in the :class:`HandlerDef` and the rule it holds as parsed. Reading a call's
operands and parameters is :mod:`~shardverify.strategies.handlers.call_values`; which handler
serves a call, and whether its grid verified it, :mod:`~shardverify.strategies.handlers.serving`.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardverify.errors import HandlerError
from shardverify.strategies.declarations import OperandDecl, ParamDecl

if TYPE_CHECKING:
    from torch.fx import GraphModule, Node

    from shardverify.strategies.options import ParsedOptions

__all__ = [
    "HandlerDef", "OperandDecl", "ParamDecl", "Computed", "register_handler", "unregister_handler",
    "registered_handlers", "candidates", "target_key", "bound_apart", "signature_apart", "comparable", "flags_apart",
]

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
    #: the generator family's options as the spec parsed them (the rules family's
    #: :class:`~shardverify.strategies.rules.sources.RuleSpec`, with the YAML line it came from);
    #: a generated handler holds it as a literal, so nothing is parsed again where it serves
    rule: ParsedOptions | None = None
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
    #: (role, dtype name) of each tensor the spec's grid draws: a call passing a tensor of another
    #: kind (an integer or bool where floats were drawn) is outside the grid (integer division by
    #: zero, a count summed as bools)
    dtypes: tuple[tuple[str, str], ...] = ()
    #: the spec's ``verify.isolate``: a call verified where it is met is checked in a child
    #: process (the op's kernel can corrupt memory or trap on a wrong layout's local shapes)
    isolate: bool = False

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
    def where(self) -> str:
        """Where the handler's rule is written: its ``file:line``, else its spec file."""
        return str(getattr(self.rule, "at", "") or self.spec_file)

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
    return any(not {comparable(v) for v in a[name]} & {comparable(v) for v in values}
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


def candidates(node: Node, graph_module: GraphModule) -> tuple[HandlerDef, ...]:
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


def comparable(value: object) -> object:
    """A parameter value as comparable: sequences as tuples, dtypes by name, numbers as numbers."""
    if isinstance(value, (list, tuple, torch.Size)):
        return tuple(comparable(v) for v in value)
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
