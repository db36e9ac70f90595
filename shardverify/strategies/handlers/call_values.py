"""Reading a call through a handler's declarations: its operands (shape, dtype, where each sits:
:class:`~shardverify.sharding.strategy.OperationData`), its parameters (defaults filled in, a
computed one as :class:`~shardverify.strategies.handlers.base.Computed`), where a parameter is
passed, and whether the call passes tensors exactly where the handler declares them."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from shardverify.capture.call import called_module
from shardverify.capture.meta import output_metas, tensor_meta
from shardverify.errors import HandlerError
from shardverify.sharding.strategy import OperandLocator, OperationData, OperationDataType
from shardverify.strategies.handlers.base import Computed, HandlerDef, OperandDecl

if TYPE_CHECKING:
    from torch.fx import GraphModule, Node

__all__ = ["MISSING", "call_value", "is_tensor", "takes_call", "passes_nothing", "element_decls", "resolve_operands",
           "resolve_params", "param_locator"]

#: an argument the call does not pass
MISSING = object()


def is_tensor(value: object) -> bool:
    if not isinstance(value, torch.fx.Node):
        return False
    return tensor_meta(value) is not None or isinstance(value.meta.get("val"), torch.Tensor)


def takes_call(handler: HandlerDef, node: Node) -> bool:
    """Does the call pass tensors exactly where ``handler`` declares tensor operands: every
    required one a tensor, an optional one a tensor or nothing, no tensor where it declares a
    number, none it does not declare? Picks among the handlers of one target that
    :func:`signature_apart` tells apart."""
    if node.op not in ("call_function", "call_method"):
        return True
    # a function call passes at its index or keyword even an operand a module holds as an attribute
    tensors = [d for d in handler.operands if d.kind != "output" and (d.index is not None or d.keyword)]
    for decl in tensors:
        value, _ = call_value(node, decl.index, decl.keyword)
        if decl.element is None and not is_tensor(value) and not (decl.optional and (value is MISSING or value is None)):
            return False
    for decl in handler.params:
        if is_tensor(call_value(node, decl.index, decl.keyword, decl.varargs)[0]):
            return False
    indices = {d.index for d in tensors if d.index is not None}
    keywords = {d.keyword for d in tensors if d.keyword}
    if not (all(i in indices for i, value in enumerate(node.args) if is_tensor(value)) and
            all(key in keywords for key, value in node.kwargs.items() if is_tensor(value))):
        return False
    return _reads_call(handler, node)


def _reads_call(handler: HandlerDef, node: Node) -> bool:
    """Does ``handler`` read what the call passes and returns: an argument at every position and
    keyword (other than None) the call fills, a bool where it reads a flag (a parameter verified at
    bools only), one tensor or a tuple result as it declares? Tells apart the rules of one target
    that :func:`flags_apart` and :func:`signature_apart` (by the result) allow."""
    declared = [*handler.operands, *handler.params]
    if any(d.kind == "output" and d.index is not None for d in handler.operands) and \
            tensor_meta(node) is not None:
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
            value, _ = call_value(node, decl.index, decl.keyword, decl.varargs)
            if value is not MISSING and value is not None and not isinstance(value, bool):
                return False
    return True


def _tensor_metas(node: Node) -> list[tuple[tuple[int, ...], torch.dtype]] | None:
    """(shape, dtype) of each tensor of a tuple result, or None for a single tensor."""
    metas = output_metas(node) if tensor_meta(node) is None else None
    if metas is None:
        return None
    if None in metas:
        raise HandlerError(f"node {node.name!r} returns a tuple holding non-tensors; only tensors are supported")
    return [(tuple(m.shape), m.dtype) for m in metas]


def _tensor_meta(node: Node, index: int | None = None) -> tuple[tuple[int, ...], torch.dtype]:
    meta = tensor_meta(node)
    if index is not None:
        metas = _tensor_metas(node)
        if metas is None and meta is not None:
            raise HandlerError(f"node {node.name!r} returns one tensor where the spec reads element {index} of a "
                               f"tuple result: the call is another overload of the op than the spec serves")
        if metas is None or not 0 <= index < len(metas):
            raise HandlerError(f"node {node.name!r} has no tuple result element {index}")
        return metas[index]
    if meta is None:
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


def call_value(node: Node, index: int | None, keyword: str | None,
                varargs: bool = False) -> tuple[object, OperandLocator | None]:
    if varargs and index is not None and len(node.args) > index:
        rest = node.args[index:]
        if len(rest) > 1 or not isinstance(rest[0], (list, tuple, torch.Size)):
            return tuple(rest), OperandLocator("varargs", index)
    if index is not None and index < len(node.args):
        return node.args[index], OperandLocator("arg", index)
    if keyword is not None and keyword in node.kwargs:
        return node.kwargs[keyword], OperandLocator("kwarg", keyword)
    return MISSING, None


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
    value, _ = call_value(node, decl.index, decl.keyword)
    if decl.element is not None and isinstance(value, (list, tuple)):
        value = value[decl.element] if 0 <= decl.element < len(value) else None
    return value is MISSING or value is None


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
    value, locator = call_value(node, decl.index, decl.keyword)
    if decl.element is not None and value is not MISSING:
        if not isinstance(value, (list, tuple)) or not 0 <= decl.element < len(value):
            if decl.optional:
                return None
            raise HandlerError(f"{handler.name} ({handler.spec_file or 'its spec'}): operand {decl.role!r} is "
                               f"element {decl.element} of a list argument, node {node.name!r} passes {value!r}")
        value, locator = value[decl.element], OperandLocator("item", (locator.key, decl.element))
        if value is None and not decl.optional:
            raise HandlerError(f"{handler.name} ({handler.spec_file or 'its spec'}): node {node.name!r} passes "
                               f"None as element {decl.element} of its list argument, where the spec requires a "
                               f"tensor for operand {decl.role!r}")
    if value is MISSING or value is None or (decl.optional and isinstance(value, (bool, int, float, complex))):
        if decl.optional:
            return None
        raise HandlerError(f"{handler.name} ({handler.spec_file or 'its spec'}): node {node.name!r} passes no "
                           f"{decl.role!r} (argument {decl.index}, keyword {decl.keyword!r}), which the spec "
                           f"requires; a spec for the call without it serves it")
    if not isinstance(value, torch.fx.Node):
        raise HandlerError(f"{handler.name} ({handler.spec_file or 'its spec'}): node {node.name!r} passes "
                           f"{value!r} as {decl.role!r}, where the spec takes a tensor; a spec for the call with a "
                           f"number there serves it")
    shape, dtype = _tensor_meta(value)
    kind = _attr_kind(graph_module, str(value.target)) if value.op == "get_attr" else OperationDataType.ARG
    return OperationData(value.name, kind, decl.role, shape, dtype, locator=locator)


def element_decls(decl: OperandDecl, node: Node) -> list[OperandDecl]:
    """A variadic operand as one declaration per element the call passes (``<role>.<i>``); any
    other operand as itself."""
    if not decl.variadic:
        return [decl]
    value, _ = call_value(node, decl.index, decl.keyword)
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
    module = called_module(graph_module, node) if graph_module is not None else None
    for decl in handler.params:
        value, _ = call_value(node, decl.index, decl.keyword, decl.varargs)
        if value is MISSING and module is not None and hasattr(module, decl.name):
            value = getattr(module, decl.name)      # nn.Softmax(dim=...), nn.LayerNorm.normalized_shape
        nested: list = []
        if value is not MISSING:
            torch.fx.node.map_arg(value, nested.append)
        params[decl.name] = Computed(decl.name, tuple(n.name for n in nested)) if nested else \
            decl.default if value is MISSING else value
    return params


def param_locator(handler: HandlerDef, node: Node, name: str) -> OperandLocator | None:
    """Where the call passes parameter ``name`` (None when it relies on the default), so a
    strategy can give the ranks a local value for it (:class:`shardverify.sharding.strategy.LocalArg`):
    on a module call that does not pass it, the module's attribute of that name (``groups``)."""
    decl = next((d for d in handler.params if d.name == name), None)
    if decl is None:
        raise HandlerError(f"handler {handler.name!r} declares no parameter {name!r}")
    found = call_value(node, decl.index, decl.keyword, decl.varargs)[1]
    if found is None and node.op == "call_module":
        module = node.graph.owning_module.get_submodule(str(node.target))
        value = getattr(module, decl.name, None)
        if value is not None and not isinstance(value, torch.Tensor):
            return OperandLocator("attr", decl.name)
    return found
