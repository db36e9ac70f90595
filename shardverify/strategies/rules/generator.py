"""The ``rules`` generator family: one engine that turns a declarative rule into every
strategy on any mesh.

It binds the spec's rule to the call's shapes (:mod:`shardverify.strategies.rules.rule`), gives each
mesh axis to at most one shardable factor (its axes in every order: ``S01`` and ``S10``, DTensor's
shard order), offers the operands of a ``linear_in`` group as partial sums over the axes left
free (and a ``monotone_in`` operand alone as a partial max or min), and derives each strategy's layouts and communication from the rule's semantics
alone. A size that does not divide is cut as DTensor cuts it (:mod:`shardverify.sharding.blocks`),
except where that would be wrong: a compound dim whose own cut differs from its factor's, a
partial avg over unequal blocks or a partial max/min with an empty block, and a layout whose
local call gives another shape on some rank or refuses an empty block (probed on the CPU). A
shape argument is each rank's own block's shape. Strategies are named
``<input layouts> -> <output layouts>`` with one ``S``/``R`` group per tensor dim
(``S0R x RS1 -> S0S1``), ``+P<axes>`` after a partial-sum input (``+Pmax<axes>`` a partial
max), plus ``| P<axes> <op>`` when
the output is reduced after the op.
The fully replicated strategy comes last.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Container
from dataclasses import dataclass

from shardverify.capture.uninitialised import undefined_outputs
from shardverify.errors import HandlerError, InvalidArgument, StrategyError
from shardverify.strategies.generators.common import (grad_sync, local_compute_cost, local_output_shapes, make_strategy,
                                                      memory_cost, op_call_shapes)
from shardverify.strategies.generators.registry import GeneratorContext, register_generator
from shardverify.strategies.handlers.base import Computed
from shardverify.strategies.rules import colossal, follow
from shardverify.strategies.rules.local_args import (range_arguments, serving_handler, shape_argument, shape_locator,
                                                     size_arguments)
from shardverify.strategies.rules.partial_inputs import extremum_choices, partial_choices
from shardverify.strategies.rules.narrowed import narrowed_choices
from shardverify.strategies.rules.rule import Rule, bind
from shardverify.strategies.rules.sources import RuleCall, RuleSpec, parse_rule
from shardverify.sharding.blocks import partial_refusal
from shardverify.sharding.partial import IndexShard, PartialInput, PostAdd
from shardverify.sharding.sharding_spec import ShardingSpec, dim_text, interned
from shardverify.sharding.strategy import (
    CommAction,
    CommPattern,
    CommWhere,
    MemoryCycle,
    OperandLocator,
    OperationData,
    OperationDataType,
    ShardingStrategy,
    TrainCycleItem,
)

__all__ = ["generate", "BoundRule", "bound_rule", "assignments"]


@dataclass(frozen=True)
class BoundRule:
    """The spec's rule bound to one call: the bound factors (``rule``), the parsed rule it came
    from with a variadic operand's role standing for its elements (``spec``), the input
    operands in term order, the outputs, the call as its source read it, and each integer
    operand's role with the factor its ids index."""

    rule: Rule
    spec: RuleSpec
    inputs: list[OperationData]
    outputs: list[OperationData]
    call: RuleCall
    indices: tuple[tuple[str, str], ...]


