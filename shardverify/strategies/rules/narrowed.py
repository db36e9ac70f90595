"""Operands that hold a factor over a prefix of its mesh axes: a one-element block broadcast
against the finer cut's blocks.

A factor of size 4 sharded over the axes ``(1, 2, 0)`` of a (2, 2, 2) mesh is cut into one
element per rank over ``(1, 2)``; axis 0 then cuts each element into itself (coordinate 0) and
an empty block. An input that holds the factor over the prefix ``(1, 2)`` alone holds, on every
rank, either the same element as the finer cut or one element where the finer cut is empty;
torch broadcasts that element against the other operand's empty block, so every rank's output
is its block of the full cut (``input=[R, S12, R] other=[S120, R] -> [R, S120, R]``). The
narrowed operand is replicated over the trailing axes, so its gradient is a partial sum there
(the ranks whose output is empty give it zeros), as for any operand lacking a factor.

Offered where each block of the prefix cut holds at most one element, for a proper subset of
the inputs that hold the factor as a dim of its own (at least one keeps the full cut, which
sets the output's shape); the generator's probe of the local shapes drops any op that does not
broadcast such blocks (a contraction refuses ``[m, 1] @ [0, n]``), and the verifier and the
audit check each one like every other strategy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from shardverify.sharding.blocks import nested_block
from shardverify.strategies.rules.rule import Rule

__all__ = ["narrowed_choices", "single_elements"]

#: operand name -> factor -> the prefix of the factor's mesh axes the operand holds it over
Narrowed = dict[str, dict[str, tuple[int, ...]]]


def single_elements(size: int, axes: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """Whether cutting ``size`` over ``axes`` in order leaves every block at most one element."""
    return all(nested_block(size, list(zip((mesh_shape[a] for a in axes), coord)))[1] <= 1
               for coord in itertools.product(*(range(mesh_shape[a]) for a in axes)))


def narrowed_choices(rule: Rule, names: Sequence[str], skip: Sequence[int],
                     axes: dict[str, tuple[int, ...]], mesh_shape: Sequence[int]) -> list[Narrowed]:
    """For one assignment: every way to narrow some inputs' factors to a prefix of their axes
    whose blocks hold at most one element (see the module docstring), each factor's choices
    combined with the others'. ``names``: the inputs' names in rule order; ``skip``: input
    indices never narrowed (an additive operand, an index). The empty map (nothing narrowed) is
    not included."""
    per_factor = [[{}] + _factor_choices(rule, factor, held, skip, mesh_shape) for factor, held in axes.items()]
    found: list[Narrowed] = []
    for picks in itertools.product(*per_factor):
        merged: dict[int, dict[str, tuple[int, ...]]] = {}
        for pick in picks:
            for index, narrowed in pick.items():
                merged.setdefault(index, {}).update(narrowed)
        if merged:
            found.append({names[i]: narrowed for i, narrowed in sorted(merged.items())})
    return found


def _factor_choices(rule: Rule, factor: str, held: tuple[int, ...], skip: Sequence[int],
                    mesh_shape: Sequence[int]) -> list[dict[int, dict[str, tuple[int, ...]]]]:
    """Input index -> {factor: prefix} for each way to narrow ``factor`` (sharded over ``held``)
    on a proper subset of the inputs holding it as a dim of its own."""
    if len(held) < 2 or any(mesh_shape[a] < 2 for a in held) or \
            any(factor in dim and len(dim) > 1 for term in rule.inputs for dim in term):
        return []
    holders = [i for i, term in enumerate(rule.inputs) if (factor,) in term and i not in skip]
    found = []
    for length in range(1, len(held)):
        prefix = held[:length]
        if not single_elements(rule.size[factor], prefix, mesh_shape):
            continue
        for count in range(1, len(holders)):
            found += [{i: {factor: prefix} for i in chosen} for chosen in itertools.combinations(holders, count)]
    return found
