"""Parsing an op spec: one YAML file per op in specs/, into the frozen dataclasses of
:mod:`shardverify.spec.op_model` (re-exported here).

`parse_op_spec` validates everything eagerly (one SpecError naming file, line and field), so
the op kind (`shardverify.spec.op_kind`), the verifier, the explorer and the audit only
read validated values. The ``generator:`` section is parsed by :mod:`shardverify.spec.op_generator`
(the rule, parsed once and carried as ``OpSpec.rule``), the ``verify:`` section by
:mod:`shardverify.spec.op_verify`.
See specs/README.md for the format.
"""

from __future__ import annotations

import dataclasses
import math

from shardverify.spec.accept import parse_audit
from shardverify.spec.aten import aten_positions, is_aten, parse_target_entry
from shardverify.spec.fields import Fields, as_identifier, check_type, resolve_target, target_form
from shardverify.spec.limits import MAX_CASES
from shardverify.spec.loader import Node
from shardverify.spec.op_model import (
    CaseSpec, CountSpec, InputSpec, ModuleInit, OperandDecl, OpSpec, ParamDecl, TargetSpec, VerifySpec, case_spec)
from shardverify.spec.op_generator import parse_generator
from shardverify.spec.op_verify import check_where_lengths, parse_verify
from shardverify.spec.values import index_value, literal, names_of, parse_where, within
from shardverify.strategies.declarations import OPERAND_KINDS
from shardverify.strategies.rules.sources import RuleSpec

__all__ = ["OperandDecl", "ParamDecl", "TargetSpec", "InputSpec", "ModuleInit", "CountSpec",
           "VerifySpec", "OpSpec", "CaseSpec", "parse_op_spec", "parse_where", "case_spec"]



# --------------------------------------------------------------------------------- parsing

def _parse_operand(role: str, node: Node) -> OperandDecl:
    f = Fields(node)
    kind_node = f.required("kind", str)
    if kind_node.value not in OPERAND_KINDS:
        raise kind_node.error(f"expected one of {', '.join(OPERAND_KINDS)}, got {kind_node.value!r}")
    index = index_value(f.optional("index", int))
    kw_node = f.optional("keyword", str)
    attr_node = f.optional("attribute", str)
    opt_node = f.optional("optional", bool)
    element = index_value(f.optional("element", int))
    elements_node = f.optional("elements", str)
    f.finish()
    if elements_node is not None and (elements_node.value != "all" or element is not None):
        raise elements_node.error("'elements' takes 'all' (every element of the list argument at 'index' is an "
                                  "operand of this role), without 'element'")
    kind, optional, variadic = str(kind_node.value), bool(opt_node.value) if opt_node else False, \
        elements_node is not None
    if variadic and (kind != "input" or index is None or optional):
        raise node.error(f"operand '{role}': 'elements: all' needs a required input operand with an 'index' "
                         "(the list argument)")
    if kind == "output" and (kw_node or attr_node or optional or element is not None):
        raise node.error(f"output operand '{role}' takes no keyword, attribute, element or optional "
                         "(an index picks an element of a tuple result)")
    if element is not None and (kind != "input" or index is None):
        raise node.error(f"operand '{role}': 'element' needs an input operand with an 'index' (the list argument)")
    if kind == "input" and index is None and kw_node is None:
        raise node.error(f"input operand '{role}' needs an 'index' or a 'keyword'")
    if kind == "input" and attr_node is not None:
        raise attr_node.error(f"input operand '{role}' cannot have a module attribute; use kind: param")
    if kind == "param" and index is None and kw_node is None and attr_node is None:
        raise node.error(f"param operand '{role}' needs an 'attribute', 'index' or 'keyword'")
    return OperandDecl(role=role, kind=kind, index=index, keyword=as_identifier(kw_node) if kw_node else None,
                       attribute=as_identifier(attr_node) if attr_node else None, optional=optional,
                       element=element, variadic=variadic)


def _parse_param(name: str, node: Node) -> ParamDecl:
    f = Fields(node)
    index = index_value(f.optional("index", int))
    kw_node = f.optional("keyword", str)
    default = f.optional("default", object)
    varargs = f.optional("varargs", bool)
    serves = f.optional("serves", str)
    choices = f.optional("choices", list)
    f.finish()
    if choices is not None and (not choices.value or serves is None):
        raise choices.error(f"parameter '{name}': 'choices' lists every value the op takes (non-empty), for the "
                            f"property tests to draw beyond the grid; it goes with 'serves: any'")
    if serves is not None and serves.value != "any":
        raise serves.error(f"parameter '{name}': 'serves' is 'any' (the rule holds for every value: say why "
                           f"in a comment) or left out (the rule serves the values the grid verifies), "
                           f"got {serves.value!r}")
    if index is None and kw_node is None:
        raise node.error(f"parameter '{name}' needs an 'index' or a 'keyword'")
    if varargs is not None and varargs.value and index is None:
        raise varargs.error(f"parameter '{name}': 'varargs' reads the positional arguments from 'index' on; "
                            "give it an index")
    return ParamDecl(name=name, index=index, keyword=as_identifier(kw_node) if kw_node else None,
                     default=literal(default) if default is not None else None,
                     varargs=bool(varargs.value) if varargs is not None else False, any_value=serves is not None,
                     choices=literal(choices) if choices is not None else ())