def bound_rule(ctx: GeneratorContext) -> BoundRule:
    """The rule the serving handler carries (parsed where its spec was read), bound to this call."""
    handler = serving_handler(ctx)
    elements = {d.role: tuple(r for r in ctx.operands if r.startswith(d.role + ".") and r[len(d.role) + 1:].isdigit())
                for d in handler.operands if d.variadic}
    declared = [r for d in handler.operands if d.kind != "output" for r in elements.get(d.role, (d.role,))]
    if not isinstance(handler.rule, RuleSpec):
        raise StrategyError(f"{ctx.handler_name}: generator family {handler.generator!r} runs the rules engine, so its "
                            f"handler needs the parsed rule (HandlerDef.rule: parse_rule of the spec's options)")
    spec = handler.rule.for_elements(elements)
    inputs = [ctx.operands[role] for role in declared if role in ctx.operands]
    outputs = [data for data in ctx.operands.values() if data.type is OperationDataType.OUTPUT]
    call = RuleCall(tuple(d.shape for d in inputs), tuple(d.shape for d in outputs), ctx.params,
                    tuple(role in ctx.operands for role in declared), tuple(d.role for d in inputs),
                    {name: value.nodes for name, value in ctx.params.items() if isinstance(value, Computed)})
    try:
        derived = spec.derive(call)
        additive = [i for i, d in enumerate(inputs) if d.role in spec.modifiers.additive]
        rule = bind(derived.equation, call.inputs, call.outputs, reduce=dict(derived.reduce),
                    whole=tuple(derived.whole), additive=additive, sizes=dict(derived.sizes),
                    default_op=spec.source.reduce_op, unheld_op=spec.source.reduce_unheld,
                    factory=spec.source.factory, names=[f"operand {d.role!r}" for d in inputs + outputs])
    except InvalidArgument as exc:
        spec_file = handler.where or f"the spec of {ctx.handler_name!r}"
        raise StrategyError(f"{ctx.handler_name} ({spec_file}): node {ctx.node.name!r}: {exc}; the rule does not "
                            f"describe this call, so no layout of it is offered (a spec whose rule covers this form "
                            f"of the call serves it: see {spec_file})") from None
    return BoundRule(rule, spec, inputs, outputs, call, spec.source.index_ids(declared))


def assignments(rule: Rule, mesh_shape: tuple[int, ...]) -> list[dict[str, tuple[int, ...]]]:
    """Every map factor -> mesh axes (each axis used once; a factor's axes in every order, the
    ascending one first: ``S01`` then ``S10``) that leaves every compound dim one contiguous
    block per rank, the block DTensor's cut of that dim gives, and a reduced factor's partial
    value reducible by its op (:func:`partial_refusal`); the empty map (replicated) last.
    The order is DTensor's shard order: the dim is cut over the first axis, then each block
    over the next, so ``S10`` puts other rows on each rank than ``S01``."""
    shardable = rule.shardable()
    sizes = rule.size
    reduce_ops = rule.partial_ops()
    found = []
    for choice in itertools.product(range(len(shardable) + 1), repeat=len(mesh_shape)):
        ascending: dict[str, tuple[int, ...]] = {}
        for axis, pick in enumerate(choice):
            if pick:
                ascending[shardable[pick - 1]] = ascending.get(shardable[pick - 1], ()) + (axis,)
        ways = {f: math.prod(mesh_shape[a] for a in ax) for f, ax in ascending.items()}
        if not rule.contiguous(ways):
            continue
        for orders in itertools.product(*(_orders(ax, mesh_shape) for ax in ascending.values())):
            axes = dict(zip(ascending, orders))
            if not rule.compound_blocks_agree(axes, mesh_shape):
                continue
            if any(partial_refusal(reduce_ops[f], sizes[f], [mesh_shape[a] for a in ax])
                   for f, ax in axes.items() if f in reduce_ops):
                continue
            found.append(axes)
    found.sort(key=lambda a: not a)      # stable: the replicated assignment last
    return found


