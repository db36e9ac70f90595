"""Parsing an op spec's ``verify:`` section: the input shapes and value ranges, the module and
predecessor constructors, the grid, the meshes, the expected strategy counts, ``same_length``
groups, tolerances, seed and ``isolate`` (checks run in a child process: an op whose CPU kernel can
corrupt memory or trap on a wrong layout's local shapes), each checked against the spec's
operands, parameters and targets (one SpecError naming file, line and field)."""

from __future__ import annotations

import math

from shardverify.errors import InvalidArgument
from shardverify.spec.case import InputDecl
from shardverify.spec.fields import (Fields, as_dtype, as_identifier, as_shape, as_tolerance, check_type, describe,
                                     dtype_from_name, finite_number, resolve_target, target_form)
from shardverify.spec.limits import mesh_problem, tensor_size_problems
from shardverify.spec.loader import Node
from shardverify.spec.op_model import (CountSpec, InputSpec, ModuleInit, OperandDecl, ParamDecl, TargetSpec,
                                       VerifySpec, value_length)
from shardverify.spec.values import Literal, literal, names_of, parse_grid, parse_where, within

__all__ = ["parse_verify", "check_where_lengths"]


def parse_verify(node: Node, targets: list[TargetSpec], operands: list[OperandDecl],
                  params: list[ParamDecl], constant: tuple[str, ...] = ()) -> VerifySpec:
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
    isolate_node = f.optional("isolate", bool)
    same_length_node = f.optional("same_length", list)
    exclude_node = f.optional("exclude", list)
    f.finish()
    forms = {t.form for t in targets}

    inputs, inputs_node = _parse_inputs(node, inputs_node, operands, forms, constant)

    module = None
    if "module" in forms:
        if module_node is None:
            raise node.error("a module target (a torch.nn.* class) needs 'module' under 'verify': its constructor's "
                             "args and kwargs, e.g. 'module: {}' for none or 'module: {args: [16, 32]}'")
        module = _parse_module_init(module_node, with_target=False)
    elif module_node is not None:
        raise module_node.error("'module' is only used by module targets (torch.nn.* classes)")
    predecessor = _parse_module_init(pred_node, with_target=True) if pred_node else None

    grid = parse_grid(grid_node) if grid_node else ()
    _check_grid(grid, grid_node, operands, params, forms, module)

    meshes = _parse_meshes(meshes_node)

    counts = _parse_counts(counts_node, dict(grid), tuple(meshes), tuple(targets)) if counts_node else ()
    same_length = _parse_same_length(same_length_node, params, grid, grid_node) if same_length_node else ()
    exclude = _parse_exclude(exclude_node, grid) if exclude_node else ()

    rtol, atol = _parse_tolerance(tol_node)
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
                      same_length=same_length, exclude=exclude,
                      isolate=bool(isolate_node.value) if isolate_node else False)


def _parse_inputs(node: Node, inputs_node: Node | None, operands: list[OperandDecl], forms: set[str],
                  constant: tuple[str, ...]) -> tuple[list[InputSpec], Node]:
    """Each tensor operand's declared shape, dtype and values (a factory without tensor operands
    may give none: the section itself then stands for ``inputs`` in errors)."""
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
    return inputs, inputs_node


def _check_grid(grid: tuple[tuple[str, tuple[Literal, ...]], ...], grid_node: Node | None,
                operands: list[OperandDecl], params: list[ParamDecl], forms: set[str],
                module: ModuleInit | None) -> None:
    """Every grid key names a parameter, an optional or variadic operand (with values it takes) or,
    for a module target, a constructor keyword the module's own kwargs do not set too."""
    by_role = {o.role: o for o in operands}
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


def _parse_meshes(meshes_node: Node) -> list[tuple[int, ...]]:
    """The mesh shapes to verify on: at least one, each of two or more ranks, none twice."""
    check_type(meshes_node, list)
    if not meshes_node.value:
        raise meshes_node.error("list at least one mesh shape, e.g. [[2, 2], [4]]")
    meshes: list[tuple[int, ...]] = []
    for item in meshes_node.value:  # type: ignore[union-attr]
        mesh = as_shape(item, allow_empty=False)
        within(item, [mesh_problem(mesh)])
        if math.prod(mesh) == 1:
            raise item.error(f"mesh {list(mesh)} has one rank: nothing is sharded on it, so nothing would be checked")
        if mesh in meshes:
            raise item.error(f"mesh {list(mesh)} is listed twice")
        meshes.append(mesh)
    return meshes


def _parse_tolerance(tol_node: Node | None) -> tuple[float | None, float | None]:
    """``tolerance: {rtol, atol}``, each None where not given (the dtype's default)."""
    rtol = atol = None
    if tol_node is not None:
        ft = Fields(tol_node)
        rtol_node, atol_node = ft.optional("rtol", float), ft.optional("atol", float)
        ft.finish()
        rtol = as_tolerance(rtol_node) if rtol_node else None
        atol = as_tolerance(atol_node) if atol_node else None
    return rtol, atol


def _parse_exclude(node: Node, grid: tuple[tuple[str, tuple[Literal, ...]], ...]
                   ) -> tuple[tuple[tuple[str, Literal], ...], ...]:
    """``exclude: [{i0: false, i1: false}]``: grid points that are no call, each a ``where:``
    mapping (grid keys to one of their grid values); a point matching every pair is no case."""
    found = []
    for item in node.value:  # type: ignore[union-attr]
        if not isinstance(item.value, dict) or not item.value:
            raise item.error("each 'exclude' item maps grid keys to one of their grid values, e.g. "
                             "{i0: false, i1: false}")
        found.append(parse_where(item, dict(grid)))
    return tuple(found)


def _parse_same_length(node: Node, params: list[ParamDecl], grid: tuple[tuple[str, tuple[Literal, ...]], ...],
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


def check_where_lengths(node: Node, target: str, where: dict[str, Literal], verify: VerifySpec,
                         params: list[ParamDecl]) -> None:
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


def _check_positional(operands: list[OperandDecl], params: list[ParamDecl], inputs: list[InputSpec],
                      inputs_node: Node, what: str) -> None:
    """Function targets (``what``) get their arguments positionally up to the last tensor
    (``target(x, *others)``, ``torch.einsum(eq, a, b)``, ``torch.cat([a, b], dim)``): every
    position before a tensor must be an operand or a parameter, and the elements of a list
    argument must be 0, 1, 2, ..."""
    by_role = {o.role: o for o in operands}
    tensors = [by_role[i.role] for i in inputs if by_role[i.role].kind != "output" and by_role[i.role].index is not None]
    last = max(o.index for o in tensors if o.index is not None) if any(o.index is not None for o in tensors) else -1
    held = {o.index for o in operands if o.kind != "output" and o.index is not None}
    held |= {p.index for p in params if p.index is not None}
    for role in (i.role for i in inputs):
        operand = by_role[role]
        if operand.index is None and (operand.keyword is None or operand.kind != "input"):
            raise inputs_node.value[role].error(  # type: ignore[index]
                f"operand '{role}' is passed positionally to {what}, so it needs an 'index' (or, "
                "keyword-only, a 'keyword')")
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


def _parse_module_init(node: Node, *, with_target: bool) -> ModuleInit:
    f = Fields(node)
    target = None
    if with_target:
        target_node = f.required("target", str)
        target = resolve_target(target_node)
        if target_form(target_node, target) != "module":
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