def parse_op_spec(root: Node) -> OpSpec:
    """Validate one op spec tree; raises a SpecError naming file, line and field."""
    f = Fields(root)
    name = as_identifier(f.required("op", str))
    desc_node = f.optional("description", str)
    targets_node = f.required("targets", list)
    operands_node = f.required("operands", dict)
    params_node = f.optional("params", dict)
    generator_node = f.required("generator", dict)
    verify_node = f.required("verify", dict)
    audit_node = f.optional("audit", dict)
    ignores_node = f.optional("ignores", list)
    f.finish()
    ignores = tuple(as_identifier(check_type(item, str)) for item in ignores_node.value) if ignores_node else ()  # type: ignore[union-attr]

    if not targets_node.value:
        raise targets_node.error("list at least one target")
    targets = []
    entries: list[tuple[Node, Node | None, Node | None]] = []   # per target: its name, args and where nodes
    for item in targets_node.value:  # type: ignore[union-attr]
        name_node, args_node, where_node = parse_target_entry(item)
        target = resolve_target(name_node)
        if any(t.name == target for t in targets):
            raise item.error(f"target {target!r} is listed twice")
        if args_node is not None and not is_aten(target):
            raise args_node.error(f"'args' places the spec's operands at an ATen overload's positions; "
                                  f"{target!r} is not one (torch.ops.aten.<op>.<overload>)")
        targets.append(TargetSpec(target, target_form(name_node, target), aten=is_aten(target)))
        entries.append((name_node, args_node, where_node))

    operands = [_parse_operand(role, value) for role, value in names_of(operands_node)]
    outputs = [o for o in operands if o.kind == "output"]
    if not outputs:
        raise operands_node.error("declare an operand of kind 'output'")
    if len(outputs) > 1 and any(o.index is None for o in outputs):
        raise operands_node.error("several outputs each need an 'index' (their position in the tuple result)")
    params = [_parse_param(pname, value) for pname, value in names_of(params_node)] if params_node else []
    roles = {o.role for o in operands}
    for p in params:
        if p.name in roles:
            raise params_node.value[p.name].error(  # type: ignore[union-attr,index]
                f"'{p.name}' is declared both as an operand and as a parameter")
    _check_slots(operands, params, operands_node, params_node)
    for position, (target, (name_node, args_node, _)) in enumerate(zip(targets, entries)):
        if target.aten:
            at_operands, at_params = aten_positions(name_node, target.name, args_node, operands, params)
            targets[position] = dataclasses.replace(target, operands=at_operands, params=at_params)
    forms = {t.form for t in targets if not t.aten}
    if "module" in forms:
        for o in operands:
            if o.kind == "param" and o.attribute is None:
                raise operands_node.value[o.role].error(  # type: ignore[index]
                    f"param operand '{o.role}' needs an 'attribute' for the module target(s)")
            if o.kind == "input" and o.index is None:
                raise operands_node.value[o.role].error(  # type: ignore[index]
                    f"input operand '{o.role}' needs an 'index' for the module target(s)")
    if forms & {"function", "method"}:
        for o in operands:
            if o.kind == "param" and o.index is None and o.keyword is None:
                raise operands_node.value[o.role].error(  # type: ignore[index]
                    f"param operand '{o.role}' needs an 'index' or 'keyword' for the function target(s)")

    family, options, rule = parse_generator(generator_node, params, operands)
    constant = rule.modifiers.constant if isinstance(rule, RuleSpec) else ()
    verify = parse_verify(verify_node, targets, operands, params, constant)
    for position, (target, (_, _, where_node)) in enumerate(zip(targets, entries)):
        if where_node is not None:
            where = parse_where(where_node, dict(verify.grid))
            if not where:
                raise where_node.error("'where' selects grid points: name at least one grid key")
            targets[position] = dataclasses.replace(target, where=where)
            check_where_lengths(where_node, target.name, dict(where), verify, params)
    accept, audit_meshes, audit_skip = parse_audit(audit_node, roles, dict(verify.grid), verify.meshes)
    points = math.prod(len(values) for _, values in verify.grid)
    within(verify_node, [MAX_CASES.exceeded(len(targets) * points)])
    return OpSpec(name=name, source=root.file, targets=tuple(targets), operands=tuple(operands),
                  params=tuple(params), generator=family, options=options, verify=verify,
                  description=str(desc_node.value) if desc_node else "", audit_accept=accept, ignores=ignores,
                  audit_meshes=audit_meshes, audit_skip=audit_skip, rule=rule)


def _check_slots(operands: list[OperandDecl], params: list[ParamDecl], operands_node: Node,
                 params_node: Node | None) -> None:
    """Positional indices and keywords are each used once across operands and params."""
    seen_index: dict[int, str] = {}
    seen_kw: dict[str, str] = {}
    entries = [(o.role, o.index if o.element is None else (o.index, o.element), o.keyword, operands_node)
               for o in operands if o.kind != "output"]
    entries += [(p.name, p.index, p.keyword, params_node) for p in params]
    for name, index, kw, parent in entries:
        node = parent.value[name]  # type: ignore[union-attr,index]
        if index is not None:
            if index in seen_index:
                raise node.error(f"positional index {index} of '{name}' is already used by '{seen_index[index]}'")
            seen_index[index] = name
        if kw is not None:
            if kw in seen_kw:
                raise node.error(f"keyword '{kw}' of '{name}' is already used by '{seen_kw[kw]}'")
            seen_kw[kw] = name
