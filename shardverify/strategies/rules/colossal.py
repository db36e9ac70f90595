"""The rules engine's ``naming: colossalai`` option: ColossalAI's strategy names and order for a
contraction ``input [..M.., K] x other (K, N) (+ bias [N]) -> output [..M.., N]``.

The engine derives every strategy (layouts, communication, partial and post-added operands)
from the rule as it always does; this option only chooses which assignments to offer, in which
order, and how to name them, on the logical 2-D views: input ``[M, K]`` (M's factors are the
input dims the output keeps and ``other`` lacks), other ``[K, N]`` (however it is stored),
output ``[M, N]``. A strategy is a triple of mesh-axis tuples ``(A, B, C)`` laid on
``(M, K, N)``, named ``OUT = IN x OTHER`` (``S0S1 = S0R x RS1``), with the suffix ``_i`` for
A laid on input dim ``i`` (``_0,1``: A's axes over two dims) and ``+P<axes>`` after an input
held as a partial sum (the ``linear_in`` operands, over the axes left free).

ColossalAI's families come first, in its order: ``SS = SR x RS``, ``SR = SS x SR``,
``RS = RS x SS`` over ordered pairs of distinct mesh axes (``itertools.permutations`` order);
``RR = RS x SR`` and ``RS = RR x RS`` over each axis; ``S01R = S01R x RR``,
``RR = RS01 x S01R``, ``RS01 = RR x RS01`` over all mesh axes in order. Then what ColossalAI
leaves out, so that the completeness audit finds nothing missing: every other way to give each
mesh axis to M, K, N or none, the axes of one dim in every order, A spread over several dims,
and partial-sum inputs. Duplicates by layout are dropped (the first name stays). A strategy
reducing its output is offered again (after ColossalAI's) with each additive operand a partial
sum over every reduced axis (``, bias+P0``: each rank adds its own piece, Megatron's
row-parallel Linear without the post-add); one reducing nothing, with each ``monotone_in``
additive operand a partial max or min over each set of free axes (``, bias+Pmax1``).
``RR = RR x RR`` is last. A one-element dim is never split.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from shardverify.errors import StrategyError
from shardverify.sharding.partial import PartialInput
from shardverify.sharding.sharding_spec import dim_text
from shardverify.sharding.strategy import OperationData, ShardingStrategy
from shardverify.strategies.rules.rule import Rule

__all__ = ["NAMINGS", "Contraction", "contraction", "logical_families", "every_family", "logical_name", "offered"]

NAMINGS = ("rules", "colossalai")
Axes = tuple[int, ...]


@dataclass(frozen=True)
class Contraction:
    """Where M, K and N sit: M's factor of each input dim before K's (None: a size-1 dim)."""

    m: tuple[str | None, ...]
    k: str
    n: str


def contraction(rule: Rule) -> Contraction:
    """The rule read as ``[..M.., K] x (K, N) -> [..M.., N]``; InvalidArgument-like StrategyError else."""
    if len(rule.inputs) < 2 or not rule.outputs:
        raise StrategyError("naming colossalai needs a contraction of two operands into one output")
    left, right, out = ({f for dim in term for f in dim} for term in (rule.inputs[0], rule.inputs[1], rule.outputs[0]))
    k, n = sorted((left & right) - out), sorted((right & out) - left)
    term = rule.inputs[0]
    if len(k) != 1 or len(n) != 1 or not term or term[-1] != (k[0],) or \
            any(len(dim) > 1 or (dim and dim[0] not in out - right) for dim in term[:-1]):
        raise StrategyError(f"naming colossalai needs a rule [..M.., K] x (K, N) -> [..M.., N] with one factor per "
                            f"dim; got inputs {rule.inputs[:2]} and output {rule.outputs[0]}")
    return Contraction(tuple(dim[0] if dim else None for dim in term[:-1]), k[0], n[0])


def logical_families(mesh_ndim: int) -> list[tuple[Axes, Axes, Axes]]:
    """ColossalAI's ``(A, B, C)`` triples (axes on M, K, N) in its order, deduplicated."""
    axes = tuple(range(mesh_ndim))
    pairs = list(itertools.permutations(axes, 2))
    triples: list[tuple[Axes, Axes, Axes]] = []
    triples += [((x,), (), (y,)) for x, y in pairs]      # SS = SR x RS
    triples += [((x,), (y,), ()) for x, y in pairs]      # SR = SS x SR
    triples += [((), (x,), (y,)) for x, y in pairs]      # RS = RS x SS
    triples += [((), (x,), ()) for x in axes]            # RR = RS x SR
    triples += [((), (), (x,)) for x in axes]            # RS = RR x RS
    triples += [(axes, (), ()), ((), axes, ()), ((), (), axes)]   # S01R, RR = RS01 x S01R, RS01
    triples.append(((), (), ()))                         # RR = RR x RR
    return list(dict.fromkeys(triples))


