"""Property-based exploration of an op spec with hypothesis: shapes, parameters and meshes
beyond the grid its author listed.

Everything is derived from the spec itself, with no per-op code:

* sizes: every int in ``verify.inputs`` shapes and in the ``module``/``predecessor``
  constructor args is a slot. A value that appears in two or more places (the K of a Linear
  in the input's last dim, the weight and ``Linear(K, N)``) is one tied size, so the harness
  stays consistent; any other occurrence varies on its own. Sizes come from ``SIZES`` so
  some layouts divide and others are uneven. Ranks never change.
* parameters: every grid key is drawn (and each boolean parameter the grid leaves out that
  serves any value). A parameter bound to the values it was
  verified on (its handler refuses any other call) takes only those. One that serves any
  value (``serves: any``, or read by the rule) is drawn beyond them, from what its values look
  like and what the rule's source declares of it: booleans both ways; a dims parameter (its
  source says so, or, for one the rule does not read, its name) as any int dim, positive or
  negative, a tuple of distinct dims if the grid lists a tuple, None (all) if it lists None;
  a permutation where the source says so; ints, floats and
  tuples of ints near the listed ones; a shape, a string or a dtype from the listed values.
  An optional operand is present or absent, or a number near a listed one. The parameters
  of a ``verify.same_length`` group (roll's shifts and dims) are drawn with one length.
* meshes: 1-D to 3-D, axes of size 1 included, at most ``mesh_max_size`` devices.

A drawn :class:`Example` is the spec narrowed to one target, one grid point and one mesh, so
it turns into the same ``OpCase`` the generated grid tests use, and into a ``verify:`` block
that reproduces it. :func:`check_example` asserts that every layout fits its operand (no
layout of another shape, no split of a one-element dim) and verifies every strategy.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

from shardverify.errors import InvalidArgument
from shardverify.features.explore.meshes import DEFAULT_MESH_MAX_SIZE, check_mesh_max_size, mesh_shapes
from shardverify.features.explore.params import ParamDraw, param_draws
from shardverify.spec.op import InputSpec, ModuleInit, OpSpec, parse_op_spec
from shardverify.spec.op_model import value_length

__all__ = ["SIZES", "load_spec", "SizeSlot", "size_groups", "Example", "examples"]

# Small sizes mixing divisors of 2, 3 and 4 (hypothesis shrinks towards the first).
SIZES = (1, 2, 3, 4, 6, 8)


def load_spec(path: str | os.PathLike[str], *, display: str | None = None) -> OpSpec:
    """Parse one op spec file (``display`` is the name used in messages)."""
    from shardverify.spec.loader import load_yaml

    return parse_op_spec(load_yaml(path, display=display))


# --------------------------------------------------------------------------- sizes

@dataclass(frozen=True)
class SizeSlot:
    """One int of the harness: ``place`` is ``"inputs.<role>"``, ``"module"`` or
    ``"predecessor"``; ``index`` the position in the shape or args (a kwarg name for kwargs)."""

    place: str
    index: int | str
    value: int


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _init_slots(place: str, init: ModuleInit | None) -> list[SizeSlot]:
    if init is None:
        return []
    slots = [SizeSlot(place, i, v) for i, v in enumerate(init.args) if _is_size(v)]
    return slots + [SizeSlot(place, k, v) for k, v in init.kwargs if _is_size(v)]


def size_groups(spec: OpSpec) -> tuple[tuple[SizeSlot, ...], ...]:
    """Slots that take one drawn size together: a value seen in two or more places is one
    group (all its occurrences), any other occurrence is a group of its own."""
    slots = [SizeSlot(f"inputs.{i.role}", d, v) for i in spec.verify.inputs for d, v in enumerate(i.shape)]
    slots += _init_slots("module", spec.verify.module) + _init_slots("predecessor", spec.verify.predecessor)
    places: dict[int, set[str]] = {}
    for slot in slots:
        places.setdefault(slot.value, set()).add(slot.place)
    groups: list[tuple[SizeSlot, ...]] = []
    tied: dict[int, int] = {}
    for slot in slots:
        if len(places[slot.value]) < 2:
            groups.append((slot,))
        elif slot.value in tied:
            groups[tied[slot.value]] += (slot,)
        else:
            tied[slot.value] = len(groups)
            groups.append((slot,))
    return tuple(groups)


def _resized(spec: OpSpec, groups: Sequence[tuple[SizeSlot, ...]], sizes: Sequence[int]
             ) -> tuple[tuple[InputSpec, ...], ModuleInit | None, ModuleInit | None]:
    """The spec's inputs, module and predecessor with every slot set to its group's size."""
    new = {(slot.place, slot.index): size for group, size in zip(groups, sizes) for slot in group}

    def init(place: str, value: ModuleInit | None) -> ModuleInit | None:
        if value is None:
            return None
        args = tuple(new.get((place, i), a) for i, a in enumerate(value.args))
        kwargs = tuple((k, new.get((place, k), v)) for k, v in value.kwargs)
        return dataclasses.replace(value, args=args, kwargs=kwargs)

    inputs = tuple(dataclasses.replace(i, shape=tuple(new[(f"inputs.{i.role}", d)] for d in range(len(i.shape))))
                   for i in spec.verify.inputs)
    return inputs, init("module", spec.verify.module), init("predecessor", spec.verify.predecessor)


# --------------------------------------------------------------------------- examples

def _plain(value: object) -> object:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True, repr=False)
class Example:
    """One drawn instance: ``spec`` narrowed to one target, one grid point and one mesh."""

    spec: OpSpec

    @property
    def target(self) -> str:
        return self.spec.targets[0].name

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self.spec.verify.meshes[0]

    @property
    def point(self) -> tuple[tuple[str, object], ...]:
        return tuple((key, values[0]) for key, values in self.spec.verify.grid)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {i.role: i.shape for i in self.spec.verify.inputs}

    def case(self):
        """The OpCase the generated grid tests would build for this point."""
        (_, case), = self.spec.op_cases()
        return case

    def describe(self) -> str:
        """The drawn call: target (its full name), shapes, parameter values, and the mesh."""
        text = self.case().describe()
        short = self.target.rsplit(".", 1)[-1]
        if text.startswith(short + "("):     # torch.Tensor.roll(...), not roll(...)
            text = self.target + text[len(short):]
        return f"{text} on mesh {self.mesh_shape}"

    __repr__ = describe

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        """How hypothesis prints a falsifying example (instead of every field of the spec)."""
        printer.text(self.describe())

    def verify_block(self) -> str:
        """The spec's ``verify:`` section narrowed to this example, as YAML."""
        import yaml

        verify = self.spec.verify
        block: dict[str, object] = {}
        for key, init in (("predecessor", verify.predecessor), ("module", verify.module)):
            if init is not None:
                entry: dict[str, object] = {"target": init.target} if init.target else {}
                entry["args"] = _plain(init.args)
                if init.kwargs:
                    entry["kwargs"] = {k: _plain(v) for k, v in init.kwargs}
                block[key] = entry
        block["inputs"] = {i.role: {"shape": list(i.shape), "dtype": i.dtype} for i in verify.inputs}
        if verify.grid:
            block["grid"] = {key: [_plain(values[0])] for key, values in verify.grid}
        if verify.same_length:
            groups = [list(group) for group in verify.same_length]
            block["same_length"] = groups[0] if len(groups) == 1 else groups
        block["meshes"] = [list(self.mesh_shape)]
        tolerance = {k: v for k, v in (("rtol", verify.rtol), ("atol", verify.atol)) if v is not None}
        if tolerance:
            block["tolerance"] = tolerance
        if verify.seed:
            block["seed"] = verify.seed
        return yaml.safe_dump({"verify": block}, sort_keys=False, default_flow_style=None).rstrip()

    def reproduction(self) -> str:
        """Copy-pastable reproductions: a spec ``verify:`` block with the command that runs it,
        and the equivalent one-line Python check."""
        mesh = ",".join(map(str, self.mesh_shape))
        block = "\n".join("    " + line for line in self.verify_block().splitlines())
        return (f"Reproduce ({self.target} failed): replace the `verify:` section of {self.spec.source} "
                f"with\n{block}\n"
                f"  and run: shardverify verify {self.spec.name} --mesh {mesh}\n"
                f"  or run: python -c \"from shardverify.spec.case import *; from shardverify.features.explore "
                f"import replay; replay({self.case()!r}, {self.mesh_shape!r})\"")


