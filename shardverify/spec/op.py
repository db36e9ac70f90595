"""Parsing an op spec: one YAML file per op in specs/, into the frozen dataclasses of
:mod:`shardverify.spec.op_model` (re-exported here).

`parse_op_spec` validates everything eagerly (one SpecError naming file, line and field), so
the renderer (`shardverify.codegen.op_kind`), the verifier, the explorer and the audit only
read validated values. See specs/README.md for the format.
"""

from __future__ import annotations

import dataclasses
import math

from shardverify.errors import InvalidArgument
from shardverify.spec.accept import parse_audit
from shardverify.spec.aten import aten_positions, is_aten, parse_target_entry
from shardverify.spec.fields import (
    Fields, as_dtype, as_identifier, as_shape, as_tolerance, check_type, describe, dtype_from_name, finite_number, lookup,
    resolve_target)
from shardverify.spec.limits import MAX_CASES, mesh_problem, tensor_size_problems
from shardverify.spec.loader import Node
from shardverify.spec.case import InputDecl
from shardverify.spec.op_model import (
    CaseSpec, CountSpec, InputSpec, ModuleInit, OperandSpec, OpSpec, ParamSpec, TargetSpec, VerifySpec, case_spec,
    value_length)
from shardverify.spec.values import (
    Literal, index_value, literal, names_of, option, parse_grid, parse_where, within)
from shardverify.strategies.generators.registry import get_generator
from shardverify.strategies.rules.spec import RuleOptions

__all__ = ["OperandSpec", "ParamSpec", "TargetSpec", "InputSpec", "ModuleInit", "CountSpec",
           "VerifySpec", "OpSpec", "CaseSpec", "parse_op_spec", "parse_where", "case_spec"]

OPERAND_KINDS = ("input", "param", "output")


# --------------------------------------------------------------------------------- parsing


def _target_form(node: Node, name: str) -> str:
    import torch

    obj = lookup(name)
    if isinstance(obj, type):
        if issubclass(obj, torch.nn.Module):
            return "module"
        raise node.error(f"target {name!r} is a class but not a torch.nn.Module")
    if name.startswith("torch.Tensor."):
        return "method"
    return "function"


def _parse_operand(role: str, node: Node) -> OperandSpec:
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
    operand = OperandSpec(role=role, kind=str(kind_node.value), index=index,
                          keyword=as_identifier(kw_node) if kw_node else None,
                          attribute=as_identifier(attr_node) if attr_node else None,
                          optional=bool(opt_node.value) if opt_node else False, element=element,
                          variadic=elements_node is not None)
    if operand.variadic and (operand.kind != "input" or index is None or operand.optional):
        raise node.error(f"operand '{role}': 'elements: all' needs a required input operand with an 'index' "
                         "(the list argument)")
    if operand.kind == "output" and (kw_node or attr_node or operand.optional or element is not None):
        raise node.error(f"output operand '{role}' takes no keyword, attribute, element or optional "
                         "(an index picks an element of a tuple result)")
    if element is not None and (operand.kind != "input" or index is None):
        raise node.error(f"operand '{role}': 'element' needs an input operand with an 'index' (the list argument)")
    if operand.kind == "input" and index is None and kw_node is None:
        raise node.error(f"input operand '{role}' needs an 'index' or a 'keyword'")
    if operand.kind == "input" and attr_node is not None:
        raise attr_node.error(f"input operand '{role}' cannot have a module attribute; use kind: param")
    if operand.kind == "param" and index is None and kw_node is None and attr_node is None:
        raise node.error(f"param operand '{role}' needs an 'attribute', 'index' or 'keyword'")
    return operand


def _parse_param(name: str, node: Node) -> ParamSpec:
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
    return ParamSpec(name=name, index=index, keyword=as_identifier(kw_node) if kw_node else None,
                     default=literal(default) if default is not None else None,
                     varargs=bool(varargs.value) if varargs is not None else False, any_value=serves is not None,
                     choices=literal(choices) if choices is not None else ())


