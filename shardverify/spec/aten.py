"""ATen overloads as op spec targets: one rule serves the torch API and the ATen graph that
``torch.export`` captures.

A target ``torch.ops.aten.linear.default`` takes the spec's operand and parameter positions as
they are (most overloads share their torch function's schema), or the positions its ``args:``
mapping gives (``aten.embedding(weight, indices, ...)`` against ``F.embedding(input, weight)``).
Each position is checked against the overload's schema when the spec is read: it must exist, hold
a tensor for an operand (a tensor list for a list element) and a non-tensor for a parameter; the
keyword a graph or the harness uses is the schema's name for that position.
"""

from __future__ import annotations

import dataclasses

from shardverify.spec.fields import Fields, check_type, lookup
from shardverify.spec.loader import Node
from shardverify.spec.op_model import OperandDecl, ParamDecl
from shardverify.spec.values import index_value, names_of

__all__ = ["ATEN_PREFIX", "is_aten", "aten_positions", "parse_target_entry"]

ATEN_PREFIX = "torch.ops.aten."


def is_aten(name: str) -> bool:
    """Does the dotted target name an ATen overload (``torch.ops.aten.<op>.<overload>``)?"""
    return name.startswith(ATEN_PREFIX) and name.count(".") == 4


def _schema(node: Node, name: str):
    import torch

    overload = lookup(name)
    if not isinstance(overload, torch._ops.OpOverload):
        raise node.error(f"target {name!r} is not an ATen overload; name one with its overload, e.g. "
                         f"'torch.ops.aten.linear.default' (see torch.ops.aten.<op>.overloads())")
    return overload._schema


def _kind(argument) -> str:
    text = str(argument.type)
    if text.startswith("List[Tensor]") or text.startswith("List[Optional[Tensor]]"):
        return "tensor list"
    if text.startswith("Tensor") or text.startswith("Optional[Tensor]"):
        return "tensor"
    return "value"


def aten_positions(node: Node, name: str, args_node: Node | None, operands: list[OperandDecl],
                   params: list[ParamDecl]) -> tuple[tuple[OperandDecl, ...], tuple[ParamDecl, ...]]:
    """The spec's operands and parameters as the overload ``name`` takes them: positions from
    ``args:`` (role or parameter -> schema position) or the spec's own, keywords the schema's."""
    schema = _schema(node, name)
    arguments = list(schema.arguments)
    declared = {o.role for o in operands if o.kind != "output"} | {p.name for p in params}
    moved: dict[str, tuple[int, Node]] = {}
    if args_node is not None:
        check_type(args_node, dict)
        for key, value in names_of(args_node):
            if key not in declared:
                raise value.error(f"'{key}' is not an operand or parameter of the spec; declared: "
                                  f"{', '.join(sorted(declared))}")
            position = index_value(value)
            moved[key] = (position, value)  # type: ignore[assignment]
    by_position: dict[tuple[int, int | None], str] = {}

    def placed(what: str, index: int | None, keyword: str | None, want: str, where: Node,
               element: int | None = None) -> tuple[int | None, str | None]:
        if index is None:
            if keyword is None:
                return None, None
            found = next((i for i, a in enumerate(arguments) if a.name == keyword), None)
            if found is None:
                raise where.error(f"{what} is passed by keyword {keyword!r}, which {schema} does not take; "
                                  f"give its position in the target's 'args'")
            index = found
        if not 0 <= index < len(arguments):
            raise where.error(f"{what} sits at position {index}, but {schema} takes {len(arguments)} "
                              f"argument(s); give its position in the target's 'args'")
        argument = arguments[index]
        got = _kind(argument)
        if got != want:
            raise where.error(f"{what} sits at position {index}, which is '{argument.name}: {argument.type}' "
                              f"in {schema} (a {got}, not a {want}); give its position in the target's 'args'")
        slot = (index, element)
        if slot in by_position:
            raise where.error(f"{what} and '{by_position[slot]}' both sit at position {index} of {schema}")
        by_position[slot] = what
        if argument.kwarg_only:
            return None, argument.name
        return index, argument.name

    new_operands = []
    for o in operands:
        if o.kind == "output":
            new_operands.append(o)
            continue
        if o.kind == "param" and o.index is None and o.keyword is None and o.role not in moved:
            raise node.error(f"param operand '{o.role}' is a module attribute; an ATen target takes it as "
                             f"an argument: give its position in 'args'")
        index, where = moved.get(o.role, (o.index, node))
        want = "tensor list" if o.element is not None or o.variadic else "tensor"
        index, keyword = placed(f"operand '{o.role}'", index, None if o.role in moved else o.keyword, want,
                                where, o.element)
        new_operands.append(dataclasses.replace(o, index=index, keyword=keyword, attribute=None))
    new_params = []
    for p in params:
        index, where = moved.get(p.name, (p.index, node))
        index, keyword = placed(f"parameter '{p.name}'", index, None if p.name in moved else p.keyword or p.name,
                                "value", where)
        new_params.append(dataclasses.replace(p, index=index, keyword=keyword))
    return tuple(new_operands), tuple(new_params)


def parse_target_entry(item: Node) -> tuple[Node, Node | None, Node | None]:
    """A ``targets:`` entry: a dotted name, or ``{target: NAME, args: {role: position}, where:
    {grid key: value}}``: ``args`` for an ATen overload whose argument order differs from the
    spec's, ``where`` for a target that takes only some grid points (``aten.squeeze.dim`` an int
    dim, ``aten.squeeze.dims`` a list)."""
    if not isinstance(item.value, dict):
        return item, None, None
    f = Fields(item)
    target = f.required("target", str)
    args = f.optional("args", dict)
    where = f.optional("where", dict)
    f.finish()
    return target, args, where