def _orders(axes: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The orders of one factor's mesh axes, ascending first; axes of size 1 split nothing, so
    their place in the order changes no block and only the ascending one is kept."""
    if any(mesh_shape[a] == 1 for a in axes):
        return [axes]
    return list(itertools.permutations(axes))


def _layout(term, axes: dict[str, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """Tensor dim -> mesh axes: a compound dim takes its factors' axes in factor order."""
    layout = {}
    for d, dim in enumerate(term):
        if len(dim) == 1:        # most dims hold one factor: its axes as they are
            held = axes.get(dim[0])
            if held:
                layout[d] = tuple(held)
        elif dim:
            held = tuple(a for f in dim if f in axes for a in axes[f])
            if held:
                layout[d] = held
    return layout


def _seq(spec: ShardingSpec, partial: tuple[int, ...] = (), op: str = "sum", text: str | None = None) -> str:
    """``S0R``; ``RR+P1`` for a partial sum over mesh axis 1, ``RR+Pmax1`` for a partial max
    (``text``: the layout's own part, where the caller has it already)."""
    if text is None:
        text = _compact(spec)
    return text + (f"+P{'' if op == 'sum' else op}{''.join(map(str, partial))}" if partial else "")


def _compact(spec: ShardingSpec) -> str:
    """``S0R``: the layout's dims without brackets or commas; ``-`` for a 0-dim tensor."""
    partition = dict(spec.dim_partition)
    return "".join(dim_text(partition.get(d, ())) for d in range(len(spec.tensor_shape))) or "-"


def _positions(term, out_term) -> tuple[int, ...]:
    """Output dim of each dim of an additive operand: where its factor sits in the output (a
    conv's bias [O] lands on dim 1), a factorless size-1 dim aligned from the right."""
    where = {dim[0]: j for j, dim in enumerate(out_term) if dim}
    offset = len(out_term) - len(term)
    return tuple(where[dim[0]] if dim else i + offset for i, dim in enumerate(term))


@register_generator("rules", parse=parse_rule)
def generate(ctx: GeneratorContext) -> list[ShardingStrategy]:
    bound = bound_rule(ctx)
    rule, modifiers, inputs, outputs = bound.rule, bound.spec.modifiers, bound.inputs, bound.outputs
    if not outputs:
        raise HandlerError(f"{ctx.handler_name}: node {ctx.node.name!r} has no output operand")
    shape_at = shape_locator(ctx, bound.spec.source)
    try:
        shape_part = bound.spec.source.local_shape_part(bound.call) if shape_at else None
    except InvalidArgument as exc:
        raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r}: {exc}") from None
    if modifiers.naming == "colossalai" and not modifiers.follow:
        try:
            views = colossal.logical_views(rule, inputs, outputs)
        except StrategyError as exc:
            raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r}: {exc}") from None
        inputs, outputs = views[:len(inputs)], views[len(inputs):]
        call = _Call(ctx, bound, inputs, outputs, shape_at, shape_part)
        return colossal.offered(call.layouts,
                                lambda axes, partial, in_op, out_op: call.draft(axes, partial, (), in_op, out_op),
                                call.finish, rule, modifiers, inputs, outputs, ctx.mesh.shape)
    call = _Call(ctx, bound, inputs, outputs, shape_at, shape_part)
    if modifiers.follow:
        try:
            return follow.offered(lambda axes, partial, name: call.strategy(axes, partial, (), name=name), ctx,
                                  rule, modifiers, inputs, outputs)
        except StrategyError as exc:
            raise StrategyError(f"{ctx.handler_name}: node {ctx.node.name!r}: {exc}") from None
    results = call.results   # the outputs the call defines: an undefined one is no partial result
    handler = serving_handler(ctx)
    from shardverify.strategies.handlers.call_values import passes_nothing

    def left_out(role: str) -> bool:
        return passes_nothing(handler, ctx.node, ctx.graph_module, role)

    strategies: dict[str, ShardingStrategy] = {}
    # an additive or index operand is never narrowed to a prefix of a factor's axes (narrowed.py)
    fixed = set(rule.additive) | {i for i, d in enumerate(inputs) if d.role in dict(bound.indices)}
    for axes in assignments(rule, ctx.mesh.shape):
        for narrowed in [{}] + narrowed_choices(rule, [d.name for d in inputs], sorted(fixed), axes, ctx.mesh.shape):
            for partial in partial_choices(rule, modifiers, inputs, results, axes, ctx.mesh.shape, left_out):
                strategy = call.strategy(axes, partial, strategies, narrowed=narrowed)
                if strategy is not None:
                    strategies[strategy.name] = strategy
            for partial, in_op, out_op in extremum_choices(rule, modifiers, inputs, results, axes, ctx.mesh.shape):
                strategy = call.strategy(axes, partial, strategies, in_op, out_op, narrowed=narrowed)
                if strategy is not None:
                    strategies[strategy.name] = strategy
    # the replicated assignment's partial variants come after it: keep the replicated one last
    return sorted(strategies.values(), key=lambda s: not any(spec.dim_partition for _, spec in s.sharding_specs)
                  and not s.partial_inputs and not s.communication_actions)