def _parse_module_init(node: Node, *, with_target: bool) -> ModuleInit:
    f = Fields(node)
    target = None
    if with_target:
        target_node = f.required("target", str)
        target = resolve_target(target_node)
        if _target_form(target_node, target) != "module":
            raise target_node.error(f"expected a torch.nn.Module class, got {target!r}")
    args_node = f.optional("args", list)
    kwargs_node = f.optional("kwargs", dict)
    f.finish()
    args = tuple(literal(item) for item in args_node.value) if args_node else ()  # type: ignore[union-attr]
    kwargs = tuple((key, literal(value)) for key, value in names_of(kwargs_node)) if kwargs_node else ()
    return ModuleInit(target=target, args=args, kwargs=kwargs)


def _parse_counts(node: Node, grid: dict[str, tuple[Literal, ...]], meshes: tuple[tuple[int, ...], ...],
                  targets: tuple[TargetSpec, ...]) -> tuple[CountSpec, ...]:
    counts = []
    for item in check_type(node, list).value:  # type: ignore[union-attr]
        f = Fields(item)
        mesh_node = f.required("mesh", list)
        count_node = f.required("count", int)
        where_node = f.optional("where", dict)
        target_node = f.optional("target", str)
        f.finish()
        mesh = as_shape(mesh_node, allow_empty=False)
        if mesh not in meshes:
            raise mesh_node.error(f"mesh {list(mesh)} is not one of verify.meshes "
                                  f"{[list(m) for m in meshes]}")
        if count_node.value < 0:  # type: ignore[operator]
            raise count_node.error(f"expected a non-negative count, got {count_node.value!r}")
        where = parse_where(where_node, grid)
        target = None
        if target_node is not None:
            target = str(target_node.value)
            if target not in [t.name for t in targets]:
                raise target_node.error(f"target {target!r} is not one of the spec's targets "
                                        f"{[t.name for t in targets]}")
        counts.append(CountSpec(mesh=mesh, count=int(count_node.value), where=where,  # type: ignore[arg-type]
                                target=target))
    return tuple(counts)


def _check_option_refs(node: Node, params: set[str], roles: set[str]) -> None:
    """Option keys ending in _param(s)/_operand(s), at any depth, name declared parameters /
    operand roles (a mapping under a _params key by its keys), so a typo is caught here rather
    than by the generator at test time."""
    for key, child in node.value.items():  # type: ignore[union-attr]
        if isinstance(child.value, dict) and key.endswith("_params"):   # size_params: {N: n}: the keys
            for name in child.value:
                if name not in params:
                    raise child.error(f"option '{key}' names parameter {name!r}, which the spec does not "
                                      f"declare; declared: {', '.join(sorted(params)) or 'none'}")
            continue
        if isinstance(child.value, dict):
            _check_option_refs(child, params, roles)
            continue
        for suffix, declared, what in (("_param", params, "parameter"), ("_operand", roles, "operand")):
            if not (key.endswith(suffix) or key.endswith(suffix + "s")):
                continue
            items = child.value if isinstance(child.value, list) else [child]
            for item in items:
                if not isinstance(item.value, str):
                    raise item.error(f"option '{key}' must name a {what} (a string), got {describe(item)}")
                if item.value not in declared:
                    raise item.error(f"option '{key}' names {what} {item.value!r}, which the spec does "
                                     f"not declare; declared: {', '.join(sorted(declared)) or 'none'}")


def _check_rule(node: Node, options: tuple[tuple[str, Literal], ...], roles: set[str]) -> RuleOptions:
    """A `rules` generator's options form a valid rule (see shardverify/strategies/rules/spec.py);
    returns it."""
    try:
        rule = RuleOptions.from_options(dict(options))
    except InvalidArgument as exc:
        raise node.error(f"invalid sharding rule: {exc}") from None
    linear = {role.rstrip("?") for group in rule.linear_in for role in group}
    for key, named in (("additive_operands", rule.additive), ("constant_operands", rule.constant),
                       ("linear_in", linear), ("monotone_in", {role for role, _, _ in rule.monotone_in})):
        missing = sorted(set(named) - roles)
        if missing:
            raise node.error(f"{key} names {missing}, which are not operands; declared: {sorted(roles)}")
    if linear & set(rule.additive):
        raise node.error(f"linear_in names additive operand(s) {sorted(linear & set(rule.additive))}: they are added "
                         f"after a partial output is reduced, so they never reach the op as partial sums")
    missing = sorted({role for role, _ in rule.indices} - roles)
    if missing:
        raise node.error(f"indices names {missing}, which are not operands; declared: {sorted(roles)}")
    return rule


