"""How exploration draws an op's parameters, derived from the spec alone: every grid key (and
each boolean parameter the grid leaves out that serves any value). A parameter bound to the
values it was verified on takes only those; one that serves any value is drawn beyond them by
what its values look like (booleans, dims, a permutation, numbers near the listed ones, or the
listed values). See :func:`param_draws`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

from shardverify.errors import InvalidArgument
from shardverify.spec.op import OpSpec
from shardverify.spec.op_model import value_length
from shardverify.strategies.options import PARAM

__all__ = ["dims_strategy", "ParamDraw", "param_draws", "param_strategies"]

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


def _hints(spec: OpSpec) -> dict[str, str]:
    """How the rule's source says to draw each parameter it reads ("dims", "permutation",
    "shape", or "" by its values): declared with the key that names it."""
    hints: dict[str, str] = {}
    for ref in spec.rule.refs if spec.rule is not None else ():
        if ref.kind == PARAM and (ref.draw or ref.name not in hints):
            hints[ref.name] = ref.draw
    return hints


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
    One that serves any value (``serves: any``, or read by the rule) is drawn beyond them, by
    what its values look like and what the rule's source declares of it: booleans both ways;
    dims (the source says so, or for a parameter the rule does not read its name holds "dim")
    as any int dim, positive or negative, a tuple of distinct dims if the grid lists a tuple,
    None (all) if it lists None; a permutation where the source says so (``view: permute``);
    numbers near the listed ones, of the same kinds (ints, floats, tuples of ints); a shape
    (the source says so), a string or a dtype from the listed values and the parameter's
    ``choices`` (every value the op takes: kl_div's reductions). An optional operand is
    present or absent, or a number near a listed one."""
    by_role = {o.role: o for o in spec.operands}
    params = {p.name: p for p in spec.params}
    hints = _hints(spec)
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
        found.append(_param_draw(key, tuple(values), param.default if param is not None else None, bound,
                                 operand, hints.get(key), rank))
    return tuple(found)


def _param_draw(key: str, values: tuple, default: object, bound: bool, operand: bool, hint: str | None,
                rank: int) -> ParamDraw:
    """``hint``: how the rule draws the parameter (None: the rule does not read it, and a name
    holding "dim" says it holds dims)."""
    lengths = frozenset(value_length(v) for v in values)
    known = list(values) + ([default] if not any(default == v and type(default) is type(v) for v in values) else [])
    near = tuple(values) + tuple(v for v in known[len(values):] if v is not None)   # a default None: none given
    if bound:
        return ParamDraw(key, "listed", values, lengths)
    if operand:
        return ParamDraw(key, "operand", values, frozenset({1}), rank, near=near)
    if all(isinstance(v, bool) for v in values) and all(isinstance(v, bool) or v is None for v in known):
        return ParamDraw(key, "bool", values, frozenset({1}))
    if hint == "permutation":
        # a permutation of every dim, as the op requires (any other tuple is refused by torch)
        return ParamDraw(key, "permutation", values, frozenset({rank}), rank)
    if (hint == "dims" or hint is None and "dim" in key.lower()) and all(_is_dims_value(v) for v in known):
        allow_tuple = any(isinstance(v, tuple) for v in known)
        return ParamDraw(key, "dims", values, frozenset(range(1, rank + 1) if allow_tuple else {1}), rank,
                         allow_all=None in known, allow_tuple=allow_tuple)
    if hint != "shape" and all(_is_number_value(v) for v in near) and any(v is not None for v in near):
        ints = any(_is_int(v) or isinstance(v, tuple) for v in near)
        most = max([rank] + [value_length(v) for v in near])
        return ParamDraw(key, "numbers", values, frozenset(range(1, most + 1)) if ints else frozenset({1}), rank,
                         near=near)
    return ParamDraw(key, "listed", values, lengths)


def param_strategies(spec: OpSpec) -> tuple[tuple[str, st.SearchStrategy], ...]:
    """(key, strategy) for every drawn parameter (see :func:`param_draws`), each on its own;
    :func:`examples` draws the parameters of a ``verify.same_length`` group together."""
    return tuple((draw.key, draw.strategy()) for draw in param_draws(spec))