class _Call:
    """One call's rule and operands, turned into a strategy per (assignment, partial inputs)."""

    def __init__(self, ctx: GeneratorContext, bound: BoundRule, inputs: list[OperationData],
                 outputs: list[OperationData], shape_at: OperandLocator | None, shape_part: slice | None) -> None:
        self.ctx, self.rule, self.spec, self.indices = ctx, bound.rule, bound.spec, bound.indices
        self.inputs, self.outputs = inputs, outputs
        self.shape_at, self.shape_part = shape_at, shape_part
        self.undefined = undefined_outputs(ctx.node)   # scratch the op leaves undefined: never reduced
        self.results = [o for k, o in enumerate(outputs) if k not in self.undefined]
        # no result carries a gradient (a comparison's bool): no input gets one, so none is synced
        self.carries_gradient = any(o.dtype.is_floating_point or o.dtype.is_complex for o in self.results)
        self._syncs: dict[tuple, tuple[CommAction, ...]] = {}    # (input, axes) -> its gradient's all-reduce
        self._layouts: dict[tuple, tuple[ShardingSpec, ...]] = {}   # assignment -> every operand's layout
        # what draft reads of the rule and the results on every call, worked out once
        self._reduce_ops = self.rule.partial_ops()
        self._reduced = dict(self.rule.reduce)
        self._additive = frozenset(self.rule.additive)
        self._held = [frozenset(f for dim in term for f in dim) for term in self.rule.inputs]
        self._held_out = [frozenset(f for dim in term for f in dim) for term in self.rule.outputs]
        self._all_floating = all(o.dtype.is_floating_point for o in self.results)
        self._all_summable = all(o.dtype.is_floating_point or o.dtype.is_complex for o in self.results)
        self._post_adds: dict[int, PostAdd] = {}     # additive input -> its post-add
        # per assignment (axes, narrowed inputs): the reduce ops of its sharded factors, what it
        # fixes for every partial-input variant, and its local arguments and fit
        self._axis_ops: dict[tuple, frozenset[str]] = {}
        self._fixed: dict[tuple, _Assignment] = {}
        self._fitted: dict[tuple, _Fitted] = {}
        self._reductions: dict[tuple, CommAction] = {}    # (output, axes, op) -> its all-reduce
        self._partials: dict[tuple, PartialInput] = {}    # (input, axes, op) -> its partial input
        self._texts: dict[ShardingSpec, str] = {}          # layout -> its part of a strategy's name
        self._merges: dict[tuple, tuple[int, ...]] = {}    # see _merged
        self._costs_of: dict[tuple, tuple[TrainCycleItem, MemoryCycle]] = {}   # local shapes and arguments -> costs

    def strategy(self, axes: dict[str, tuple[int, ...]], partial: dict[str, tuple[int, ...]],
                 taken: Container[str], in_op: str = "sum", out_op: str = "sum",
                 narrowed: dict[str, dict[str, tuple[int, ...]]] | None = None,
                 name: Callable[[dict, dict, tuple], str] | None = None) -> ShardingStrategy | None:
        """The strategy sharding each factor over ``axes`` with inputs ``partial`` (name ->
        mesh axes of their partial value, whose pieces reduce by ``in_op``; the output's by
        ``out_op``), and the ``narrowed`` inputs holding a factor over a prefix of its axes
        (narrowed.py); None where the layout does not fit the call or its name is ``taken``.
        ``name(specs, partial, actions)``: its name, where the caller names strategies its own
        way (by their layouts, else :meth:`_name`)."""
        draft = self.draft(axes, partial, taken, in_op, out_op, narrowed)
        if draft is None:
            return None
        return self.finish(draft, None if name is None else name(draft.specs, draft.partial, draft.actions))

    def layouts(self, axes: dict[str, tuple[int, ...]]) -> tuple[ShardingSpec, ...]:
        """Every operand's layout under ``axes``, in operand order (those of its strategies)."""
        key = tuple(axes.items())
        found = self._layouts.get(key)
        if found is None:
            found = self._layouts[key] = tuple(
                self._spec(data, _layout(term, axes))
                for data, term in zip(self.inputs + self.outputs, self.rule.inputs + self.rule.outputs))
        return found

    def _spec(self, data: OperationData, layout: dict[int, tuple[int, ...]]) -> ShardingSpec:
        """``ShardingSpec.from_partition(mesh, data.shape, layout)`` (its items are already the
        ``(int dim, axes tuple)`` pairs that function would make), one object per layout shared by
        every strategy and graph laying an operand out alike, so what a spec works out once (local
        shape, sequence) serves them all (:func:`~shardverify.sharding.sharding_spec.interned`)."""
        return interned(self.ctx.mesh.shape, data.shape, tuple(layout.items()))

    def draft(self, axes: dict[str, tuple[int, ...]], partial: dict[str, tuple[int, ...]],
              taken: Container[str], in_op: str = "sum", out_op: str = "sum",
              narrowed: dict[str, dict[str, tuple[int, ...]]] | None = None) -> _Draft | None:
        """:meth:`strategy` up to its name and costs: its layouts, actions and arguments, which
        tell a duplicate before anything is costed (None as for :meth:`strategy`). What the
        assignment alone decides is worked out once per assignment (:meth:`_assignment`); a partial
        input only adds axes to the gradients' and the output's all-reduces."""
        narrowed = narrowed or {}
        key = (tuple(axes.items()),
               tuple((n, tuple(f.items())) for n, f in sorted(narrowed.items())) if narrowed else ())
        ops = self._axis_ops.get(key[0])
        if ops is None:
            ops = self._axis_ops[key[0]] = frozenset(self._reduce_ops[f] for f in axes if f in self._reduce_ops)
        partial_ops = ops | {out_op} if partial else ops
        if len(partial_ops) > 1 or (partial_ops and not (self._all_floating or partial_ops == {"sum"} and
                                                         self._all_summable)):
            return None
        fixed = self._fixed.get(key)
        if fixed is None:
            fixed = self._fixed[key] = self._assignment(axes, narrowed)
        op = next(iter(partial_ops)) if partial_ops else "sum"
        if partial:
            pieces = tuple(sorted({a for held in partial.values() for a in held}))
            actions, per_output, partial_axes = self._with_pieces(fixed, partial, pieces)
        else:
            actions, per_output, partial_axes = list(fixed.syncs), fixed.per_output, fixed.partial_axes
        post_add: list[PostAdd] = []
        if partial_axes:
            actions += [self._reduction(k, held, op) for k, held in enumerate(per_output) if held]
            # an additive operand held as a piece is added by each rank
            post_add = [self._post_add(index) for index in self.rule.additive if self.inputs[index].name not in partial]
        specs = fixed.specs
        name = None
        if taken:   # a duplicate is told by its name, which the strategy then keeps
            name = self._name(specs, partial, in_op, per_output, op, partial_axes)
            if name in taken:
                return None
        fitted = self._fitted.get(key)
        if fitted is None:
            fitted = self._fitted[key] = self._local_fit(axes, narrowed, fixed, actions)
        if not fitted.fits:
            return None
        return _Draft(specs, tuple(actions), tuple(post_add), partial, in_op, per_output, op, partial_axes,
                      fitted.local_args, fitted.index_shards, name)

    def _assignment(self, axes: dict[str, tuple[int, ...]],
                    narrowed: dict[str, dict[str, tuple[int, ...]]]) -> _Assignment:
        """The layouts, gradient all-reduces and output partial axes of an assignment with no
        partial input (see :meth:`draft`)."""
        rule, inputs = self.rule, self.inputs
        operands = inputs + self.outputs
        if narrowed:
            specs = {data.name: self._spec(data, _layout(term, {**axes, **narrowed.get(data.name, {})}))
                     for data, term in zip(operands, rule.inputs + rule.outputs)}
        else:
            specs = dict(zip((data.name for data in operands), self.layouts(axes)))
        missing = []
        for index, data in enumerate(inputs):
            held = self._held[index]
            # an additive operand is added after the partial output is reduced: the reduced
            # factors' axes leave its gradient whole
            lacking = {a for f, ax in axes.items() if f not in held for a in ax
                       if not (index in self._additive and f in self._reduced)}
            # a narrowed factor's trailing axes: the ranks whose output block is empty give zeros
            trailing = {a for f, prefix in narrowed.get(data.name, {}).items() for a in axes[f][len(prefix):]}
            missing.append(tuple(sorted(lacking | trailing)))
        syncs = tuple(action for index, held in enumerate(missing) for action in self._sync(index, held))
        ops, held_out = self._reduce_ops, self._held_out   # rule.output_partial, its sets worked out once
        per_output = [() if k in self.undefined else
                      tuple(sorted({a for f, ax in axes.items() if f in ops and f not in held_out[k] for a in ax}))
                      for k in range(len(self.outputs))]
        partial_axes = tuple(sorted({a for held in per_output for a in held}))
        return _Assignment(specs, tuple(missing), syncs, per_output, partial_axes)

    def _with_pieces(self, fixed: _Assignment, partial: dict[str, tuple[int, ...]], pieces: tuple[int, ...]
                     ) -> tuple[list[CommAction], list[tuple[int, ...]], tuple[int, ...]]:
        """(gradient all-reduces, each output's partial axes, all of them) of the assignment with
        inputs ``partial``: a partial input's own axes leave its gradient whole (a partial
        value's gradient is whole on every rank), the other partial inputs' axes leave it
        partial, unless it is additive; every output is partial over every piece's axes."""
        actions: list[CommAction] = []
        for index, (data, missing) in enumerate(zip(self.inputs, fixed.missing)):
            if index not in self._additive:       # partial over the other groups' axes
                missing = self._merged(missing, pieces, partial.get(data.name, ()))
            actions += self._sync(index, missing)
        per_output = [() if k in self.undefined else self._merged(held, pieces)
                      for k, held in enumerate(fixed.per_output)]
        return actions, per_output, tuple(sorted({a for held in per_output for a in held}))

    def _merged(self, axes: tuple[int, ...], more: tuple[int, ...], less: tuple[int, ...] = ()) -> tuple[int, ...]:
        """``axes`` and those of ``more`` not in ``less``, sorted: the same few sets recur for
        every partial-input variant, so each is worked out once."""
        key = (axes, more, less)
        found = self._merges.get(key)
        if found is None:
            found = self._merges[key] = tuple(sorted(set(axes) | (set(more) - set(less))))
        return found

    def _sync(self, index: int, missing: tuple[int, ...]) -> tuple[CommAction, ...]:
        """Input ``index``'s gradient all-reduce over ``missing`` (none for a constant operand,
        or where no result carries a gradient)."""
        data = self.inputs[index]
        if data.role in self.spec.modifiers.constant or not self.carries_gradient:
            return ()
        synced = self._syncs.get((data.name, missing))
        if synced is None:
            synced = self._syncs[(data.name, missing)] = tuple(grad_sync(data, missing))
        return synced

    def _post_add(self, index: int) -> PostAdd:
        """Additive input ``index`` added after the output is reduced, its dims on the output's."""
        found = self._post_adds.get(index)
        if found is None:
            found = self._post_adds[index] = PostAdd(self.inputs[index].name,
                                                     _positions(self.rule.inputs[index], self.rule.outputs[0]))
        return found

    def _reduction(self, k: int, held: tuple[int, ...], op: str) -> CommAction:
        """Output ``k``'s all-reduce over ``held`` by ``op``, after the op (one object per kind)."""
        key = (k, held, op)
        found = self._reductions.get(key)
        if found is None:
            found = self._reductions[key] = CommAction(CommPattern.ALLREDUCE_FWD_IDENTITY_BWD, held,
                                                       self.outputs[k].name, CommWhere.AFTER, op=op)
        return found

    def _local_fit(self, axes: dict[str, tuple[int, ...]], narrowed: dict[str, dict[str, tuple[int, ...]]],
                   fixed: _Assignment, actions: list[CommAction]) -> _Fitted:
        """The local arguments and index shards of an assignment, and whether its layout fits the
        call: the same for each of its partial-input variants (they add only all-reduces, which
        change no local shape)."""
        ctx, rule, source, specs, outputs = self.ctx, self.rule, self.spec.source, fixed.specs, self.outputs
        uneven = not all(spec.is_even for spec in specs.values())
        local_args = (shape_argument(ctx, self.shape_at, specs[outputs[0].name], self.shape_part, uneven),) \
            if self.shape_at else ()
        if source.range_params:
            local_args += range_arguments(ctx, source.range_params, specs[outputs[0].name])
        sized = size_arguments(ctx, rule, source, axes)
        if sized is None:
            return _Fitted(False)   # the call relies on a size parameter's default: no place to pass a rank's own size
        local_args += sized
        index_shards = _index_shards(rule, self.indices, self.inputs, axes, ctx.handler_name)
        fits = True
        if source.probes_local_shapes or self.shape_at or source.range_params or sized or uneven or narrowed:
            fits = _local_view_fits(ctx, self.inputs + outputs, outputs, specs, actions, local_args,
                                    uneven or bool(narrowed))
        return _Fitted(fits, local_args, index_shards)

    def _name(self, specs: dict[str, ShardingSpec], partial: dict[str, tuple[int, ...]], in_op: str,
              per_output: list[tuple[int, ...]], op: str, partial_axes: tuple[int, ...]) -> str:
        """``S0R x RS1 -> S0S1``, ``+P<axes>`` after a partial input, ``| P<axes> <op>`` when the
        output is reduced after the op."""
        alike = len(set(per_output)) == 1      # else each output partial on its own axes says so: `R+P0`
        text = self._text
        name = (" x ".join(_seq(specs[d.name], partial.get(d.name, ()), in_op, text(specs[d.name]))
                           for d in self.inputs) + " -> " +
                ", ".join(_seq(specs[d.name], () if alike else held, op, text(specs[d.name]))
                          for d, held in zip(self.outputs, per_output))).lstrip()   # a factory's: "-> S0R"
        if partial_axes:
            name += f" | P{''.join(map(str, partial_axes))} {op}"
        return name

    def _text(self, spec: ShardingSpec) -> str:
        """:func:`_compact` of ``spec``, worked out once per layout (every strategy is named by it)."""
        found = self._texts.get(spec)
        if found is None:
            found = self._texts[spec] = _compact(spec)
        return found

    def _partial_input(self, name: str, axes: tuple[int, ...], op: str) -> PartialInput:
        """Input ``name`` held as a partial value over ``axes`` (one object per kind)."""
        key = (name, axes, op)
        found = self._partials.get(key)
        if found is None:
            found = self._partials[key] = PartialInput(name, axes, op)
        return found

    def _costs(self, draft: _Draft) -> tuple[TrainCycleItem, MemoryCycle]:
        """The compute and memory costs of the draft's layouts, worked out once per set of local
        shapes: both read nothing but the operands' local shapes at the call and the local
        arguments, and a call's every action is an all-reduce, which changes none. So an
        assignment's partial-input variants share them, and so do assignments splitting the same
        dims over other mesh axes of the same size."""
        operands = self.inputs + self.outputs
        key = (tuple(draft.specs[d.name].local_shape() for d in operands),
               tuple((a.locator.kind, a.locator.key, a.value) for a in draft.local_args))
        found = self._costs_of.get(key)
        if found is None:
            found = self._costs_of[key] = (
                local_compute_cost(self.ctx, operands, draft.specs, draft.actions, draft.local_args),
                memory_cost(operands, draft.specs))
        return found

    def finish(self, draft: _Draft, name: str | None = None) -> ShardingStrategy:
        """The strategy of ``draft``, named ``name`` (by its layouts if None), costs and all:
        compute by the checked rule, the op measured on meta tensors of the local shapes."""
        if name is None:
            name = draft.name or self._name(draft.specs, draft.partial, draft.in_op, draft.per_output, draft.op,
                                            draft.partial_axes)
        compute, memory = (None, None) if self.ctx.layouts_only else self._costs(draft)
        return make_strategy(self.ctx, name, self.inputs + self.outputs, draft.specs, draft.actions,
                             compute=compute, memory=memory, local_args=draft.local_args, post_add=draft.post_add,
                             index_shards=draft.index_shards,
                             partial_inputs=tuple(self._partial_input(n, a, draft.in_op)
                                                  for n, a in draft.partial.items()))


