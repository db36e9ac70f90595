"""The op spec model: one YAML file per op in specs/, parsed into frozen dataclasses.

`parse_op_spec` validates everything eagerly (one SpecError naming file, line and field), so
the renderer (`shardverify.codegen.op_kind`), the verifier, the explorer and the audit only
read validated values. See specs/README.md for the format.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

from shardverify.spec.fields import (
    Fields, as_dtype, as_identifier, as_shape, check_type, describe, finite_number, lookup, resolve_target)
from shardverify.spec.limits import MAX_CASES, MAX_MESH_RANKS, tensor_size_problems
from shardverify.spec.loader import Node

__all__ = ["OperandSpec", "ParamSpec", "TargetSpec", "InputSpec", "ModuleInit", "CountSpec",
           "VerifySpec", "OpSpec", "CaseSpec", "parse_op_spec", "parse_where", "case_spec"]

OPERAND_KINDS = ("input", "param", "output")

Literal = object  # a plain, repr()-safe value: None, bool, int, float, str, or tuples of them


@dataclass(frozen=True)
class OperandSpec:
    """How one operand is read from the call: positional index, keyword, module attribute."""

    role: str
    kind: str                      # "input" | "param" | "output"
    index: int | None = None
    keyword: str | None = None
    attribute: str | None = None
    optional: bool = False
    element: int | None = None     # element of the list argument at `index` (torch.cat)


@dataclass(frozen=True)
class ParamSpec:
    """A non-tensor call parameter (dim, keepdim): where it is read from and its default."""

    name: str
    index: int | None = None
    keyword: str | None = None
    default: Literal = None
    varargs: bool = False          # the positional arguments from index on, when passed unpacked


@dataclass(frozen=True)
class TargetSpec:
    """A torch target and how it appears in a traced graph."""

    name: str                      # "torch.sum", "torch.Tensor.sum", "torch.nn.Linear"
    form: str                      # "function" | "method" | "module"


@dataclass(frozen=True)
class InputSpec:
    """Shape and dtype of a harness placeholder for an operand role."""

    role: str
    shape: tuple[int, ...]
    dtype: str = "float32"


@dataclass(frozen=True)
class ModuleInit:
    """Constructor call of a module: torch.nn.Linear(16, 32, bias=False)."""

    target: str | None             # None for `verify.module` (each module target fills it in)
    args: tuple[Literal, ...] = ()
    kwargs: tuple[tuple[str, Literal], ...] = ()


@dataclass(frozen=True)
class CountSpec:
    """An expected number of strategies on one mesh for the grid points matching `where`."""

    mesh: tuple[int, ...]
    count: int
    where: tuple[tuple[str, Literal], ...] = ()
    target: str | None = None


@dataclass(frozen=True)
class VerifySpec:
    """The harness around the op and the grid of instances to verify."""

    inputs: tuple[InputSpec, ...]
    grid: tuple[tuple[str, tuple[Literal, ...]], ...]
    meshes: tuple[tuple[int, ...], ...]
    module: ModuleInit | None = None
    predecessor: ModuleInit | None = None
    counts: tuple[CountSpec, ...] = ()
    rtol: float | None = None
    atol: float | None = None
    seed: int = 0
    explore: bool = True           # generate hypothesis property tests beyond the grid


@dataclass(frozen=True)
class CaseSpec:
    """One op instance to verify: a target at one grid point (rendered as an OpCase literal)."""

    id: str
    target: str
    inputs: tuple[InputSpec, ...]
    params: tuple[tuple[str, Literal], ...]
    module: ModuleInit | None
    point: tuple[tuple[str, Literal], ...]
    positional: tuple[tuple[str, Literal], ...] = ()   # (kind, value) per argument: see CallArg


@dataclass(frozen=True)
class OpSpec:
    """A validated op spec."""

    name: str
    source: str
    targets: tuple[TargetSpec, ...]
    operands: tuple[OperandSpec, ...]
    params: tuple[ParamSpec, ...]
    generator: str
    options: tuple[tuple[str, Literal], ...]
    verify: VerifySpec
    description: str = ""
    audit_accept: tuple = ()       # shardverify.audit.accept.AcceptEntry: known, accepted gaps

    def grid_size(self) -> int:
        size = 1
        for _, values in self.verify.grid:
            size *= len(values)
        return size

    def cases(self) -> tuple[CaseSpec, ...]:
        """Every (target, grid point) instance, targets in spec order, grid row-major."""
        keys = [key for key, _ in self.verify.grid]
        points = list(itertools.product(*(values for _, values in self.verify.grid)))
        cases = []
        for target in self.targets:
            for values in points:
                cases.append(case_spec(self, target, tuple(zip(keys, values))))
        return tuple(cases)

    def op_cases(self) -> list[tuple[str, "OpCase"]]:
        """(case id, OpCase) for every case: the one mapping the generated tests, the CLI
        and the explorer all use."""
        from shardverify.verify.case import CallArg, InputDecl, ModuleDecl, OpCase

        def module(init: ModuleInit | None) -> ModuleDecl | None:
            return None if init is None else ModuleDecl(init.target, args=init.args, kwargs=init.kwargs)

        verify = self.verify
        return [(case.id, OpCase(op=self.name, target=case.target,
                                 inputs=tuple(InputDecl(i.role, i.shape, i.dtype) for i in case.inputs),
                                 params=case.params, module=module(case.module),
                                 predecessor=module(verify.predecessor), seed=verify.seed,
                                 rtol=verify.rtol, atol=verify.atol,
                                 positional=tuple(CallArg(kind, value) for kind, value in case.positional)))
                for case in self.cases()]


# --------------------------------------------------------------------------------- parsing

def _literal(node: Node) -> Literal:
    """A plain literal from YAML (lists become tuples; mappings are refused)."""
    value = node.value
    if isinstance(value, list):
        return tuple(_literal(item) for item in value)
    if isinstance(value, dict):
        raise node.error("expected a scalar or a list, got a mapping")
    if isinstance(value, float):
        return finite_number(node)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise node.error(f"expected a plain value (number, boolean, string, null or list), got {describe(node)}")


def _option(node: Node) -> Literal:
    """A generator option value: a literal, or a mapping (kept as (key, value) pairs in
    document order, so the HandlerDef stays hashable)."""
    if isinstance(node.value, dict):
        fields = Fields(node)
        pairs = []
        for key in fields.keys():
            pairs.append((as_identifier(_key_node(node, key)), _option(fields.required(key, object))))
        fields.finish()
        return tuple(pairs)
    return _literal(node)


def _key_node(mapping: Node, key: str) -> Node:
    """A Node for a mapping key itself, so bad names are reported on the key's line."""
    child = mapping.value[key]  # type: ignore[index]
    return Node(key, child.file, child.key_line or child.line, child.path)