def _check_index_list(node: Node, operands: list[OperandSpec]) -> None:
    """``advanced_index`` reads the tensor operands as the indexed input followed by the
    elements of one index list in order, so the spec must declare them so."""
    tensors = [o for o in operands if o.kind != "output"]
    first, rest = tensors[0], tensors[1:]
    if first.element is not None or not rest or \
            any(o.element != k or o.index != rest[0].index for k, o in enumerate(rest)):
        raise node.error("advanced_index needs the indexed input first, then the index tensors as elements "
                         "0, 1, ... of one list argument, in that order; declared: " +
                         ", ".join(f"{o.role} (index {o.index}, element {o.element})" for o in tensors))


def _check_generator(node: Node) -> str:
    family = as_identifier(node)
    try:
        get_generator(family)
    except Exception as exc:  # the registry's own "unknown generator" error, whatever its class
        raise node.error(f"unknown generator family {family!r}: {exc}") from None
    return family


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
        targets.append(TargetSpec(target, _target_form(name_node, target), aten=is_aten(target)))
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

    g = Fields(generator_node)
    family = _check_generator(g.required("family", str))
    options_node = g.optional("options", dict)
    g.finish()
    options = tuple((key, option(value)) for key, value in names_of(options_node)) if options_node else ()
    if options_node is not None:
        _check_option_refs(options_node, {p.name for p in params}, roles)
    rule = _check_rule(options_node or generator_node, options, roles) if family == "rules" else None
    if rule is not None and rule.source == "advanced_index":
        _check_index_list(options_node or generator_node, operands)
    verify = _parse_verify(verify_node, targets, operands, params, rule.constant if rule is not None else ())
    for position, (target, (_, _, where_node)) in enumerate(zip(targets, entries)):
        if where_node is not None:
            where = parse_where(where_node, dict(verify.grid))
            if not where:
                raise where_node.error("'where' selects grid points: name at least one grid key")
            targets[position] = dataclasses.replace(target, where=where)
            _check_where_lengths(where_node, target.name, dict(where), verify, params)
    accept, audit_meshes, audit_skip = parse_audit(audit_node, roles, dict(verify.grid), verify.meshes)
    points = math.prod(len(values) for _, values in verify.grid)
    within(verify_node, [MAX_CASES.exceeded(len(targets) * points)])
    return OpSpec(name=name, source=root.file, targets=tuple(targets), operands=tuple(operands),
                  params=tuple(params), generator=family, options=options, verify=verify,
                  description=str(desc_node.value) if desc_node else "", audit_accept=accept, ignores=ignores,
                  audit_meshes=audit_meshes, audit_skip=audit_skip)