def every_family(mesh_ndim: int) -> list[tuple[Axes, Axes, Axes]]:
    """Every way to give each mesh axis to M, K, N or none, the axes of one dim in every order
    (``S01`` and ``S10``): ColossalAI's families first (:func:`logical_families`), in its order."""
    axes = range(mesh_ndim)
    found = list(logical_families(mesh_ndim))
    for slots in itertools.product(range(4), repeat=mesh_ndim):      # 0: M, 1: K, 2: N, 3: none
        groups = [[x for x in axes if slots[x] == s] for s in range(3)]
        found += [(a, b, c) for a, b, c in itertools.product(*(itertools.permutations(g) for g in groups))]
    return list(dict.fromkeys(found))


def logical_name(a: Axes, b: Axes, c: Axes, p_in: Axes = (), p_other: Axes = (),
                 text: Callable[[Axes], str] = dim_text) -> str:
    """``OUT = IN x OTHER`` on the logical views; ``+P<axes>`` after an input held as a partial sum.
    ``text``: how a dim over some axes is written (``S01``, ``R``): :func:`dim_text`, or one
    remembering its answers (:func:`offered` names hundreds of strategies from a few axes)."""
    def p(axes: Axes) -> str:
        return f"+P{''.join(map(str, axes))}" if axes else ""
    a, b, c = text(a), text(b), text(c)
    return f"{a}{c} = {a}{b}{p(p_in)} x {b}{c}{p(p_other)}"


def logical_views(rule: Rule, inputs: list[OperationData], outputs: list[OperationData]) -> list[OperationData]:
    """The operands with their logical shapes: input ``[M, K]``, other ``[K, N]``, output ``[M, N]``."""
    con, size = contraction(rule), rule.size
    k, n = size[con.k], size[con.n]
    views = {0: (math.prod(inputs[0].shape[:-1]), k), 1: (k, n)}
    return [dataclasses.replace(d, logical_shape=views[i]) if i in views else d for i, d in enumerate(inputs)] + \
        [dataclasses.replace(outputs[0], logical_shape=(math.prod(outputs[0].shape[:-1]), n))] + outputs[1:]


