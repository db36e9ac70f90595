"""The op spec model: frozen dataclasses a validated op spec is made of (parsed by
:func:`shardverify.spec.op.parse_op_spec`), and its expansion into cases: one per target and
grid point, each turning into the :class:`~shardverify.spec.case.OpCase` the verifier runs."""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass, field

from shardverify.spec.case import CallArg, InputDecl, ModuleDecl, OpCase
from shardverify.spec.values import Literal
from shardverify.strategies.declarations import OperandDecl, ParamDecl
from shardverify.strategies.options import PARAM, ParsedOptions

__all__ = ["OperandDecl", "ParamDecl", "TargetSpec", "InputSpec", "ModuleInit", "CountSpec",
           "VerifySpec", "OpSpec", "CaseSpec", "case_spec", "value_length"]


def value_length(value: Literal) -> int:
    """The length ``verify.same_length`` compares: a list's (a tuple's) length; any other value (a
    number, null) counts as one, as torch takes ``roll(x, 1, 0)`` for ``roll(x, (1,), (0,))``."""
    return len(value) if isinstance(value, tuple) else 1


@dataclass(frozen=True)
class TargetSpec:
    """A torch target and how it appears in a traced graph; an ATen overload carries the spec's
    operands and parameters at its own schema's positions (``spec.aten``)."""

    name: str                      # "torch.sum", "torch.Tensor.sum", "torch.nn.Linear", "torch.ops.aten.sum.dim_IntList"
    form: str                      # "function" | "method" | "module"
    operands: tuple[OperandDecl, ...] = ()   # empty: the spec's own
    params: tuple[ParamDecl, ...] = ()
    aten: bool = False
    where: tuple[tuple[str, Literal], ...] = ()   # the grid points this target takes (empty: all)

    def takes(self, point: tuple[tuple[str, Literal], ...]) -> bool:
        """Is grid ``point`` one of this target's?"""
        values = dict(point)
        return all(key in values and values[key] == value and type(values[key]) is type(value)
                   for key, value in self.where)


