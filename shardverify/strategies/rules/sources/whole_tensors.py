"""The whole-tensors source (``whole_tensors: true``): every dim of every tensor holds a factor
of its own, never sharded, for an op that mixes positions across dims (masked_scatter takes
source's elements in the mask's order, as_strided reads storage): the replicated layout, and
the partial inputs that ``linear_in`` and ``monotone_in`` allow."""

from __future__ import annotations

from dataclasses import dataclass

from shardverify.strategies.rules import derive
from shardverify.strategies.rules.sources.base import Derived, RuleCall, Source, opt, true
from shardverify.strategies.rules.sources.registry import register_source

__all__ = ["WholeTensors"]


@register_source
@dataclass(frozen=True)
class WholeTensors(Source):
    key = "whole_tensors"
    whole_tensors: bool = opt("whole_tensors", true, True)

    def equation(self, call: RuleCall, whole_at: tuple[int, ...]) -> Derived:
        eq, whole = derive.whole_tensors(call.inputs, call.outputs)
        reduce = {f: None for term in eq.inputs for dim in term for f in dim}   # whole, never reduced
        return Derived(eq, frozenset(whole), tuple(reduce.items()))