def offered(layouts, draft, finish, rule: Rule, options, inputs: list[OperationData],
            outputs: list[OperationData], mesh_shape: tuple[int, ...]) -> list[ShardingStrategy]:
    """The strategies in ColossalAI's order and names: ``layouts(axes)`` are the operands'
    layouts under a choice, ``draft(axes, partial, in_op, out_op)`` the engine's derivation of
    its strategy (None where the layout does not fit the call) and ``finish(draft, name)`` the
    strategy, costed. A choice laying the operands out as an earlier offered one did is dropped
    before it is derived."""
    con, size = contraction(rule), rule.size
    inp, other, out = inputs[0], inputs[1], outputs[0]
    additive = [inputs[i] for i in rule.additive]
    monotone = {role for role, _, _ in options.monotone_in}
    roles = [g[0] for g in options.linear_in if len(g) == 1 and g[0] in (inp.role, other.role)]
    floating = all(d.dtype.is_floating_point for d in (inp, other, out))

    def splits_one(axes: Axes, n: int) -> bool:    # a one-element dim split is no sharding
        return n < 2 and math.prod(mesh_shape[x] for x in axes) > 1

    texts: dict[Axes, str] = {}

    def text(axes: Axes) -> str:      # dim_text, remembered: six per name, from a few axes
        found = texts.get(axes)
        if found is None:
            found = texts[axes] = dim_text(axes)
        return found

    strategies: dict[tuple, ShardingStrategy] = {}     # layouts -> the first strategy laying them so
    biased: dict[tuple, ShardingStrategy] = {}         # the same with an additive operand as a piece
    lead = range(len(con.m))
    for a, b, c, placement, partial in _choices(len(mesh_shape), mesh_shape, lead, roles):
        if splits_one(b, size[con.k]) or splits_one(c, size[con.n]) or \
                any(splits_one(ax, inp.shape[d]) for d, ax in placement.items()):
            continue
        if partial and not floating:
            continue
        if any(con.m[d] is None for d in placement):
            continue      # a size-1 dim over size-1 mesh axes: no factor to lay them on
        axes = {con.m[d]: ax for d, ax in placement.items()} | ({con.k: b} if b else {}) | ({con.n: c} if c else {})
        p_in, p_other = partial.get(inp.role, ()), partial.get(other.role, ())
        pieces = {d.name: held for d, held in ((inp, p_in), (other, p_other)) if held}
        key = (layouts(axes), p_in, p_other)
        if key in strategies:
            continue
        derived = draft(axes, pieces, "sum", "sum")
        if derived is None:
            continue
        name = logical_name(a, b, c, p_in, p_other, text) + _placement_suffix(a, placement)
        strategy = finish(derived, name)
        reduced = tuple(sorted(set(b) | set(p_in) | set(p_other))) if additive else ()
        for bias in additive:
            if reduced:
                biased[key] = strategy.replace(name=f"{name}, {bias.role}+P{''.join(map(str, reduced))}", post_add=(),
                                               partial_inputs=strategy.partial_inputs + (PartialInput(bias.name, reduced),))
            elif bias.role in monotone and bias.dtype.is_floating_point and out.dtype.is_floating_point:
                used = set(a) | set(c)
                free = [x for x, n in enumerate(mesh_shape) if n > 1 and x not in used]
                for count in range(1, len(free) + 1):
                    for held in itertools.combinations(free, count):
                        for op in ("max", "min"):
                            extremum = draft(axes, {bias.name: held}, op, op)
                            if extremum is not None:
                                biased[key + (op, held)] = finish(
                                    extremum, f"{name}, {bias.role}+P{op}{''.join(map(str, held))}")
        strategies[key] = strategy
    found = list(strategies.values())
    return found[:-1] + list(biased.values()) + found[-1:]


def _choices(mesh_ndim: int, mesh_shape: tuple[int, ...], lead: range, roles: list[str]):
    """``(A, B, C, placement of A on the leading dims, partial inputs)`` in offering order:
    ColossalAI's families with A on one leading dim and no partial input, then every family
    with every placement and every choice of partial inputs, the replicated strategy last."""
    replicated = ((), (), ())
    for a, b, c in logical_families(mesh_ndim):
        if (a, b, c) != replicated:
            for placement in _placements(a, lead, split=False):
                yield a, b, c, placement, {}
    for a, b, c in every_family(mesh_ndim):
        free = [x for x in range(mesh_ndim) if mesh_shape[x] > 1 and x not in a + b + c]
        for placement in _placements(a, lead, split=True):
            for picks in itertools.product(("", *roles), repeat=len(free)):
                partial: dict[str, Axes] = {}
                for axis, role in zip(free, picks):
                    if role:
                        partial[role] = partial.get(role, ()) + (axis,)
                if (a, b, c) != replicated or partial:
                    yield a, b, c, placement, partial
    yield (), (), (), {}, {}


def _placements(a: Axes, lead: range, split: bool) -> list[dict[int, Axes]]:
    """Where M's axes ``a`` lie on the input's leading dims: all on one dim (ColossalAI's ``_i``),
    then, with ``split``, each axis on a dim of its own choosing (M over two leading dims)."""
    if not a:
        return [{}]
    found = [{d: a} for d in lead]
    if split:
        for dims in itertools.product(lead, repeat=len(a)):
            if len(set(dims)) > 1:
                part: dict[int, Axes] = {}
                for axis, d in zip(a, dims):
                    part[d] = part.get(d, ()) + (axis,)
                found.append(dict(sorted(part.items())))
    return found


def _placement_suffix(a: Axes, placement: dict[int, Axes]) -> str:
    """``_1`` for M on leading dim 1; ``_0,1`` for M's first axis on dim 0, its second on dim 1."""
    if not a:
        return ""
    if len(placement) == 1:
        return f"_{next(iter(placement))}"
    return "_" + ",".join(str(next(d for d, ax in placement.items() if axis in ax)) for axis in a)