def _narrowed(spec: OpSpec, target, sizes, point, mesh) -> Example:
    inputs, module, predecessor = _resized(spec, size_groups(spec), sizes)
    verify = dataclasses.replace(spec.verify, inputs=inputs, module=module, predecessor=predecessor,
                                 grid=tuple((key, (value,)) for key, value in point), meshes=(mesh,),
                                 counts=())
    return Example(dataclasses.replace(spec, targets=(target,), verify=verify))


def examples(spec: OpSpec, *, mesh_max_size: int = DEFAULT_MESH_MAX_SIZE) -> st.SearchStrategy[Example]:
    """Examples drawn from ``spec``: mesh, target, sizes, then parameters (shrinking in that
    order); the parameters of a ``verify.same_length`` group get one drawn length."""
    if not isinstance(spec, OpSpec):
        raise InvalidArgument(f"examples() needs an OpSpec (see load_spec), got {type(spec).__name__}")
    check_mesh_max_size(mesh_max_size)
    groups = size_groups(spec)
    params = param_draws(spec)

    @st.composite
    def draw_example(draw) -> Example:
        mesh = draw(mesh_shapes(mesh_max_size))
        target = draw(st.sampled_from(spec.targets))
        sizes = [draw(st.sampled_from(SIZES)) for _ in groups]
        fixed = dict(target.where)    # a target that takes only some grid values (aten.squeeze.dim)
        lengths = _group_lengths(spec, params, fixed)
        drawn_length: dict[int, int] = {}
        point = []
        for param in params:
            if param.key in fixed:
                point.append((param.key, fixed[param.key]))
                continue
            group = next((i for i, names in enumerate(spec.verify.same_length) if param.key in names), None)
            if group is not None and group not in drawn_length:
                drawn_length[group] = draw(st.sampled_from(lengths[group]))
            point.append((param.key, draw(param.strategy(drawn_length.get(group)))))
        return _narrowed(spec, target, sizes, tuple(point), mesh)

    return draw_example()


def _group_lengths(spec: OpSpec, params: Sequence[ParamDraw], fixed: dict) -> list[list[int]]:
    """For each ``same_length`` group, the lengths every parameter of it can take (a parameter
    not drawn keeps its default; one a target fixes, that value)."""
    drawn = {param.key: param.lengths for param in params}
    defaults = {p.name: p.default for p in spec.params}
    found = []
    for names in spec.verify.same_length:
        common = set.intersection(*(
            {value_length(fixed[name])} if name in fixed else set(drawn[name]) if name in drawn
            else {value_length(defaults[name])} for name in names))
        if not common:
            raise InvalidArgument(f"{spec.source}: no length fits every parameter of same_length "
                                  f"[{', '.join(names)}] (with {fixed or 'no fixed values'})")
        found.append(sorted(common))
    return found