@dataclass(slots=True)
class _Draft:
    """One strategy of a call before its name and costs: its layouts (operand name -> spec),
    actions and local arguments, and what its name is made of."""

    specs: dict[str, ShardingSpec]
    actions: tuple[CommAction, ...]
    post_add: tuple[PostAdd, ...]
    partial: dict[str, tuple[int, ...]]      # partial input name -> mesh axes
    in_op: str
    per_output: list[tuple[int, ...]]        # each output's partial axes
    op: str                                  # how the partial output reduces
    partial_axes: tuple[int, ...]
    local_args: tuple = ()
    index_shards: tuple[IndexShard, ...] = ()
    name: str | None = None                  # its name by its layouts, where the duplicate check made it


@dataclass(slots=True)
class _Assignment:
    """What an assignment decides for every partial-input variant of it: each operand's layout,
    each input's gradient partial axes and their all-reduces, and each output's partial axes."""

    specs: dict[str, ShardingSpec]
    missing: tuple[tuple[int, ...], ...]     # per input: the mesh axes its gradient is partial over
    syncs: tuple[CommAction, ...]            # their all-reduces, in input order
    per_output: list[tuple[int, ...]]
    partial_axes: tuple[int, ...]


@dataclass(frozen=True)
class _Fitted:
    """Whether an assignment's layout fits the call, with the local arguments and index shards
    its strategies pass."""

    fits: bool
    local_args: tuple = ()
    index_shards: tuple[IndexShard, ...] = ()