def _index(node: Node | None) -> int | None:
    if node is None:
        return None
    check_type(node, int)
    if node.value < 0:  # type: ignore[operator]
        raise node.error(f"expected a non-negative positional index, got {node.value!r}")
    return node.value  # type: ignore[return-value]


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
    index = _index(f.optional("index", int))
    kw_node = f.optional("keyword", str)
    attr_node = f.optional("attribute", str)
    opt_node = f.optional("optional", bool)
    element = _index(f.optional("element", int))
    f.finish()
    operand = OperandSpec(role=role, kind=str(kind_node.value), index=index,
                          keyword=as_identifier(kw_node) if kw_node else None,
                          attribute=as_identifier(attr_node) if attr_node else None,
                          optional=bool(opt_node.value) if opt_node else False, element=element)
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
    index = _index(f.optional("index", int))
    kw_node = f.optional("keyword", str)
    default = f.optional("default", object)
    varargs = f.optional("varargs", bool)
    f.finish()
    if index is None and kw_node is None:
        raise node.error(f"parameter '{name}' needs an 'index' or a 'keyword'")
    if varargs is not None and varargs.value and index is None:
        raise varargs.error(f"parameter '{name}': 'varargs' reads the positional arguments from 'index' on; "
                            "give it an index")
    return ParamSpec(name=name, index=index, keyword=as_identifier(kw_node) if kw_node else None,
                     default=_literal(default) if default is not None else None,
                     varargs=bool(varargs.value) if varargs is not None else False)


def _names(node: Node) -> list[tuple[str, Node]]:
    """(validated identifier, value node) for each key of a mapping of user-chosen names."""
    f = Fields(node)
    return [(as_identifier(_key_node(node, key)), f.required(key, object)) for key in f.keys()]


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
    args = tuple(_literal(item) for item in args_node.value) if args_node else ()  # type: ignore[union-attr]
    kwargs = tuple((key, _literal(value)) for key, value in _names(kwargs_node)) if kwargs_node else ()
    return ModuleInit(target=target, args=args, kwargs=kwargs)


