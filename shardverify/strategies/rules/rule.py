"""A rule bound to the shapes of one call: which factor each tensor dim holds, each factor's
size, and what sharding a factor means.

Semantics (one mechanism for every op; see specs/README.md):

* A factor sharded over mesh axes ``A`` shards every tensor dim that holds it.  A compound
  dim ``(a b)`` is sharded over the axes of its factors in order (``a`` over 0 and ``b`` over
  1: the dim over ``(0, 1)``), which is the same contiguous block only when every factor
  before the last sharded one is split into single elements: ``b`` may be sharded only if
  ``a`` is sharded as many ways as its size (``contiguous``).
* An operand without a sharded factor is replicated over its axes, so its gradient is a
  partial sum there: ``IDENTITY_FWD_ALLREDUCE_BWD`` before the op (a gradient hook for a
  parameter). That covers broadcasting (a size-1 dim holds no factor) and the weight of a
  data-parallel Linear alike.
* A factor that no output holds is *reduced*: sharding it leaves a partial output, reduced
  after the op by ``ALLREDUCE_FWD_IDENTITY_BWD`` with the factor's op (``sum`` for a
  contraction, ``avg`` for a mean, ``max``/``min``); a reduced factor whose op is ``None``
  (softmax's dim, an argmax) must stay whole.
* A factor only an output holds (a conv's output height) is whole: no input could be cut
  to produce one slice of it; unless the op is a factory (torch.full), which makes each rank's
  block from the rank's local shape.
* A factor some outputs hold and others lack is reduced only where ``reduce`` names it: the
  outputs lacking it are then partial over its axes (``unheld``; a backward op's weight
  gradient sums over the batch its input gradient keeps); otherwise they do not depend on it.
* Additive operands (a bias) are added once after a partial output is reduced (PostAdd).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardverify.errors import InvalidArgument
from shardverify.sharding.blocks import nested_block
from shardverify.strategies.rules.notation import ELLIPSIS, OPTIONAL, Dim, Equation, Term
from shardverify.sharding.strategy import REDUCE_OPS

__all__ = ["Rule", "bind"]


@dataclass(frozen=True)
class Rule:
    inputs: tuple[Term, ...]                  # per input operand, per tensor dim: factors (no ellipsis)
    outputs: tuple[Term, ...]
    sizes: tuple[tuple[str, int], ...]        # factor -> size
    reduce: tuple[tuple[str, str], ...]       # reduced factor -> op it combines with
    whole: frozenset[str]                     # factors that are never sharded
    additive: tuple[int, ...] = ()            # input indices added to the output (a bias)
    # factor some outputs hold -> the op the outputs lacking it reduce it by (a backward op's
    # weight gradient sums over the batch its input gradient keeps): those outputs are partial
    unheld: tuple[tuple[str, str], ...] = ()

    def partial_ops(self) -> dict[str, str]:
        """Every factor whose shard leaves some output partial, with the op that output reduces by."""
        return dict(self.reduce) | dict(self.unheld)

    def output_partial(self, axes: Mapping[str, tuple[int, ...]], index: int) -> tuple[int, ...]:
        """The mesh axes output ``index`` is a partial result over under ``axes``: those of the
        sharded factors no output holds, and of the ``unheld`` ones it lacks."""
        held = {f for dim in self.outputs[index] for f in dim}
        ops = self.partial_ops()
        return tuple(sorted(a for f, ax in axes.items() if f in ops and f not in held for a in ax))

    @property
    def size(self) -> dict[str, int]:
        return dict(self.sizes)

    def shardable(self) -> tuple[str, ...]:
        """Factors a strategy may shard, in order of first appearance."""
        sizes = self.size
        return tuple(name for name, _ in self.sizes if name not in self.whole and sizes[name] > 1)

    def compound_blocks_agree(self, axes: Mapping[str, tuple[int, ...]], mesh_shape: Sequence[int]) -> bool:
        """Whether every compound dim's blocks, cut as DTensor cuts the dim over its factors' axes
        in order, are the blocks its sharded factors give: always when those factors' sizes
        divide, and for an uneven cut only when the two agree on every rank (``(a b)`` of 8 x 2
        over 3 ranks: 6, 6, 4 rows either way; of 3 x 2 over 2 ranks: 4 + 2 rows by ``a``, 3 + 3
        by the flat dim). Assumes ``contiguous``."""
        sizes = self.size
        for term in self.inputs + self.outputs:
            for dim in term:
                sharded = [i for i, f in enumerate(dim) if axes.get(f)]
                if len(dim) < 2 or not sharded or all(
                        sizes[dim[i]] % math.prod(mesh_shape[a] for a in axes[dim[i]]) == 0 for i in sharded):
                    continue
                if not _flat_blocks_agree([sizes[f] for f in dim], [axes.get(f, ()) for f in dim], mesh_shape):
                    return False
        return True

    def contiguous(self, ways: Mapping[str, int]) -> bool:
        """Whether sharding each factor ``ways[f]`` ways (absent: 1) gives every compound dim a
        contiguous block per rank: each factor before the dim's last sharded one is sharded as
        many ways as its size, so it holds one element (``(a b)`` of 2 x 8 over 2 x 2 ranks: a
        whole a-index and 4 of b, rows 0-3, 4-7, 8-11, 12-15)."""
        sizes = self.size
        for term in self.inputs + self.outputs:
            for dim in term:
                sharded = [i for i, f in enumerate(dim) if ways.get(f, 1) > 1]
                if sharded and any(ways.get(f, 1) != sizes[f] for f in dim[:sharded[-1]]):
                    return False
        return True


def _flat_blocks_agree(sizes: Sequence[int], axes: Sequence[tuple[int, ...]], mesh_shape: Sequence[int]) -> bool:
    """Does cutting the flat dim of ``sizes`` (major first) over all ``axes`` in order give, on
    every mesh coordinate, the rows that cutting each factor over its own axes selects?"""
    flat_axes = [a for held in axes for a in held]
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    last = max(i for i, held in enumerate(axes) if held)
    for values in itertools.product(*(range(mesh_shape[a]) for a in flat_axes)):
        coord = dict(zip(flat_axes, values))
        start, length = nested_block(math.prod(sizes), [(mesh_shape[a], coord[a]) for a in flat_axes])
        blocks = [nested_block(size, [(mesh_shape[a], coord[a]) for a in held]) for size, held in zip(sizes, axes)]
        want_start = sum(b[0] * stride for b, stride in zip(blocks, strides))
        want_length = blocks[last][1] * strides[last]
        if length != want_length or (length and start != want_start):
            return False
    return True


def _factor_words(factor: str) -> str:
    """A factor as a spec author wrote it: ``'k'``, or for ``_b0`` a dim that ``...`` stands for."""
    return "dim, one that '...' stands for" if factor.startswith("_b") else f"dim {factor!r}"


def _expand(term: Term, rank: int, width: int, where: str) -> Term:
    """Replace ``...`` by ``width`` batch factors aligned from the right (``_b0`` ... )."""
    if (ELLIPSIS,) not in term:
        if len(term) != rank:
            raise InvalidArgument(f"{where} has {rank} dim(s); the rule describes it with {len(term)}, so it "
                                  f"does not cover a tensor of {rank} dim(s)")
        return term
    n = rank - (len(term) - 1)
    if n < 0:
        raise InvalidArgument(f"{where} has {rank} dim(s); the rule describes it with at least {len(term) - 1}, "
                              f"so it does not cover a tensor of {rank} dim(s)")
    at = term.index((ELLIPSIS,))
    batch = tuple((f"_b{i}",) for i in range(width - n, width))
    return term[:at] + batch + term[at + 1:]


def _optional_dims(equation: Equation, ranks: Sequence[int], out_ranks: Sequence[int] = ()) -> list[Term]:
    """Every term with its optional dims (``m?``) resolved: an input holds its optional dims,
    last to first (aligned from the right, as broadcasting aligns), as far as its tensor has dims
    beyond the required ones (before ``...`` takes any: ``m? n?`` of a ``[N]`` bias holds ``n``); an output holds an optional factor where an input does (a vector times a matrix gives
    a vector: ``... m? k, ... k n? -> ... m? n?``), and one that no input names (a conv's output
    depth ``od?``) as an input would: as far as its tensor has dims (``out_ranks``) beyond the others."""
    def plain(dim: Dim) -> Dim:
        return tuple(f.removesuffix(OPTIONAL) for f in dim)

    def optional(dim: Dim) -> bool:
        return len(dim) == 1 and dim[0].endswith(OPTIONAL)

    held: set[str] = set()
    resolved: list[Term] = []
    for term, rank in zip(equation.inputs, ranks):
        required = sum(1 for d in term if d != (ELLIPSIS,) and not optional(d))
        optionals = [i for i, d in enumerate(term) if optional(d)]
        held_here = set(optionals[len(optionals) - max(0, min(rank - required, len(optionals))):])
        kept = [plain(d) for i, d in enumerate(term) if not optional(d) or i in held_here]
        held |= {f for d in kept for f in d}
        resolved.append(tuple(kept))
    named = {plain(d)[0] for term in equation.inputs for d in term if d != (ELLIPSIS,) and d}
    for k, term in enumerate(equation.outputs):
        term = tuple(d for d in term if not optional(d) or plain(d)[0] in held or plain(d)[0] not in named)
        own = [i for i, d in enumerate(term) if optional(d)]      # optional factors no input names
        if own and k < len(out_ranks):
            required = sum(1 for d in term if d != (ELLIPSIS,) and not optional(d))
            own = own[len(own) - max(0, min(out_ranks[k] - required, len(own))):]
        resolved.append(tuple(plain(d) for i, d in enumerate(term) if not optional(d) or i in own))
    return resolved


def bind(equation: Equation, input_shapes: Sequence[Sequence[int]], output_shapes: Sequence[Sequence[int]], *,
         reduce: Mapping[str, str | None] | None = None, whole: Sequence[str] = (),
         additive: Sequence[int] = (), sizes: Mapping[str, int] | None = None, names: Sequence[str] = (),
         default_op: str | None = "sum", unheld_op: str | None = None, factory: bool = False) -> Rule:
    """Bind ``equation`` to the operands' shapes; InvalidArgument when they disagree.
    ``default_op``: how a factor no output holds combines where ``reduce`` does not name it;
    ``unheld_op``: how one some outputs hold does for the others (None: they do not depend on it);
    ``factory``: a factor only outputs hold may be sharded (each rank makes its own block of a
    factory's output from its local shape), else it stays whole.
    ``sizes``: factor sizes the shapes cannot tell (two unknown factors in one compound); ``names``:
    each operand's role (inputs, then outputs), for the errors."""
    if len(equation.inputs) != len(input_shapes):
        raise InvalidArgument(f"rule {equation} has {len(equation.inputs)} input term(s) for "
                              f"{len(input_shapes)} tensor operand(s)")
    if len(equation.outputs) != len(output_shapes):
        raise InvalidArgument(f"rule {equation} has {len(equation.outputs)} output term(s) for "
                              f"{len(output_shapes)} output(s)")
    terms = _optional_dims(equation, [len(s) for s in input_shapes], [len(s) for s in output_shapes])
    shapes = [tuple(s) for s in (*input_shapes, *output_shapes)]
    width = max([len(s) - (len(t) - 1) for t, s in zip(terms, shapes) if (ELLIPSIS,) in t] or [0])
    labels = list(names) or [f"input {i}" for i in range(len(input_shapes))] + \
        [f"output {i}" for i in range(len(output_shapes))]
    terms = [_expand(t, len(s), width, f"{label} of shape {list(s)} (rule {equation})")
             for t, s, label in zip(terms, shapes, labels)]

    sizes = _factor_sizes(equation, terms, shapes, labels, dict(sizes or {}))
    bound = _bound(equation, terms, shapes, labels, sizes)
    inputs, outputs = tuple(bound[:len(input_shapes)]), tuple(bound[len(input_shapes):])

    order = list(dict.fromkeys(f for term in bound for dim in term for f in dim))
    reduced, whole_set, unheld = _reductions(equation, inputs, outputs, order, width, reduce, whole, default_op,
                                             unheld_op, factory)
    in_outputs = {f for term in outputs for dim in term for f in dim}
    for index in additive:
        if not 0 <= index < len(inputs):
            raise InvalidArgument(f"rule {equation}: additive operand {index} is not an input")
        if any(f not in in_outputs for dim in inputs[index] for f in dim):
            raise InvalidArgument(f"rule {equation}: additive operand {index} holds a factor no output holds")
    return Rule(inputs, outputs, tuple((f, sizes[f]) for f in order), tuple(reduced), frozenset(whole_set),
                tuple(additive), tuple(unheld))


def _factor_sizes(equation: Equation, terms: list[Term], shapes: list[tuple[int, ...]], labels: list[str],
                  sizes: dict[str, int]) -> dict[str, int]:
    """Each factor's size: single-factor dims fix them (a dim of 1 broadcasts), then each compound
    dim infers at most one unknown factor; InvalidArgument where the shapes disagree."""
    ones = {dim[0] for term, shape in zip(terms, shapes) for dim, size in zip(term, shape) if len(dim) == 1 and size == 1}
    first: dict[str, tuple[str, int]] = {}     # factor -> (operand, dim) that fixed its size
    for term, shape, label in zip(terms, shapes, labels):   # single-factor dims fix sizes (1 broadcasts)
        for at, (dim, size) in enumerate(zip(term, shape)):
            if len(dim) == 1 and size != 1:
                if sizes.setdefault(dim[0], size) != size:
                    where = first.get(dim[0])
                    seen = f"dim {where[1]} of {where[0]}" if where else "the call's parameters"
                    raise InvalidArgument(f"dim {at} of {label} has size {size} and {seen} size {sizes[dim[0]]}, but "
                                          f"the rule {equation} gives both the same {_factor_words(dim[0])}: it "
                                          f"holds only where they are equal (shapes {[list(s) for s in shapes]})")
                first.setdefault(dim[0], (label, at))
    for term, shape, label in zip(terms, shapes, labels):   # compounds: infer at most one unknown factor
        for at, (dim, size) in enumerate(zip(term, shape)):
            if len(dim) < 2:
                continue
            unknown = [f for f in dim if f not in sizes]
            if len(unknown) > 1 and len([f for f in unknown if f not in ones]) <= 1:
                # seen only as dims of one element: of size 1 (native_group_norm's mean [N, 1] of one group)
                sizes.update({f: 1 for f in unknown if f in ones})
                unknown = [f for f in dim if f not in sizes]
            known = math.prod(sizes[f] for f in dim if f in sizes)
            if len(unknown) > 1 or (unknown and size % known) or (not unknown and known != size):
                raise InvalidArgument(f"dim {at} of {label} has size {size}, which the rule {equation} cannot "
                                      f"split as ({' '.join(dim)}) with the sizes the other dims give")
            if unknown:
                sizes[unknown[0]] = size // known
    return sizes


def _bound(equation: Equation, terms: list[Term], shapes: list[tuple[int, ...]], labels: list[str],
           sizes: dict[str, int]) -> list[Term]:
    """Each operand's term at its shape: a single-factor dim of size 1 where the factor is larger
    broadcasts and holds no factor."""
    bound: list[Term] = []
    for term, shape, label in zip(terms, shapes, labels):
        dims: list[Dim] = []
        for at, (dim, size) in enumerate(zip(term, shape)):
            if not dim:
                if size != 1:
                    raise InvalidArgument(f"dim {at} of {label} has size {size}, where the rule {equation} has a "
                                          f"dim of size 1")
            elif len(dim) == 1:
                sizes.setdefault(dim[0], 1)
                dim = () if size == 1 and sizes[dim[0]] != 1 else dim   # broadcast: holds no factor
            dims.append(dim)
        bound.append(tuple(dims))
    return bound


def _reductions(equation: Equation, inputs: tuple[Term, ...], outputs: tuple[Term, ...], order: list[str],
                width: int, reduce: Mapping[str, str | None] | None, whole: Sequence[str],
                default_op: str | None, unheld_op: str | None,
                factory: bool) -> tuple[list[tuple[str, str]], set[str], list[tuple[str, str]]]:
    """(reduced factors and their ops, factors kept whole, factors some outputs hold reduced for
    the others), as ``reduce`` and ``whole`` name them (see :func:`bind`)."""
    batch = [f"_b{i}" for i in range(width) if f"_b{i}" in order]
    if ELLIPSIS in whole:          # ``whole: [...]``: every batch factor the ellipsis became
        whole = [w for w in whole if w != ELLIPSIS] + batch
    in_inputs = {f for term in inputs for dim in term for f in dim}
    in_outputs = {f for term in outputs for dim in term for f in dim}
    every_output = set.intersection(*({f for dim in term for f in dim} for term in outputs)) if outputs else set()
    absent = {f.removesuffix(OPTIONAL) for term in equation.inputs + equation.outputs for dim in term for f in dim
              if f.endswith(OPTIONAL)} - set(order)     # optional dims this call's tensors lack
    reduce = {f: op for f, op in (reduce or {}).items() if f not in absent}
    whole = [w for w in whole if w not in absent]
    unknown = sorted(set(reduce) - set(order)) + sorted(set(whole) - set(order))
    if unknown:
        raise InvalidArgument(f"rule {equation}: reduce/whole name factor(s) {unknown} it does not have")
    unheld: list[tuple[str, str]] = []
    for name, op in reduce.items():
        if name in every_output:
            raise InvalidArgument(f"rule {equation}: factor {name!r} is in every output, so it is not reduced")
        if op is not None and op not in REDUCE_OPS:
            raise InvalidArgument(f"rule {equation}: reduce op {op!r} of {name!r} is not one of {REDUCE_OPS} or none")
    whole_set = set(whole) | (set() if factory else in_outputs - in_inputs)
    reduced: list[tuple[str, str]] = []
    for name in order:
        if name in in_outputs:     # held by some outputs, reduced for the others where `reduce` says so
            op = reduce[name] if name in reduce else unheld_op if name not in every_output else None
            if name in reduce and op is None:
                whole_set.add(name)
            elif op is not None:
                unheld.append((name, op))
            continue
        op = reduce.get(name, default_op)
        if op is None:
            whole_set.add(name)
        else:
            reduced.append((name, op))
    return reduced, whole_set, unheld