def _index_shards(rule: Rule, indices: tuple[tuple[str, str], ...], inputs: list[OperationData],
                  axes: dict[str, tuple[int, ...]], handler: str) -> tuple[IndexShard, ...]:
    """For each ``indices`` operand whose factor this assignment shards: the operand holding
    that factor as a whole dim (the table), and where."""
    found = []
    roles = [d.role for d in inputs]
    for role, factor in indices:
        if factor not in axes or role not in roles:
            continue
        tables = [(data, d) for data, term in zip(inputs, rule.inputs) for d, dim in enumerate(term)
                  if dim == (factor,) and data.role != role]
        if len(tables) != 1:
            raise StrategyError(f"{handler}: indices: factor {factor!r} of operand {role!r} must be a whole dim "
                                f"of exactly one other operand, found {len(tables)}")
        table, dim = tables[0]
        found.append(IndexShard(inputs[roles.index(role)].name, table.name, dim, axes[factor]))
    return tuple(found)


def _local_view_fits(ctx: GeneratorContext, operands, outputs, specs, actions, local_args=(),
                     uneven: bool = False) -> bool:
    """A view op reads sizes from its local input (squeeze drops every size-1 dim) and from its
    shape argument (each rank's local output shape, ``local_args``): a layout is offered only
    when the op on meta tensors of the local input shapes gives the layout's local output shapes.
    With uneven blocks every rank's shapes are tried (a block of one element squeezes away, an
    empty one may make the op refuse, forward or backward, or give another dtype). Ranks alike
    in their local shapes and arguments make the same call: each such call is tried once."""
    tried: list[tuple] = []
    for rank in (ctx.mesh.ranks if uneven else (None,)):
        want = op_call_shapes(ctx.mesh, operands, specs, actions, rank=rank)
        alike = (tuple(want.values()), tuple(a.value if rank is None else a.value_on(rank) for a in local_args))
        if alike in tried:
            continue
        tried.append(alike)
        empty = rank is not None and any(0 in shape for shape in want.values())
        got = local_output_shapes(ctx, operands, specs, actions, local_args, rank=rank, probe=empty, dtypes=True)
        if got is None or tuple(got[:len(outputs)]) != tuple((want[o.name], o.dtype) for o in outputs):
            return False
    return True