def _parse_grid(node: Node) -> tuple[tuple[str, tuple[Literal, ...]], ...]:
    grid = []
    for key, values in _names(node):
        check_type(values, list)
        _within(values, [MAX_CASES.exceeded(len(values.value))])   # before the pairwise duplicate check
        if not values.value:
            raise values.error(f"grid values for '{key}' are empty; list at least one value")
        literals = tuple(_literal(item) for item in values.value)  # type: ignore[union-attr]
        for position, (item, literal) in enumerate(zip(values.value, literals)):  # type: ignore[arg-type]
            if any(literal == prev and type(literal) is type(prev) for prev in literals[:position]):
                raise item.error(f"grid value {literal!r} for '{key}' is listed twice")
        grid.append((key, literals))
    return tuple(grid)


def parse_where(node: Node | None, grid: dict[str, tuple[Literal, ...]]) -> tuple[tuple[str, Literal], ...]:
    """A ``where:`` mapping selecting grid points: each key a grid key, each value one of its values
    (shared by ``verify.strategies`` and ``audit.accept``)."""
    where = []
    for key, value_node in (_names(node) if node else []):
        if key not in grid:
            raise value_node.error(f"'{key}' is not a grid key; grid keys: {', '.join(grid) or 'none'}")
        value = _literal(value_node)
        if not any(value == v and type(value) is type(v) for v in grid[key]):
            raise value_node.error(f"{value!r} is not one of the grid values {list(grid[key])} of '{key}'")
        where.append((key, value))
    return tuple(where)


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
    operand roles, so a typo is caught here rather than by the generator at test time."""
    for key, child in node.value.items():  # type: ignore[union-attr]
        if isinstance(child.value, dict):
            _check_option_refs(child, params, roles)
            continue
        for suffix, declared, what in (("_param", params, "parameter"), ("_operand", roles, "operand")):
            if not (key.endswith(suffix) or key.endswith(suffix + "s")):
                continue
            items = child.value if isinstance(child.value, list) else [child]
            for item in items:
                if item.value not in declared:
                    raise item.error(f"option '{key}' names {what} {item.value!r}, which the spec does "
                                     f"not declare; declared: {', '.join(sorted(declared)) or 'none'}")


def _check_rule(node: Node, options: tuple[tuple[str, Literal], ...], roles: set[str]) -> None:
    """A `rules` generator's options form a valid rule (see shardverify/rules/spec.py)."""
    from shardverify.errors import InvalidArgument
    from shardverify.rules.spec import RuleOptions

    try:
        rule = RuleOptions.from_options(dict(options))
    except InvalidArgument as exc:
        raise node.error(f"invalid sharding rule: {exc}") from None
    missing = sorted(set(rule.additive) - roles)
    if missing:
        raise node.error(f"additive_operands names {missing}, which are not operands; declared: {sorted(roles)}")
    missing = sorted({role for role, _ in rule.indices} - roles)
    if missing:
        raise node.error(f"indices names {missing}, which are not operands; declared: {sorted(roles)}")


def _check_generator(node: Node) -> str:
    family = as_identifier(node)
    from shardverify.generators.registry import get_generator

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
    f.finish()

    if not targets_node.value:
        raise targets_node.error("list at least one target")
    targets = []
    for item in targets_node.value:  # type: ignore[union-attr]
        target = resolve_target(item)
        if any(t.name == target for t in targets):
            raise item.error(f"target {target!r} is listed twice")
        targets.append(TargetSpec(target, _target_form(item, target)))
    forms = {t.form for t in targets}

    operands = [_parse_operand(role, value) for role, value in _names(operands_node)]
    outputs = [o for o in operands if o.kind == "output"]
    if not outputs:
        raise operands_node.error("declare an operand of kind 'output'")
    if len(outputs) > 1 and any(o.index is None for o in outputs):
        raise operands_node.error("several outputs each need an 'index' (their position in the tuple result)")
    params = [_parse_param(pname, value) for pname, value in _names(params_node)] if params_node else []
    roles = {o.role for o in operands}
    for p in params:
        if p.name in roles:
            raise params_node.value[p.name].error(  # type: ignore[union-attr,index]
                f"'{p.name}' is declared both as an operand and as a parameter")
    _check_slots(operands, params, operands_node, params_node)
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
    options = tuple((key, _option(value)) for key, value in _names(options_node)) if options_node else ()
    if options_node is not None:
        _check_option_refs(options_node, {p.name for p in params}, roles)
    if family == "rules":
        _check_rule(options_node or generator_node, options, roles)

    verify = _parse_verify(verify_node, targets, operands, params)
    from shardverify.audit.accept import parse_audit
    accept = parse_audit(audit_node, roles, dict(verify.grid))
    points = math.prod(len(values) for _, values in verify.grid)
    _within(verify_node, [MAX_CASES.exceeded(len(targets) * points)])
    return OpSpec(name=name, source=root.file, targets=tuple(targets), operands=tuple(operands),
                  params=tuple(params), generator=family, options=options, verify=verify,
                  description=str(desc_node.value) if desc_node else "", audit_accept=accept)