@dataclass(frozen=True)
class InputSpec:
    """Shape and dtype of a harness placeholder for an operand role."""

    role: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    values: tuple[float, float] | None = None   # [low, high) the values are drawn from
    grad: bool = True                            # False: the op takes no gradient for it
    data: tuple[float, ...] | None = None        # the exact values (row-major) instead of a draw


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
    # groups of parameters whose values have equal lengths in every call (roll's shifts and
    # dims): grid points that break one are no cases, and the property tests draw them so
    same_length: tuple[tuple[str, ...], ...] = ()
    # grid points that are no call, each as (key, value) pairs (aten.index with no index tensor:
    # its two optional index operands both left out)
    exclude: tuple[tuple[tuple[str, Literal], ...], ...] = ()
    # check in a child process (verify/isolated.py): the op's CPU kernel can corrupt memory or trap
    # on the local shapes of a wrong layout, which would end the checking process with it
    isolate: bool = False


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
    operands: tuple[OperandDecl, ...]
    params: tuple[ParamDecl, ...]
    generator: str
    options: tuple[tuple[str, Literal], ...]
    verify: VerifySpec
    description: str = ""
    audit_accept: tuple = ()       # shardverify.spec.accept.AcceptEntry: known, accepted gaps
    audit_meshes: tuple[tuple[int, ...], ...] | None = None   # None: the 1-D and 2-D meshes
    audit_skip: str = ""           # why the audit cannot run the op at all (never run, always said)
    ignores: tuple[str, ...] = ()  # undeclared keyword arguments that leave the rule unchanged
    #: the family's options, parsed once at load (the rules family's RuleSpec): what the rule
    #: reads and names; the generated handler holds it as parsed
    rule: ParsedOptions | None = field(default=None, compare=False, repr=False)

    def read_params(self) -> frozenset[str]:
        """The parameters the rule reads (derives the layouts from their values)."""
        return frozenset(r.name for r in self.rule.refs if r.kind == PARAM) if self.rule is not None else frozenset()

    def bound_targets(self) -> tuple[TargetSpec, ...]:
        """The targets with a bound parameter (see :meth:`bindings`)."""
        return tuple(t for t in self.targets if self.bindings(t))

    def bindings(self, target: TargetSpec) -> tuple[tuple[str, tuple[Literal, ...]], ...]:
        """(parameter, values verified) for each parameter whose values ``target`` serves only as
        verified: the grid's values at the target's grid points, or the default when the grid
        does not vary it. A parameter the rule reads (:meth:`read_params`: the engine derives
        the layouts from its value, and the grid verifies the derivation) serves
        every value. One declared ``serves: any`` is bound all the same: the declaration is a
        claim, so a call at a value the grid never held is verified where it is met."""
        grid = dict(self.verify.grid)
        where = dict(target.where)
        bound = []
        read = self.read_params()
        for param in self.params:
            if param.name in read:
                continue
            values = (where[param.name],) if param.name in where else grid.get(param.name, (param.default,))
            bound.append((param.name, tuple(values)))
        for operand in self.operands:      # how many tensors a variadic operand was verified with
            if operand.variadic:
                counts = (where[operand.role],) if operand.role in where else \
                    grid.get(operand.role, (VARIADIC_COUNT,))
                bound.append((operand.role, tuple(counts)))
        return tuple(bound)

    def serves_every_value(self, name: str) -> bool:
        """Does the rule hold for every value of parameter ``name`` (``serves: any``, or read by
        the rule: the engine derives the layouts from its value)? Else it serves only the values
        it was verified on (:meth:`bindings`)."""
        return any(p.name == name and p.any_value for p in self.params) or name in self.read_params()

    def keeps(self, point: tuple[tuple[str, Literal], ...]) -> bool:
        """Does a call with these parameter values (the defaults for the others) keep every
        ``verify.same_length`` group, and is it no point ``verify.exclude`` names?"""
        values = {p.name: p.default for p in self.params} | dict(point)
        given = dict(point)
        return all(len({value_length(values[name]) for name in group}) == 1 for group in self.verify.same_length) \
            and not any(all(key in given and given[key] == value and type(given[key]) is type(value)
                            for key, value in excluded) for excluded in self.verify.exclude)

    def operands_for(self, target: TargetSpec) -> tuple[OperandDecl, ...]:
        """The operands as ``target``'s calls take them."""
        return target.operands if target.aten else self.operands

    def params_for(self, target: TargetSpec) -> tuple[ParamDecl, ...]:
        return target.params if target.aten else self.params

    def grid_size(self) -> int:
        """The grid's points: its product, less the points that break a ``same_length`` group or
        that ``exclude`` names."""
        if self.verify.same_length or self.verify.exclude:
            keys = [key for key, _ in self.verify.grid]
            return sum(self.keeps(tuple(zip(keys, values)))
                       for values in itertools.product(*(values for _, values in self.verify.grid)))
        size = 1
        for _, values in self.verify.grid:
            size *= len(values)
        return size

    def cases(self) -> tuple[CaseSpec, ...]:
        """Every (target, grid point) instance, targets in spec order, grid row-major; a point
        that breaks a ``same_length`` group, or that ``exclude`` names, is no call, so no case."""
        keys = [key for key, _ in self.verify.grid]
        points = list(itertools.product(*(values for _, values in self.verify.grid)))
        cases = []
        for target in self.targets:
            for values in points:
                point = tuple(zip(keys, values))
                if target.takes(point) and self.keeps(point):
                    cases.append(case_spec(self, target, point))
        return tuple(cases)

    def op_cases(self) -> list[tuple[str, "OpCase"]]:
        """(case id, OpCase) for every case: the one mapping the generated tests, the CLI
        and the explorer all use."""
        def module(init: ModuleInit | None) -> ModuleDecl | None:
            return None if init is None else ModuleDecl(init.target, args=init.args, kwargs=init.kwargs)

        verify = self.verify
        return [(case.id, OpCase(op=self.name, target=case.target,
                                 inputs=tuple(InputDecl(i.role, i.shape, i.dtype, i.values, i.grad, i.data) for i in case.inputs),
                                 params=case.params, module=module(case.module),
                                 predecessor=module(verify.predecessor), seed=verify.seed,
                                 rtol=verify.rtol, atol=verify.atol,
                                 positional=tuple(CallArg(kind, value) for kind, value in case.positional),
                                 isolate=verify.isolate))
                for case in self.cases()]


