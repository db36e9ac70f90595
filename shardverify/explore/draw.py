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
  value (``serves: any``, or read by the rule through a ``*_param`` option) is drawn beyond
  them, from what its values look like: booleans both ways; a dims parameter (its name or a
  generator option about dims says so) as any int dim, positive or negative, a tuple of
  distinct dims if the grid lists a tuple, None (all) if it lists None; ints, floats and
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
import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from shardverify.spec.op import InputSpec, ModuleInit, OpSpec, parse_op_spec
from shardverify.spec.op_model import value_length
from shardverify.errors import InvalidArgument

__all__ = ["SIZES", "MAX_MESH_SIZE", "DEFAULT_MESH_MAX_SIZE", "PROFILE_ENV", "PROFILES", "load_profile",
           "profile_settings", "world_size", "load_spec", "SizeSlot", "size_groups", "dims_strategy",
           "ParamDraw", "param_draws", "param_strategies", "all_mesh_shapes", "mesh_shapes", "Example", "examples"]

# Small sizes mixing divisors of 2, 3 and 4 (hypothesis shrinks towards the first).
SIZES = (1, 2, 3, 4, 6, 8)
MAX_MESH_SIZE = 8
DEFAULT_MESH_MAX_SIZE = 4
MAX_MESH_NDIM = 3
PROFILE_ENV = "SV_HYPOTHESIS_PROFILE"

# --------------------------------------------------------------------------- profiles