def _within(node: Node, problems: list[str]) -> None:
    """A SpecError at ``node`` for the first limit exceeded (see spec/limits.py)."""
    for problem in problems:
        if problem:
            raise node.error(problem)


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
                  params: list[ParamSpec]) -> VerifySpec:
    f = Fields(node)
    inputs_node = f.required("inputs", dict)
    module_node = f.optional("module", dict)
    pred_node = f.optional("predecessor", dict)
    grid_node = f.optional("grid", dict)
    meshes_node = f.required("meshes", list)
    counts_node = f.optional("strategies", list)
    tol_node = f.optional("tolerance", dict)
    seed_node = f.optional("seed", int)
    explore_node = f.optional("explore", bool)
    f.finish()
    forms = {t.form for t in targets}
    by_role = {o.role: o for o in operands}

    inputs = []
    for role, value in _names(inputs_node):
        operand = by_role.get(role)
        if operand is None or operand.kind == "output":
            raise value.error(f"'{role}' is not an input or param operand; declared: "
                              f"{', '.join(o.role for o in operands if o.kind != 'output')}")
        fi = Fields(value)
        shape = as_shape(fi.required("shape", list))
        dtype_node = fi.optional("dtype", str)
        fi.finish()
        _within(value, tensor_size_problems([(f"input '{role}'", shape)]))
        inputs.append(InputSpec(role, shape, as_dtype(dtype_node) if dtype_node else "float32"))
    given = {i.role for i in inputs}
    for o in operands:
        needed = o.kind == "input" or (o.kind == "param" and forms & {"function", "method"})
        if needed and o.role not in given:
            raise inputs_node.error(f"missing the shape of operand '{o.role}' (add 'inputs.{o.role}')")
    if not any(by_role[i.role].kind == "input" for i in inputs):
        raise inputs_node.error("the harness needs at least one operand of kind 'input'")

    module = None
    if "module" in forms:
        if module_node is None:
            raise node.error("module targets need 'module' (constructor args/kwargs)")
        module = _parse_module_init(module_node, with_target=False)
    elif module_node is not None:
        raise module_node.error("'module' is only used by module targets (torch.nn.* classes)")
    predecessor = _parse_module_init(pred_node, with_target=True) if pred_node else None

    grid = _parse_grid(grid_node) if grid_node else ()
    param_names = {p.name for p in params}
    for key, values in grid:
        item = grid_node.value[key]  # type: ignore[union-attr,index]
        operand = by_role.get(key)
        if key in param_names:
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
        _within(item, [MAX_MESH_RANKS.exceeded(math.prod(mesh))])
        if mesh in meshes:
            raise item.error(f"mesh {list(mesh)} is listed twice")
        meshes.append(mesh)

    counts = _parse_counts(counts_node, dict(grid), tuple(meshes), tuple(targets)) if counts_node else ()

    rtol = atol = None
    if tol_node is not None:
        ft = Fields(tol_node)
        rtol_node, atol_node = ft.optional("rtol", float), ft.optional("atol", float)
        ft.finish()
        for tol in (rtol_node, atol_node):
            if tol is not None and finite_number(tol) < 0:
                raise tol.error(f"expected a non-negative tolerance, got {tol.value!r}")
        rtol = float(rtol_node.value) if rtol_node else None  # type: ignore[arg-type]
        atol = float(atol_node.value) if atol_node else None  # type: ignore[arg-type]
    seed = 0
    if seed_node is not None:
        if seed_node.value < 0:  # type: ignore[operator]
            raise seed_node.error(f"expected a non-negative seed, got {seed_node.value!r}")
        seed = int(seed_node.value)  # type: ignore[arg-type]

    _check_positional(targets, operands, params, inputs, inputs_node)
    return VerifySpec(explore=bool(explore_node.value) if explore_node else True,
                      inputs=tuple(inputs), grid=grid, meshes=tuple(meshes), module=module,
                      predecessor=predecessor, counts=counts, rtol=rtol, atol=atol, seed=seed)


