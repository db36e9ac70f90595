"""The pointwise source (``pointwise: true``): every operand broadcast against the output.

With it: ``aligned: true`` (no broadcasting: every operand has the output's sizes outside the
whole dims, else the call is refused: gather's index and input; with ``whole_where_sizes_differ:
true`` such a dim is kept whole in every tensor instead: scatter's index and source smaller than
its input, which write into the first rows only), ``lacks_dims_param: dim`` with
``lacking_operands: [src]`` (those operands lack the output dims the parameter names, as
select_scatter's src lacks the selected dim: they align as holding those dims at size 1),
``shape_param: size`` (the output shape, which each rank passes as its local one: expand), and
``factory: true`` (the output's dims that no input holds are sharded too, each rank making its
own block: from its local shape with ``shape_param``, torch.full; or with ``range_params:
[start, end, step]`` from its own start and end, ``start + lo * step`` and ``start + hi * step``
for its block ``[lo, hi)`` of the one dim, torch.arange)."""

from __future__ import annotations

from dataclasses import dataclass

from shardverify.errors import InvalidArgument
from shardverify.strategies.rules import derive
from shardverify.strategies.rules.derive import normalize_dims
from shardverify.strategies.rules.notation import Equation
from shardverify.strategies.rules.sources.base import (
    OPERAND, PARAM, Derived, OptionError, RuleCall, Source, flag, names, opt, text, true)
from shardverify.strategies.rules.sources.registry import register_source

__all__ = ["Pointwise"]


@register_source
@dataclass(frozen=True)
class Pointwise(Source):
    key = "pointwise"
    pointwise: bool = opt("pointwise", true, True)
    aligned: bool = opt("aligned", flag, False)
    whole_where_differ: bool = opt("whole_where_sizes_differ", flag, False)
    lacks_dims_param: str = opt("lacks_dims_param", text, "", kind=PARAM, draw="dims")
    lacking: tuple[str, ...] = opt("lacking_operands", names, (), kind=OPERAND)
    shape_param: str = opt("shape_param", text, "", kind=PARAM, draw="shape")
    factory: bool = opt("factory", flag, False)
    range_params: tuple[str, ...] = opt("range_params", names, (), kind=PARAM)

    def check(self) -> None:
        if bool(self.lacks_dims_param) != bool(self.lacking):
            raise OptionError("rule options 'lacks_dims_param' (the dims) and 'lacking_operands' (the operands "
                              "without them) go together, with pointwise: true",
                              "lacks_dims_param" if self.lacks_dims_param else "lacking_operands")
        if self.range_params and len(self.range_params) != 3:
            raise OptionError(f"rule option 'range_params' names the start, end and step parameters, got "
                              f"{list(self.range_params)}", "range_params")
        if self.factory and not (self.shape_param or self.range_params):
            raise OptionError("rule option 'factory' (each rank makes its own block of the output) needs "
                              "shape_param (the parameter each rank passes its local output shape in) or "
                              "range_params (the start, end and step each rank passes for its block)", "factory")
        if self.whole_where_differ and not self.aligned:
            raise OptionError("rule option 'whole_where_sizes_differ' (keep whole a dim where an operand's size "
                              "differs from the output's) goes with aligned: true", "whole_where_sizes_differ")
        if self.range_params and not self.factory:
            raise OptionError("rule option 'range_params' (each rank's own start and end) needs factory: true",
                              "range_params")

    def equation(self, call: RuleCall, whole_at: tuple[int, ...]) -> Derived:
        eq, whole = self._aligned_by_broadcast(call)
        if self.aligned:
            out_rank = call.out_rank
            for i, term in enumerate(eq.inputs):
                offset = out_rank - len(term)
                strange = [j + offset for j, dim in enumerate(term) if dim != (f"d{j + offset}",)
                           and j + offset not in whole_at]
                if strange and self.whole_where_differ:   # the operand covers part of the dim: whole everywhere
                    whole |= {f"d{j}" for j in strange} & set(eq.letters)
                elif strange:
                    raise InvalidArgument(f"operand {i} of shape {list(call.inputs[i])} and the output of shape "
                                          f"{list(call.outputs[0])} differ in size at dim(s) {strange}, which the "
                                          f"spec does not keep whole: its rule holds only where the two are equal")
        return Derived(eq, frozenset(whole))

    def _aligned_by_broadcast(self, call: RuleCall) -> tuple[Equation, set[str]]:
        """Pointwise broadcasting; a ``lacking_operands`` operand is aligned as if it held the
        ``lacks_dims_param`` dims of the output at size 1, which its term then drops."""
        if not self.lacking:
            return derive.pointwise(call.inputs, call.outputs)
        rank = len(call.outputs[0])
        missing = normalize_dims(call.param(self.lacks_dims_param), rank, self.lacks_dims_param)
        missing = tuple(sorted(d for d in missing if d < rank))
        lacking = [bool(call.roles) and call.roles[i] in self.lacking for i in range(len(call.inputs))]
        widened = []
        for shape, lacks in zip(call.inputs, lacking):
            if lacks:
                if len(shape) + len(missing) != rank:
                    raise InvalidArgument(f"an operand of shape {list(shape)} lacking dim(s) {list(missing)} of an "
                                          f"output of shape {list(call.outputs[0])} should have "
                                          f"{rank - len(missing)} dim(s)")
                shape = list(shape)
                for d in missing:
                    shape.insert(d, 1)
            widened.append(tuple(shape))
        eq, whole = derive.pointwise(widened, call.outputs)
        terms = tuple(tuple(dim for j, dim in enumerate(term) if j not in missing) if lacks else term
                      for term, lacks in zip(eq.inputs, lacking))
        return Equation(terms, eq.outputs), whole