# ci: few, reproducible examples; every check is a multi-rank run, so no deadline and no
# "too slow" health check (both would make CI flaky on a busy machine), no example database.
settings.register_profile("ci", max_examples=8, derandomize=True, deadline=None, database=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
# dev: a wider random search, failures remembered in .hypothesis/ and replayed first.
settings.register_profile("dev", max_examples=100, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILES = ("ci", "dev")


def _profile_name(name: str | None) -> str:
    name = name if name is not None else os.environ.get(PROFILE_ENV, "ci")
    if name not in PROFILES:
        raise InvalidArgument(f"hypothesis profile {name!r} (from {PROFILE_ENV} or the argument) "
                              f"is not one of {PROFILES}")
    return name


def load_profile(name: str | None = None) -> str:
    """Load the ``ci`` or ``dev`` profile (default: $SV_HYPOTHESIS_PROFILE, else ``ci``)."""
    name = _profile_name(name)
    settings.load_profile(name)
    return name


def profile_settings(name: str | None = None, *, fraction: float = 1.0, **changes) -> settings:
    """The named profile (default as in :func:`load_profile`), with ``max_examples`` scaled by
    ``fraction`` (at least 1) -- the multi-process tests run fewer examples."""
    if not 0 < fraction <= 1:
        raise InvalidArgument(f"fraction={fraction!r} must be in (0, 1]")
    parent = settings.get_profile(_profile_name(name))
    examples = max(1, int(parent.max_examples * fraction))
    # drawn calls the op itself refuses are rejected (a grouped conv's channels that groups do not
    # divide): many for an op whose shapes are coupled by a parameter, which is no failure
    changes["suppress_health_check"] = [*changes.get("suppress_health_check", ()), HealthCheck.filter_too_much]
    return settings(parent, max_examples=examples, **changes)


def world_size(default: int = DEFAULT_MESH_MAX_SIZE) -> int:
    """Devices a drawn mesh may use: $WORLD_SIZE when set (torchrun), else ``default``."""
    text = os.environ.get("WORLD_SIZE")
    value = int(text) if text and text.isdigit() else default
    return max(1, min(value, MAX_MESH_SIZE))


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


# --------------------------------------------------------------------------- parameters

_INT64 = (-2 ** 63, 2 ** 63 - 1)


def dims_strategy(ndim: int, *, allow_all: bool, allow_tuple: bool = True,
                  length: int | None = None) -> st.SearchStrategy:
    """Dims of an ``ndim``-D tensor: an int, a tuple of distinct dims when ``allow_tuple``
    (each positive or negative), or None (all dims) when ``allow_all``; shrinks to None, else
    ``0``. The form is the last choice, so the shrinker turns ``(d,)`` into ``d`` in one step.
    ``length`` asks for exactly that many dims (an int, ``(d,)`` or None count as one: see
    ``verify.same_length``)."""
    if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 1:
        raise InvalidArgument(f"dims_strategy needs a tensor of rank >= 1, got ndim={ndim!r}")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                               or not 1 <= length <= (ndim if allow_tuple else 1)):
        raise InvalidArgument(f"dims_strategy: length={length!r} dims of a {ndim}-D tensor"
                              f"{'' if allow_tuple else ' given as one int'} cannot be drawn")
    low, high = (1, ndim if allow_tuple else 1) if length is None else (length, length)

    @st.composite
    def dims(draw) -> int | tuple[int, ...] | None:
        if allow_all and low == 1 and draw(st.booleans()):
            return None
        chosen = draw(st.lists(st.tuples(st.integers(0, ndim - 1), st.booleans()), min_size=low,
                               max_size=high, unique_by=lambda pair: pair[0]))
        signed = tuple(d - ndim if negative else d for d, negative in chosen)
        if not allow_tuple:
            return signed[0]
        as_tuple = draw(st.booleans()) or len(signed) > 1   # always drawn: choices stay aligned
        return signed if as_tuple else signed[0]

    return dims()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_dims_value(value: object) -> bool:
    if isinstance(value, tuple):
        return all(_is_int(v) for v in value)
    return value is None or _is_int(value)


def _is_number_value(value: object) -> bool:
    """A value the explorer varies by its kind: None, an int, a float, a non-empty tuple of ints."""
    if isinstance(value, tuple):
        return bool(value) and all(_is_int(v) for v in value)
    return value is None or _is_int(value) or isinstance(value, float)


def _names_dims(spec: OpSpec, key: str) -> bool:
    """A parameter holds dims when its name says so (dim, dims, reduce_dim...) or a generator
    option about dims names it (``reduce_dims_param: dim``)."""
    if "dim" in key.lower():
        return True
    return any("dim" in option.lower() and key in named for option, named in _option_names(spec))


def _names_shape(spec: OpSpec, key: str) -> bool:
    """A parameter holds a shape (``shape_param``, ``whole_trailing_param: normalized_shape``):
    which values are valid depends on the drawn sizes, so it takes its listed values."""
    return any("shape" in option.lower() or "trailing" in option.lower()
               for option, named in _option_names(spec) if key in named)


def _option_names(spec: OpSpec) -> list[tuple[str, tuple]]:
    return [(option, value if isinstance(value, tuple) else (value,)) for option, value in spec.options]


def _op_rank(spec: OpSpec) -> int:
    """Rank of the tensor the op acts on: the input operand with the lowest index."""
    by_role = {o.role: o for o in spec.operands}
    inputs = [i for i in spec.verify.inputs if by_role[i.role].kind == "input"]
    first = min(inputs, key=lambda i: by_role[i.role].index if by_role[i.role].index is not None else 0)
    return len(first.shape)


def _ints_near(known: Sequence[int]) -> st.SearchStrategy[int]:
    """Ints around the listed ones: from 2 below the least (or below 0) to 2 above the greatest
    (or above 0), never below 1 (0) when every listed int is at least 1 (0): a count, a size,
    a padding. The listed ints come first, so a failure shrinks towards the grid."""
    low, high = min(min(known), 0) - 2, max(max(known), 0) + 2
    if min(known) >= 0:
        low = min(1, min(known))
    low, high = max(low, _INT64[0]), min(high, _INT64[1])
    return st.one_of(st.sampled_from(sorted(set(known))), st.integers(low, high))


def _three_digits(value: float) -> float:
    return float(f"{value:.3g}")


def _floats_near(known: Sequence[float]) -> st.SearchStrategy[float]:
    """Floats of the listed ones' sign and magnitude: from a quarter of the least to four times
    the greatest when all are positive, else a span as wide as theirs (at least 1) beyond
    them and 0; three significant digits, so a reproduction reads well."""
    if min(known) > 0:
        low, high = min(known) / 4, max(known) * 4
    else:
        low, high = min(min(known), 0.0), max(max(known), 0.0)
        width = max(1.0, high - low)
        low, high = (0.0 if min(known) >= 0 else low - width), high + width
    drawn = st.floats(low, high, allow_nan=False, allow_infinity=False, allow_subnormal=False)
    return st.one_of(st.sampled_from(sorted(set(known))), drawn.map(_three_digits))


@dataclass(frozen=True)
class ParamDraw:
    """How one grid key (or parameter) is drawn: ``strategy(length)`` gives values, of exactly
    ``length`` (see ``verify.same_length``) when one is asked; ``lengths`` are those it can
    take. ``kind``: "operand" (an optional operand: absent, present or a number), "listed" (the
    grid's values only: a parameter bound to them, a string, a dtype, a shape), "bool",
    "dims", "permutation" or "numbers" (ints, floats and tuples of ints near the listed ones)."""

    key: str
    kind: str
    values: tuple                  # the grid's values (or the default), drawn first
    lengths: frozenset[int]
    rank: int = 1
    near: tuple = ()               # the numbers drawn ones lie near: the values and the default
    allow_all: bool = False
    allow_tuple: bool = False

    def strategy(self, length: int | None = None) -> st.SearchStrategy:
        if length is not None and length not in self.lengths:
            raise InvalidArgument(f"parameter {self.key!r} ({self.kind}) takes lengths {sorted(self.lengths)}, "
                                  f"not {length}")
        if self.kind == "listed":
            return st.sampled_from([v for v in self.values if length is None or value_length(v) == length])
        if self.kind == "bool":
            return st.booleans()
        if self.kind == "permutation":
            return st.permutations(range(self.rank)).map(tuple)
        if self.kind == "dims":
            return dims_strategy(self.rank, allow_all=self.allow_all, allow_tuple=self.allow_tuple, length=length)
        if self.kind == "operand":   # both ways, unless the grid passes a number in its place
            flags = [v for v in self.values if isinstance(v, bool)]
            present = st.booleans() if len(flags) == len(self.values) else st.sampled_from(flags or [True])
            return st.one_of(present, *_number_options(self.near, None))
        listed = [v for v in self.values if length is None or value_length(v) == length]
        return st.one_of(*([st.sampled_from(listed)] if listed else []), *_number_options(self.near, length))


def _number_options(near: Sequence[object], length: int | None) -> list[st.SearchStrategy]:
    """Strategies for numbers of the kinds ``near`` holds: ints near its ints, floats near its
    floats, tuples of ints near every int it holds (of its tuples' lengths, or ``length``),
    None where it holds None."""
    ints = [v for v in near if _is_int(v)]
    floats = [v for v in near if isinstance(v, float)]
    tuples = [v for v in near if isinstance(v, tuple)]
    pool = ints + [item for t in tuples for item in t]
    options: list[st.SearchStrategy] = []
    if length in (None, 1):
        options += [st.none()] if None in near else []
        options += [_ints_near(ints)] if ints else []
        options += [_floats_near(floats)] if floats else []
    sizes = sorted({len(t) for t in tuples}) if length is None else [length] if tuples or length > 1 else []
    options += [st.tuples(*[_ints_near(pool)] * size) for size in sizes if pool]
    return options


def param_draws(spec: OpSpec) -> tuple[ParamDraw, ...]:
    """How each parameter is drawn: every grid key, and each boolean parameter outside the grid
    that serves any value (any other parameter outside the grid keeps its default: the grid
    lists what the op takes safely; torch's max_pool2d backward corrupts memory for a window
    wholly in the padding, which a dilation can make). A parameter bound to the values it was
    verified on (see ``OpSpec.bindings``) takes only those: its handler refuses any other.
    One that serves any value (``serves: any``, or named by a ``*_param`` option) is drawn
    beyond them, by what its values look like: booleans both ways; dims (its name or a
    generator option about dims says so) as any int dim, positive or negative, a tuple of
    distinct dims if the grid lists a tuple, None (all) if it lists None; a permutation for
    ``view: permute``; numbers near the listed ones, of the same kinds (ints, floats, tuples
    of ints); a shape, a string or a dtype from the listed values and the parameter's
    ``choices`` (every value the op takes: kl_div's reductions). An optional operand is
    present or absent, or a number near a listed one."""
    by_role = {o.role: o for o in spec.operands}
    params = {p.name: p for p in spec.params}
    options = dict(spec.options)
    rank = _op_rank(spec)
    grid = dict(spec.verify.grid)
    keys = list(spec.verify.grid)
    keys += [(p.name, (p.default,)) for p in spec.params
             if p.name not in grid and isinstance(p.default, bool) and spec.serves_every_value(p.name)]
    found = []
    for key, values in keys:
        param = params.get(key)
        bound = param is not None and not spec.serves_every_value(key)
        operand = key in by_role and by_role[key].optional
        if param is not None and param.choices and not bound:   # every value the op takes (a string's)
            values = tuple(values) + tuple(c for c in param.choices if c not in values)
        found.append(_param_draw(spec, key, tuple(values), param.default if param is not None else None, bound,
                                 operand, options, rank))
    return tuple(found)


def _param_draw(spec: OpSpec, key: str, values: tuple, default: object, bound: bool, operand: bool,
                options: dict, rank: int) -> ParamDraw:
    lengths = frozenset(value_length(v) for v in values)
    known = list(values) + ([default] if not any(default == v and type(default) is type(v) for v in values) else [])
    near = tuple(values) + tuple(v for v in known[len(values):] if v is not None)   # a default None: none given
    if bound:
        return ParamDraw(key, "listed", values, lengths)
    if operand:
        return ParamDraw(key, "operand", values, frozenset({1}), rank, near=near)
    if all(isinstance(v, bool) for v in values) and all(isinstance(v, bool) or v is None for v in known):
        return ParamDraw(key, "bool", values, frozenset({1}))
    if options.get("view") == "permute" and options.get("dims_param") == key:
        # a permutation of every dim, as the op requires (any other tuple is refused by torch)
        return ParamDraw(key, "permutation", values, frozenset({rank}), rank)
    if _names_dims(spec, key) and all(_is_dims_value(v) for v in known):
        allow_tuple = any(isinstance(v, tuple) for v in known)
        return ParamDraw(key, "dims", values, frozenset(range(1, rank + 1) if allow_tuple else {1}), rank,
                         allow_all=None in known, allow_tuple=allow_tuple)
    if not _names_shape(spec, key) and all(_is_number_value(v) for v in near) and any(v is not None for v in near):
        ints = any(_is_int(v) or isinstance(v, tuple) for v in near)
        most = max([rank] + [value_length(v) for v in near])
        return ParamDraw(key, "numbers", values, frozenset(range(1, most + 1)) if ints else frozenset({1}), rank,
                         near=near)
    return ParamDraw(key, "listed", values, lengths)


def param_strategies(spec: OpSpec) -> tuple[tuple[str, st.SearchStrategy], ...]:
    """(key, strategy) for every drawn parameter (see :func:`param_draws`), each on its own;
    :func:`examples` draws the parameters of a ``verify.same_length`` group together."""
    return tuple((draw.key, draw.strategy()) for draw in param_draws(spec))


# --------------------------------------------------------------------------- meshes

def all_mesh_shapes(max_size: int = DEFAULT_MESH_MAX_SIZE,
                    max_ndim: int = MAX_MESH_NDIM) -> tuple[tuple[int, ...], ...]:
    """Every mesh shape of 1 to ``max_ndim`` axes (sizes >= 1) with at most ``max_size``
    devices, simplest first: fewer axes, then fewer devices."""
    shapes = [shape for ndim in range(1, max_ndim + 1)
              for shape in itertools.product(range(1, max_size + 1), repeat=ndim) if math.prod(shape) <= max_size]
    return tuple(sorted(shapes, key=lambda shape: (len(shape), math.prod(shape), shape)))


def mesh_shapes(max_size: int = DEFAULT_MESH_MAX_SIZE, max_ndim: int = MAX_MESH_NDIM) -> st.SearchStrategy:
    """Mesh shapes drawn evenly from :func:`all_mesh_shapes` (shrinking towards ``(1,)``)."""
    return st.sampled_from(all_mesh_shapes(max_size, max_ndim))


def _check_mesh_max_size(mesh_max_size: object) -> int:
    if isinstance(mesh_max_size, bool) or not isinstance(mesh_max_size, int) or not (
            1 <= mesh_max_size <= MAX_MESH_SIZE):
        raise InvalidArgument(f"mesh_max_size={mesh_max_size!r} must be an int from 1 to {MAX_MESH_SIZE}")
    return mesh_max_size


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
                f"  or run: python -c \"from shardverify.spec.case import *; from shardverify.explore "
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
    _check_mesh_max_size(mesh_max_size)
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