def _check_positional(targets: list[TargetSpec], operands: list[OperandSpec], params: list[ParamSpec],
                      inputs: list[InputSpec], inputs_node: Node) -> None:
    """Function targets get their arguments positionally up to the last tensor
    (``target(x, *others)``, ``torch.einsum(eq, a, b)``, ``torch.cat([a, b], dim)``): every
    position before a tensor must be an operand or a parameter, and the elements of a list
    argument must be 0, 1, 2, ..."""
    if not any(t.form in ("function", "method") for t in targets):
        return
    by_role = {o.role: o for o in operands}
    tensors = [by_role[i.role] for i in inputs if by_role[i.role].kind != "output"]
    last = max(o.index for o in tensors if o.index is not None) if any(o.index is not None for o in tensors) else -1
    held = {o.index for o in operands if o.kind != "output" and o.index is not None}
    held |= {p.index for p in params if p.index is not None}
    for role in (i.role for i in inputs):
        operand = by_role[role]
        if operand.index is None:
            raise inputs_node.value[role].error(  # type: ignore[index]
                f"operand '{role}' is passed positionally to the function target(s), so it needs an 'index'")
    for position in range(last + 1):
        if position not in held:
            after = min((o for o in tensors if o.index > position), key=lambda o: o.index)  # type: ignore[operator]
            raise inputs_node.value[after.role].error(  # type: ignore[index]
                f"operand '{after.role}' is passed positionally to the function target(s) at index "
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

def case_spec(spec: OpSpec, target: TargetSpec, point: tuple[tuple[str, Literal], ...]) -> CaseSpec:
    by_role = {o.role: o for o in spec.operands}
    param_names = {p.name for p in spec.params}
    verify = spec.verify
    dropped = {key for key, value in point if key in by_role and value is not True}
    scalars = tuple((by_role[key].keyword, value) for key, value in point      # torch.add(x, other=2.5)
                    if key in by_role and not isinstance(value, bool))
    positional: tuple[tuple[str, Literal], ...] = ()
    if target.form == "module":
        inputs = tuple(i for i in verify.inputs if by_role[i.role].kind == "input")
        assert verify.module is not None
        extra = tuple((by_role[key].attribute if key in by_role else key, value)  # type: ignore[misc]
                      for key, value in point)
        module = ModuleInit(target.name, verify.module.args, verify.module.kwargs + extra)
        params: tuple[tuple[str, Literal], ...] = ()
    else:
        inputs = tuple(sorted((i for i in verify.inputs if i.role not in dropped),
                              key=lambda i: (by_role[i.role].index, by_role[i.role].element or 0)))  # type: ignore[arg-type,return-value]
        module = None
        params = tuple((key, value) for key, value in point if key in param_names) + scalars  # type: ignore[operator]
        positional, taken = _positional(spec, inputs, dict(point))
        params = tuple((key, value) for key, value in params if key not in taken)
    case_id = target.name + "".join(f"-{key}_{_id_token(value)}" for key, value in point)
    return CaseSpec(id=case_id, target=target.name, inputs=inputs, params=params, module=module, point=point,
                    positional=positional)


def _positional(spec: OpSpec, inputs: tuple[InputSpec, ...], point: dict[str, Literal]
                ) -> tuple[tuple[tuple[str, Literal], ...], set[str]]:
    """The positional arguments of a function/method call up to its last tensor, and the
    parameter/keyword names they take from the keyword arguments; ``()`` when they are
    just the tensors in order (the plain ``target(x, *others)``)."""
    by_role = {o.role: o for o in spec.operands}
    present = [by_role[i.role] for i in inputs]
    last = max(o.index for o in present)  # type: ignore[type-var]
    slots: dict[int, tuple[str, Literal]] = {}
    taken: set[str] = set()
    for o in present:
        if o.element is None:
            slots[o.index] = ("tensor", o.role)  # type: ignore[index]
        else:
            names = slots.get(o.index, ("list", ()))[1]  # type: ignore[arg-type]
            slots[o.index] = ("list", names + (o.role,))  # type: ignore[index,operator]
    for o in spec.operands:      # a dropped optional tensor before the last one: None, or its number
        if o.kind != "output" and o.role in point and point[o.role] is not True and \
                o.index is not None and o.index < last and o.index not in slots:
            value = point[o.role]
            slots[o.index] = ("value", None if isinstance(value, bool) else value)
            taken.add(o.keyword or o.role)
    for p in spec.params:
        if p.index is not None and p.index < last:
            slots[p.index] = ("value", point.get(p.name, p.default))
            taken.add(p.name)
    if all(slots.get(i) == ("tensor", o.role) for i, o in enumerate(present)) and len(slots) == len(present):
        return (), set()
    return tuple(slots[i] for i in range(last + 1)), taken


def _id_token(value: Literal) -> str:
    """A test-id piece that `pytest -k` can match: (0, 2) -> "0.2", -1 -> "-1"."""
    if isinstance(value, tuple):
        return ".".join(_id_token(item) for item in value) or "empty"
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", str(value))
