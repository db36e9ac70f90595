"""The advanced-index source (``advanced_index: true``): ``x[i0, i1]`` (``aten.index.Tensor``).
The first tensor operand is indexed, the others are the elements of the index list in order
(element k indexes dim k, an absent one is ``:``); each index's ids index its dim as
``indices`` says of an einsum rule (a shard of the dim masks the ids a rank does not hold)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardverify.strategies.declarations import OperandDecl
from shardverify.strategies.rules import derive
from shardverify.strategies.rules.sources.base import Derived, OptionError, RuleCall, Source, opt, true
from shardverify.strategies.rules.sources.registry import register_source

__all__ = ["AdvancedIndex"]


@register_source
@dataclass(frozen=True)
class AdvancedIndex(Source):
    key = "advanced_index"
    advanced_index: bool = opt("advanced_index", true, True)

    def equation(self, call: RuleCall, whole_at: tuple[int, ...]) -> Derived:
        at = [k for k, here in enumerate(call.present[1:]) if here]
        eq, whole = derive.advanced_index(call.inputs[0], list(zip(at, call.inputs[1:])), call.outputs[0])
        return Derived(eq, frozenset(whole))

    def index_ids(self, declared_roles: Sequence[str]) -> tuple[tuple[str, str], ...]:
        """Element k of the index list holds ids into dim k."""
        return tuple((role, derive.indexed_factor(k)) for k, role in enumerate(declared_roles[1:]))

    def check_operands(self, operands: Sequence[OperandDecl]) -> None:
        """The tensor operands are the indexed input, then the index list's elements in order."""
        tensors = [o for o in operands if o.kind != "output"]
        first, rest = tensors[0], tensors[1:]
        if first.element is not None or not rest or \
                any(o.element != k or o.index != rest[0].index for k, o in enumerate(rest)):
            raise OptionError("advanced_index needs the indexed input first, then the index tensors as elements "
                              "0, 1, ... of one list argument, in that order; declared: " +
                              ", ".join(f"{o.role} (index {o.index}, element {o.element})" for o in tensors),
                              "advanced_index")