def _check_slots(operands: list[OperandSpec], params: list[ParamSpec], operands_node: Node,
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


def _parse_verify(node: Node, targets: list[TargetSpec], operands: list[OperandSpec],
                  params: list[ParamSpec], constant: tuple[str, ...] = ()) -> VerifySpec:
    """``constant``: the operands the op takes no gradient for (the rule's ``constant_operands``),
    drawn without one."""
    f = Fields(node)
    inputs_node = f.optional("inputs", dict)
    module_node = f.optional("module", dict)
    pred_node = f.optional("predecessor", dict)
    grid_node = f.optional("grid", dict)
    meshes_node = f.required("meshes", list)
    counts_node = f.optional("strategies", list)
    tol_node = f.optional("tolerance", dict)
    seed_node = f.optional("seed", int)
    explore_node = f.optional("explore", bool)
    same_length_node = f.optional("same_length", list)
    f.finish()
    forms = {t.form for t in targets}
    by_role = {o.role: o for o in operands}

    inputs = []
    tensor_inputs = [o for o in operands if o.kind == "input"]
    if inputs_node is None:
        if tensor_inputs:
            raise node.error("missing required key 'inputs' in 'verify' (the shape of each tensor operand)")
        inputs_node = node   # a factory (torch.full): no tensor to draw
    for role, value in names_of(inputs_node) if inputs_node is not node else ():
        operand = by_role.get(role)
        if operand is None or operand.kind == "output":
            raise value.error(f"'{role}' is not an input or param operand; declared: "
                              f"{', '.join(o.role for o in operands if o.kind != 'output')}")
        fi = Fields(value)
        shape = as_shape(fi.required("shape", list))
        dtype_node = fi.optional("dtype", str)
        values_node = fi.optional("values", list)
        data_node = fi.optional("data", list)
        fi.finish()
        within(value, tensor_size_problems([(f"input '{role}'", shape)]))
        dtype = as_dtype(dtype_node) if dtype_node else "float32"
        inputs.append(InputSpec(role, shape, dtype, _value_range(values_node, dtype) if values_node else None,
                                grad=role not in constant, data=_data(data_node, shape, dtype) if data_node else None))
    given = {i.role for i in inputs}
    for o in operands:
        needed = o.kind == "input" or (o.kind == "param" and forms & {"function", "method"})
        if needed and o.role not in given:
            raise inputs_node.error(f"missing the shape of operand '{o.role}' (add 'inputs.{o.role}')")
    if tensor_inputs and not any(by_role[i.role].kind == "input" for i in inputs):
        raise inputs_node.error("the harness needs at least one operand of kind 'input'")

    module = None
    if "module" in forms:
        if module_node is None:
            raise node.error("module targets need 'module' (constructor args/kwargs)")
        module = _parse_module_init(module_node, with_target=False)
    elif module_node is not None:
        raise module_node.error("'module' is only used by module targets (torch.nn.* classes)")
    predecessor = _parse_module_init(pred_node, with_target=True) if pred_node else None

    grid = parse_grid(grid_node) if grid_node else ()
    param_names = {p.name for p in params}
    for key, values in grid:
        item = grid_node.value[key]  # type: ignore[union-attr,index]
        operand = by_role.get(key)
        if key in param_names:
            continue
        if operand is not None and operand.variadic:
            for value_node, value in zip(item.value, values):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise value_node.error(f"variadic operand '{key}' takes in the grid how many tensors the call "
                                           f"passes (an int >= 1), got {describe(value_node)}")
            continue
        if operand is not None and operand.optional:
            for value_node, value in zip(item.value, values):
                scalar = isinstance(value, (int, float)) and not isinstance(value, bool)
                if not isinstance(value, bool) and not (scalar and operand.kind == "input" and operand.keyword):
                    raise value_node.error(f"optional operand '{key}' takes true/false in the grid, or a number "
                                           f"passed in its place (an input with a keyword), got {describe(value_node)}")
            continue
        if forms == {"module"}:
            continue  # a plain constructor keyword, e.g. torch.nn.Softmax(dim=...)
        raise item.error(f"grid key '{key}' is neither a parameter nor an optional operand; "
                         f"parameters: {', '.join(sorted(param_names)) or 'none'}; optional operands: "
                         f"{', '.join(o.role for o in operands if o.optional) or 'none'}")

    if module is not None:
        fixed = {key for key, _ in module.kwargs}
        for key, _ in grid:
            name = by_role[key].attribute if key in by_role else key
            if name in fixed:
                raise grid_node.value[key].error(  # type: ignore[union-attr,index]
                    f"grid key '{key}' sets the module keyword '{name}', which verify.module.kwargs "
                    "sets too; keep one")

    check_type(meshes_node, list)
    if not meshes_node.value:
        raise meshes_node.error("list at least one mesh shape, e.g. [[2, 2], [4]]")
    meshes: list[tuple[int, ...]] = []
    for item in meshes_node.value:  # type: ignore[union-attr]
        mesh = as_shape(item, allow_empty=False)
        within(item, [mesh_problem(mesh)])
        if mesh in meshes:
            raise item.error(f"mesh {list(mesh)} is listed twice")
        meshes.append(mesh)

    counts = _parse_counts(counts_node, dict(grid), tuple(meshes), tuple(targets)) if counts_node else ()
    same_length = _parse_same_length(same_length_node, params, grid, grid_node) if same_length_node else ()

    rtol = atol = None
    if tol_node is not None:
        ft = Fields(tol_node)
        rtol_node, atol_node = ft.optional("rtol", float), ft.optional("atol", float)
        ft.finish()
        rtol = as_tolerance(rtol_node) if rtol_node else None
        atol = as_tolerance(atol_node) if atol_node else None
    seed = 0
    if seed_node is not None:
        if seed_node.value < 0:  # type: ignore[operator]
            raise seed_node.error(f"expected a non-negative seed, got {seed_node.value!r}")
        seed = int(seed_node.value)  # type: ignore[arg-type]

    if any(t.form in ("function", "method") and not t.aten for t in targets):
        _check_positional(operands, params, inputs, inputs_node, "the function target(s)")
    for target in targets:
        if target.aten:
            _check_positional(list(target.operands), list(target.params), inputs, inputs_node, target.name)
    return VerifySpec(explore=bool(explore_node.value) if explore_node else True,
                      inputs=tuple(inputs), grid=grid, meshes=tuple(meshes), module=module,
                      predecessor=predecessor, counts=counts, rtol=rtol, atol=atol, seed=seed,
                      same_length=same_length)


def _parse_same_length(node: Node, params: list[ParamSpec], grid: tuple[tuple[str, tuple[Literal, ...]], ...],
                       grid_node: Node | None) -> tuple[tuple[str, ...], ...]:
    """``same_length: [shifts, dims]`` (one group) or ``[[a, b], [c, d]]`` (several): parameters
    whose values have equal lengths in every call (a list its length, any other value one).
    Each name is a declared parameter, in one group only, and every grid value of one is
    matched by a value of the same length of each other parameter of its group (the grid's
    values, else the default), so each stays in some grid point."""
    items = node.value  # type: ignore[union-attr]
    if not items:
        raise node.error("same_length lists the parameters whose values have equal lengths, e.g. "
                         "[shifts, dims]; got []")
    nested = [isinstance(item.value, list) for item in items]  # type: ignore[union-attr]
    if any(nested) and not all(nested):
        raise node.error("same_length is one group of parameter names ([shifts, dims]) or a list of groups "
                         "([[a, b], [c, d]]), not a mix of names and lists")
    group_nodes = list(items) if all(nested) else [node]  # type: ignore[arg-type]
    declared = {p.name: p for p in params}
    seen: dict[str, int] = {}
    groups = []
    for position, group_node in enumerate(group_nodes):
        names: list[str] = []
        for item in group_node.value:  # type: ignore[union-attr]
            name = as_identifier(check_type(item, str))
            if name not in declared:
                raise item.error(f"same_length names '{name}', which is not a parameter of the spec; "
                                 f"parameters: {', '.join(sorted(declared)) or 'none'}")
            if name in names:
                raise item.error(f"same_length names '{name}' twice in one group")
            if name in seen:
                raise item.error(f"'{name}' is in two same_length groups; make them one group")
            seen[name] = position
            names.append(name)
        if len(names) < 2:
            raise group_node.error(f"a same_length group names at least two parameters, got {names}")
        groups.append(tuple(names))
    values = {name: (declared[name].default,) for name in declared} | dict(grid)
    for group in groups:
        for name in group:
            if name not in dict(grid):
                continue
            for item, value in zip(grid_node.value[name].value, values[name]):  # type: ignore[union-attr,index]
                length = value_length(value)
                for other in group:
                    lengths = sorted({value_length(v) for v in values[other]})
                    if other != name and length not in lengths:
                        where = "its grid values" if other in dict(grid) else "its default"
                        raise item.error(
                            f"grid value {_shown(value)} of '{name}' has length {length}, but no value of '{other}' has "
                            f"(same_length: [{', '.join(group)}]; '{other}' takes length(s) "
                            f"{', '.join(map(str, lengths))}: {where}), so this value would be in no case")
    return tuple(groups)


def _shown(value: Literal) -> str:
    """A value as the spec writes it: lists in brackets."""
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def _check_where_lengths(node: Node, target: str, where: dict[str, Literal], verify: VerifySpec,
                         params: list[ParamSpec]) -> None:
    """A target's ``where:`` leaves it some grid point that keeps every same_length group."""
    values = {p.name: (p.default,) for p in params} | dict(verify.grid) | {k: (v,) for k, v in where.items()}
    for group in verify.same_length:
        common = set.intersection(*({value_length(v) for v in values[name]} for name in group))
        if not common:
            raise node.error(f"target {target!r} takes no grid point: its 'where' values break "
                             f"same_length: [{', '.join(group)}]")


def _data(node: Node, shape: tuple[int, ...], dtype: str) -> tuple[float, ...]:
    """``data: [...]``: an input's exact values, row-major, one per element of its shape."""
    try:
        return InputDecl("data", shape, dtype, data=tuple(item.value for item in node.value)).data  # type: ignore[union-attr,return-value]
    except InvalidArgument as error:
        raise node.error(str(error).removeprefix("input 'data': ")) from None


def _value_range(node: Node, dtype: str) -> tuple[float, float]:
    """``values: [low, high)``: finite numbers, low below high, integers for an integer dtype."""
    items = node.value  # type: ignore[union-attr]
    if len(items) != 2:  # type: ignore[arg-type]
        raise node.error(f"'values' is [low, high), two numbers; got {len(items)} item(s)")  # type: ignore[arg-type]
    low, high = (finite_number(item) for item in items)  # type: ignore[union-attr]
    if not low < high:
        raise node.error(f"'values' is [low, high) with low below high, got [{low}, {high}]")
    if not dtype_from_name(dtype).is_floating_point:
        if not all(isinstance(item.value, int) and not isinstance(item.value, bool) for item in items):  # type: ignore[union-attr]
            raise node.error(f"'values' of a {dtype} input are integers, got [{low}, {high}]")
        return int(low), int(high)  # type: ignore[return-value]
    return low, high


def _check_positional(operands: list[OperandSpec], params: list[ParamSpec], inputs: list[InputSpec],
                      inputs_node: Node, what: str) -> None:
    """Function targets (``what``) get their arguments positionally up to the last tensor
    (``target(x, *others)``, ``torch.einsum(eq, a, b)``, ``torch.cat([a, b], dim)``): every
    position before a tensor must be an operand or a parameter, and the elements of a list
    argument must be 0, 1, 2, ..."""
    by_role = {o.role: o for o in operands}
    tensors = [by_role[i.role] for i in inputs if by_role[i.role].kind != "output"]
    last = max(o.index for o in tensors if o.index is not None) if any(o.index is not None for o in tensors) else -1
    held = {o.index for o in operands if o.kind != "output" and o.index is not None}
    held |= {p.index for p in params if p.index is not None}
    for role in (i.role for i in inputs):
        operand = by_role[role]
        if operand.index is None:
            raise inputs_node.value[role].error(  # type: ignore[index]
                f"operand '{role}' is passed positionally to {what}, so it needs an 'index'")
    for position in range(last + 1):
        if position not in held:
            after = min((o for o in tensors if o.index > position), key=lambda o: o.index)  # type: ignore[operator]
            raise inputs_node.value[after.role].error(  # type: ignore[index]
                f"operand '{after.role}' is passed positionally to {what} at index "
                f"{after.index}, but nothing is declared at index {position}: declare the operand or "
                "parameter that sits there")
    lists: dict[int, list[int]] = {}
    for o in tensors:
        if o.element is not None:
            lists.setdefault(o.index, []).append(o.element)  # type: ignore[arg-type]
    for index, elements in lists.items():
        if sorted(elements) != list(range(len(elements))):
            raise inputs_node.error(f"the list argument at index {index} holds elements {sorted(elements)}; "
                                    f"they must be 0..{len(elements) - 1}")


# ------------------------------------------------------------------------------- cases


