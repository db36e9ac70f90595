"""Strategies for ``output = input @ other (+ bias)`` with ``input [..., K]``, ``other [K, N]``.

Every strategy is reasoned on logical 2-D views: input ``[M, K]`` (all leading dims
flattened into M), other ``[K, N]`` (a weight stored ``[N, K]`` as nn.Linear does is read
transposed, option ``other_layout="out_in"``), output ``[M, N]``, bias ``[N]``.
A strategy is a triple of mesh-axis tuples ``(A, B, C)`` laid on ``(M, K, N)``; its name
reads ``OUT = IN x OTHER`` (``S0S1 = S0R x RS1``) and its communication follows from it:

* ``B`` (contraction) sharded: the output is a partial sum -> ALLREDUCE_FWD_IDENTITY_BWD
  AFTER the op on the output over ``B``;
* ``C`` sharded: the input's gradient is partial over ``C`` -> IDENTITY_FWD_ALLREDUCE_BWD
  BEFORE the op on the input over ``C``;
* ``A`` sharded: the gradients of ``other`` and ``bias`` are partial over ``A`` ->
  IDENTITY_FWD_ALLREDUCE_BWD as a gradient HOOK (parameters) or BEFORE the op (activations);
* one factor a partial sum over ``P``: the output is reduced over ``P`` too, and the other
  factor's gradient is partial over ``P`` (a partial value's own gradient is whole).

ColossalAI's families come first, in its order: ``SS = SR x RS``, ``SR = SS x SR``,
``RS = RS x SS`` over ordered pairs of distinct mesh axes ((0, 1), (1, 0), then (0, 2), ... on
3-D meshes, in ``itertools.permutations`` order); ``RR = RS x SR`` and ``RS = RR x RS`` over each
axis; ``S01R = S01R x RR``, ``RR = RS01 x S01R``, ``RS01 = RR x RS01`` over all mesh axes in
order (``S012`` on a 3-D mesh). Then what ColossalAI leaves out, so that the completeness audit
finds nothing missing: every other way to give each mesh axis to M, K, N or none, the axes of
one dim in every order (``S10``: DTensor's shard order; data parallel over one axis of a 2-D
mesh), M's axes spread over several leading dims (suffix ``_0,1``), and inputs held as partial
sums over the axes left free (``RS1 = RR+P0 x RS1``: the product is linear in each factor, so
the output is a partial sum over their axes too, all-reduced after the op like a sharded K).
``RR = RR x RR`` is last. Duplicates by layout are dropped, so a 1-D mesh has
``RR = RS0 x S0R``, ``RS0 = RR x RS0``, ``S0R = S0R x RR``, ``RR = RR+P0 x RR``,
``RR = RR x RR+P0`` and ``RR = RR x RR``.

ColossalAI lays a sharded M on one physical leading input dim ``i`` at a time, one strategy per
``i`` named with the suffix ``_i`` (``S0S1 = S0R x RS1_1``). A size that does not divide
is split as DTensor splits it (blocks of ceil(n/k), the last smaller or empty): M, K and N are
whole dims of every operand, so each is cut the same way wherever it appears. A dim of one
element is never split (one rank would hold it, the others nothing).

Bias: it follows the output's last dim. When the output is reduced (``B`` sharded, or a
partial input), adding the bias inside the op would count it once per rank in the all-reduced
sum, so those strategies declare the bias as a :class:`~shardverify.sharding.strategy.PostAdd`:
the op runs without it and the bias is added once, after the partial output is reduced
(Megatron's row-parallel Linear; ColossalAI gets the same by splitting the bias add off the
linear in its tracer). Each is offered once more (after ColossalAI's) with the bias itself a
partial sum over every reduced axis (suffix ``, bias+P0``): each rank adds its own piece. A
strategy reducing nothing is offered again with the bias a partial max or min over free axes
(``, bias+Pmax1``): adding it is nondecreasing in it, so the output is a partial max or min.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from shardverify.errors import StrategyError
from shardverify.strategies.generators.common import compute_cost, grad_sync, make_strategy
from shardverify.strategies.generators.registry import GeneratorContext, register_generator
from shardverify.sharding.sharding_spec import DimSpec, ShardingSpec
from shardverify.sharding.partial import PartialInput, PostAdd
from shardverify.sharding.strategy import CommAction, CommPattern, CommWhere, ShardingStrategy

Axes = tuple[int, ...]
LAYOUTS = ("in_out", "out_in")


def logical_families(mesh_ndim: int) -> list[tuple[Axes, Axes, Axes]]:
    """The ``(A, B, C)`` triples (axes on M, K, N) in generation order, deduplicated."""
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


def logical_name(a: Axes, b: Axes, c: Axes, p_in: Axes = (), p_other: Axes = ()) -> str:
    """``OUT = IN x OTHER`` on the logical views; ``+P<axes>`` after an input held as a partial sum."""
    def s(axes: Axes) -> str:
        return str(DimSpec(axes))

    def p(axes: Axes) -> str:
        return f"+P{''.join(map(str, axes))}" if axes else ""
    return f"{s(a)}{s(c)} = {s(a)}{s(b)}{p(p_in)} x {s(b)}{s(c)}{p(p_other)}"


def _validate(ctx: GeneratorContext, layout: str) -> tuple[int, int]:
    inp, other, out = ctx.operand("input"), ctx.operand("other"), ctx.operand("output")
    bias = ctx.operands.get("bias")
    if layout not in LAYOUTS:
        raise StrategyError(f"{ctx.handler_name}: option other_layout={layout!r}, expected one of {LAYOUTS}")
    if len(other.shape) != 2 or not inp.shape:
        raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r} needs a 2-D other and an input of "
                            f"rank >= 1, got input {inp.shape} and other {other.shape}")
    k, n = other.shape if layout == "in_out" else other.shape[::-1]
    if inp.shape[-1] != k or out.shape != inp.shape[:-1] + (n,):
        raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r}: input {inp.shape}, other {other.shape} "
                            f"({layout}) and output {out.shape} are not a projection [..., K] x [K, N]")
    if bias is not None and bias.shape != (n,):
        raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r}: bias shape {bias.shape}, expected ({n},)")
    return k, n


@register_generator("linear_projection")
def generate(ctx: GeneratorContext) -> list[ShardingStrategy]:
    layout = str(ctx.option("other_layout", "in_out"))
    k, n = _validate(ctx, layout)
    inp, other, out = ctx.operand("input"), ctx.operand("other"), ctx.operand("output")
    bias = ctx.operands.get("bias")
    inp = dataclasses.replace(inp, logical_shape=(math.prod(inp.shape[:-1]), k))
    other = dataclasses.replace(other, logical_shape=(k, n))
    out = dataclasses.replace(out, logical_shape=(math.prod(out.shape[:-1]), n))
    operands = [inp, other] + ([bias] if bias is not None else []) + [out]
    mesh_shape = ctx.mesh.shape
    lead = range(len(inp.shape) - 1)

    def splits_one(axes: Axes, size: int) -> bool:    # a one-element dim split is no sharding
        return size < 2 and math.prod(mesh_shape[x] for x in axes) > 1

    strategies: dict[tuple, ShardingStrategy] = {}     # layouts -> the first strategy laying them so
    biased: dict[tuple, ShardingStrategy] = {}         # the same with the bias as a partial sum
    colossal = logical_families(ctx.mesh.ndim)
    for a, b, c, placement, partial in _choices(colossal, ctx.mesh.ndim, mesh_shape, lead):
        if splits_one(b, k) or splits_one(c, n) or any(splits_one(ax, inp.shape[d]) for d, ax in placement.items()):
            continue
        if partial and not (inp.dtype.is_floating_point and other.dtype.is_floating_point
                            and out.dtype.is_floating_point):
            continue
        p_in, p_other = partial.get("input", ()), partial.get("other", ())
        other_part = {0: b, 1: c} if layout == "in_out" else {0: c, 1: b}
        specs = {
            inp.name: ShardingSpec.from_partition(mesh_shape, inp.shape, {-1: b, **placement}),
            other.name: ShardingSpec.from_partition(mesh_shape, other.shape, other_part),
            out.name: ShardingSpec.from_partition(mesh_shape, out.shape, {-1: c, **placement}),
        }
        if bias is not None:
            specs[bias.name] = ShardingSpec.from_partition(mesh_shape, bias.shape, {-1: c})
        key = (tuple(specs.values()), p_in, p_other)
        if key in strategies:
            continue
        # the input's gradient is partial over N's axes and over those of the weight's pieces;
        # the weight's over M's and over those of the input's pieces
        actions = []
        if c or p_other:
            actions.append(CommAction(CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, _union(c, p_other), inp.name,
                                      CommWhere.BEFORE))
        actions += grad_sync(other, _union(a, p_in))
        if bias is not None:
            actions += grad_sync(bias, a)
        reduced = _union(b, p_in, p_other)
        if reduced:
            actions.append(CommAction(CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, reduced, out.name, CommWhere.AFTER))
        m_local = math.prod(specs[inp.name].local_shape()[:-1])
        k_local, n_local = specs[inp.name].local_shape()[-1], specs[out.name].local_shape()[-1]
        # FLOPs of the local matmul; an empty one (no rows) costs its largest operand, as the check
        # measures an op it counts no FLOPs for
        compute = compute_cost(2 * m_local * k_local * n_local, [spec.local_numel() for spec in specs.values()])
        name = logical_name(a, b, c, p_in, p_other) + _placement_suffix(a, placement)
        strategy = make_strategy(ctx, name, operands, specs, actions, compute)
        pieces = tuple(PartialInput(data.name, axes) for data, axes in ((inp, p_in), (other, p_other)) if axes)
        if partial:
            strategy = strategy.replace(partial_inputs=pieces)
        if bias is not None and reduced:
            # the bias is added once after the reduce or (offered after ColossalAI's) arrives as
            # a partial sum over every reduced axis, each rank adding its own piece
            biased[key] = strategy.replace(name=f"{name}, bias+P{''.join(map(str, reduced))}",
                                           partial_inputs=pieces + (PartialInput(bias.name, reduced),))
            strategy = strategy.replace(post_add=(PostAdd(bias.name, (len(out.shape) - 1,)),))
        elif bias is not None and bias.dtype.is_floating_point and out.dtype.is_floating_point:
            biased.update(_extremum_bias(ctx, name, operands, specs, compute, key, a, c))
        strategies[key] = strategy
    found = list(strategies.values())
    return found[:-1] + list(biased.values()) + found[-1:]


def _extremum_bias(ctx: GeneratorContext, name: str, operands, specs: dict, compute, key: tuple, a: Axes,
                   c: Axes) -> dict[tuple, ShardingStrategy]:
    """A strategy reducing nothing, again with the bias a partial max or min over each set of
    free mesh axes (``, bias+Pmax1``): the output is then one too, since adding a value is
    nondecreasing in it. Each rank's output gradient reaches the elements its bias piece holds
    the extremum of, so the input's and the weight's gradients are partial over those axes."""
    inp, other, bias, out = operands
    used = set(a) | set(c) | specs[inp.name].sharded_axes()
    free = [x for x, size in enumerate(ctx.mesh.shape) if size > 1 and x not in used]
    found = {}
    for size in range(1, len(free) + 1):
        for held in itertools.combinations(free, size):
            for op in ("max", "min"):
                actions = [CommAction(CommPattern.IDENTITY_FWD_ALLREDUCE_BWD, _union(c, held), inp.name,
                                      CommWhere.BEFORE)]
                actions += grad_sync(other, _union(a, held)) + grad_sync(bias, a)
                actions.append(CommAction(CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, held, out.name, CommWhere.AFTER,
                                          op=op))
                strategy = make_strategy(ctx, f"{name}, bias+P{op}{''.join(map(str, held))}", operands, specs,
                                         actions, compute)
                found[key + (op, held)] = strategy.replace(partial_inputs=(PartialInput(bias.name, held, op),))
    return found


def _choices(colossal: list[tuple[Axes, Axes, Axes]], mesh_ndim: int, mesh_shape: tuple[int, ...], lead: range):
    """``(A, B, C, placement of A on the leading dims, partial inputs)`` in offering order:
    ColossalAI's families with A on one leading dim and no partial input, then every family
    with every placement and every choice of partial inputs, the replicated strategy last."""
    replicated = ((), (), ())
    for a, b, c in colossal:
        if (a, b, c) != replicated:
            for placement in _placements(a, lead, split=False):
                yield a, b, c, placement, {}
    for a, b, c in every_family(mesh_ndim):
        free = [x for x in range(mesh_ndim) if mesh_shape[x] > 1 and x not in a + b + c]
        for placement in _placements(a, lead, split=True):
            for picks in itertools.product(("", "input", "other"), repeat=len(free)):
                partial: dict[str, Axes] = {}
                for axis, role in zip(free, picks):
                    if role:
                        partial[role] = partial.get(role, ()) + (axis,)
                if (a, b, c) != replicated or partial:
                    yield a, b, c, placement, partial
    yield (), (), (), {}, {}


def every_family(mesh_ndim: int) -> list[tuple[Axes, Axes, Axes]]:
    """Every way to give each mesh axis to M, K, N or none, the axes of one dim in every order
    (``S01`` and ``S10``): ColossalAI's families first (:func:`logical_families`), in its order."""
    axes = range(mesh_ndim)
    found = list(logical_families(mesh_ndim))
    for slots in itertools.product(range(4), repeat=mesh_ndim):      # 0: M, 1: K, 2: N, 3: none
        groups = [[x for x in axes if slots[x] == s] for s in range(3)]
        found += [(a, b, c) for a, b, c in itertools.product(*(itertools.permutations(g) for g in groups))]
    return list(dict.fromkeys(found))


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


def _union(*groups: Axes) -> Axes:
    return tuple(sorted({x for g in groups for x in g}))