def case_spec(spec: OpSpec, target: TargetSpec, point: tuple[tuple[str, Literal], ...]) -> CaseSpec:
    operands, declared = spec.operands_for(target), spec.params_for(target)
    verify = spec.verify
    counts = {o.role: int(dict(point).get(o.role, VARIADIC_COUNT)) for o in operands if o.variadic}  # type: ignore[arg-type]
    full_point, point = point, tuple((key, value) for key, value in point if key not in counts)
    operands, verify = _elements_expanded(operands, verify, counts)
    by_role = {o.role: o for o in operands}
    keywords = {p.name: p.keyword or p.name for p in declared}
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
        inputs = tuple(sorted((i for i in verify.inputs if i.role not in dropped),   # keyword-only tensors last
                              key=lambda i: (by_role[i.role].index is None, by_role[i.role].index or 0,
                                             by_role[i.role].element or 0)))
        module = None
        params = tuple((keywords[key], value) for key, value in point if key in keywords) + scalars  # type: ignore[operator]
        positional, taken = _positional(operands, declared, inputs, dict(point))
        params = tuple((key, value) for key, value in params if key not in taken)
    case_id = target.name + "".join(f"-{key}_{_id_token(value)}" for key, value in full_point)
    return CaseSpec(id=case_id, target=target.name, inputs=inputs, params=params, module=module, point=full_point,
                    positional=positional)


#: how many tensors a variadic operand's case passes where the grid does not say
VARIADIC_COUNT = 2


def _elements_expanded(operands: tuple[OperandDecl, ...], verify: VerifySpec, counts: dict[str, int]
                       ) -> tuple[tuple[OperandDecl, ...], VerifySpec]:
    """A variadic operand as ``counts[role]`` elements of its list argument, ``<role>_<k>``, each
    an input of the shape the spec declares for the role."""
    if not counts:
        return operands, verify
    expanded = tuple(one for o in operands for one in (
        [dataclasses.replace(o, role=f"{o.role}_{k}", element=k, variadic=False) for k in range(counts[o.role])]
        if o.role in counts else [o]))
    inputs = tuple(one for i in verify.inputs for one in (
        [dataclasses.replace(i, role=f"{i.role}_{k}") for k in range(counts[i.role])] if i.role in counts else [i]))
    return expanded, dataclasses.replace(verify, inputs=inputs)


def _positional(operands: tuple[OperandDecl, ...], params: tuple[ParamDecl, ...], inputs: tuple[InputSpec, ...],
                point: dict[str, Literal]) -> tuple[tuple[tuple[str, Literal], ...], set[str]]:
    """The positional arguments of a function/method call up to its last tensor, and the
    keywords they take from the keyword arguments; ``()`` when they are just the tensors in
    order (the plain ``target(x, *others)``)."""
    by_role = {o.role: o for o in operands}
    present = [by_role[i.role] for i in inputs if by_role[i.role].index is not None]
    keywords = tuple(("keyword", (o.keyword, o.role)) for o in (by_role[i.role] for i in inputs) if o.index is None)
    if not present:             # a factory (torch.full): every parameter by keyword
        return keywords, set()
    last = max(o.index for o in present)  # type: ignore[type-var]
    slots: dict[int, tuple[str, Literal]] = {}
    taken: set[str] = set()
    for o in present:
        if o.element is None:
            slots[o.index] = ("tensor", o.role)  # type: ignore[index]
        else:
            names = slots.get(o.index, ("list", ()))[1]  # type: ignore[arg-type]
            slots[o.index] = ("list", names + (o.role,))  # type: ignore[index,operator]
    for o in operands:      # a dropped optional tensor before the last one: None, or its number
        if o.kind != "output" and o.role in point and point[o.role] is not True and \
                o.index is not None and o.index < last and o.index not in slots:
            value = point[o.role]
            slots[o.index] = ("value", None if isinstance(value, bool) else value)
            taken.add(o.keyword or o.role)
    for p in params:
        if p.index is not None and p.index < last:
            slots[p.index] = ("value", point.get(p.name, p.default))
            taken.add(p.keyword or p.name)
    if all(slots.get(i) == ("tensor", o.role) for i, o in enumerate(present)) and len(slots) == len(present) \
            and not keywords:
        return (), set()
    return tuple(slots[i] for i in range(last + 1)) + keywords, taken  # type: ignore[return-value]


def _id_token(value: Literal) -> str:
    """A test-id piece that `pytest -k` can match: (0, 2) -> "0.2", -1 -> "-1"."""
    if isinstance(value, tuple):
        return ".".join(_id_token(item) for item in value) or "empty"
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", str(value))
