"""Which inputs of a ``rules`` call may arrive as partial values, for one assignment of mesh
axes to factors: the ``linear_in`` groups as partial sums over the axes left free (the op is
multilinear in the groups), a ``monotone_in`` operand alone as a partial max or min."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from shardverify.sharding.strategy import OperationData
from shardverify.strategies.rules.rule import Rule
from shardverify.strategies.rules.sources.modifiers import Modifiers

__all__ = ["partial_choices", "extremum_choices"]


def partial_choices(rule: Rule, options: Modifiers, inputs: list[OperationData], outputs: list[OperationData],
                    axes: dict[str, tuple[int, ...]], mesh_shape: tuple[int, ...],
                    left_out: Callable[[str], bool]) -> list[dict[str, tuple[int, ...]]]:
    """For one assignment: no partial input (``{}``, first), then every way to give each mesh
    axis the assignment leaves free to one ``linear_in`` group or none; a group's operands are
    partial sums over its axes. The op is linear in each group with the others fixed, so it
    is multilinear in the groups: with pieces ``a_i`` over one axis and ``b_j`` over another,
    rank (i, j) computes ``f(a_i, b_j)`` and the sum over both axes is ``f(a, b)``. The output
    is a partial sum over every such axis: offered only where every output is floating point
    and the assignment's own partial output, if any, is a sum."""
    found: list[dict[str, tuple[int, ...]]] = [{}]
    reduce_ops = rule.partial_ops()
    if any(reduce_ops[f] != "sum" for f in axes if f in reduce_ops) or \
            any(not _summable(o.dtype) for o in outputs):
        return found
    used = {a for held in axes.values() for a in held}
    free = [a for a, size in enumerate(mesh_shape) if size > 1 and a not in used]
    by_role = {d.role: d for d in inputs}
    groups = [group for group in (_present(group, by_role, left_out) for group in options.linear_in) if group]
    for picks in itertools.product(range(len(groups) + 1), repeat=len(free)):
        partial: dict[str, tuple[int, ...]] = {}
        for g, group in enumerate(groups, start=1):
            held = tuple(a for a, pick in zip(free, picks) if pick == g)
            for role in group if held else ():
                partial[by_role[role].name] = partial.get(by_role[role].name, ()) + held
        if partial:
            found.append(partial)
    return found


def extremum_choices(rule: Rule, options: Modifiers, inputs: list[OperationData], outputs: list[OperationData],
                     axes: dict[str, tuple[int, ...]], mesh_shape: tuple[int, ...]
                     ) -> list[tuple[dict[str, tuple[int, ...]], str, str]]:
    """For one assignment: each ``monotone_in`` operand as a partial max or min over each set of
    mesh axes the assignment leaves free, one operand at a time (``max(a_i) + max(b_i)`` is no
    ``max(a_i + b_i)``), with the op the pieces reduce by and the one the output's do. Offered
    only where every output is floating point and the assignment's own partial output, if any,
    reduces by the output's op (amax over a sharded dim: max with max)."""
    if not options.monotone_in or any(not o.dtype.is_floating_point for o in outputs):
        return []
    reduce_ops = rule.partial_ops()
    used = {a for held in axes.values() for a in held}
    free = [a for a, size in enumerate(mesh_shape) if size > 1 and a not in used]
    by_role = {d.role: d for d in inputs}
    found = []
    for role, in_op, out_op in options.monotone_in:
        data = by_role.get(role)
        if data is None or not data.dtype.is_floating_point or \
                any(reduce_ops[f] != out_op for f in axes if f in reduce_ops):
            continue
        for size in range(1, len(free) + 1):
            found += [({data.name: held}, in_op, out_op) for held in itertools.combinations(free, size)]
    return found


def _summable(dtype) -> bool:
    """Can a value of ``dtype`` be a partial sum: real floating or complex (no max of complex numbers)."""
    return dtype.is_floating_point or dtype.is_complex


def _present(group: tuple[str, ...], by_role: dict[str, OperationData],
             left_out: Callable[[str], bool]) -> tuple[str, ...]:
    """The roles of a ``linear_in`` group this call passes as floating tensors, or ``()`` when
    the group does not hold for the call: a member is missing that is not marked ``?`` (a
    left-out weight of layer_norm means ones, so the op is affine in its bias), a ``?``
    member holds a number instead (``x + 2.0`` is affine in x), or one is an integer tensor."""
    found = []
    for member in group:
        role, may_go = member.rstrip("?"), member.endswith("?")
        if role in by_role:
            if not _summable(by_role[role].dtype):
                return ()
            found.append(role)
        elif not (may_go and left_out(role)):
            return ()
    return tuple(found)

