"""The reduction source (``reduce_dims_param: dim``): a reduction over the dims a call
parameter names (or several: ``[dim1, dim2]``, the dims each names), with ``keepdim_param``
and ``reduce_op`` (sum | avg | max | min | none: the reduced dims must stay whole). Output
dims after the kept ones (the diagonal torch.diagonal appends) hold factors of their own,
which only the output holds: whole."""

from __future__ import annotations

from dataclasses import dataclass

from shardverify.strategies.rules import derive
from shardverify.strategies.rules.derive import normalize_dims
from shardverify.strategies.rules.sources.base import (
    PARAM, Derived, RuleCall, Source, one_or_more, opt, read_op, text)
from shardverify.strategies.rules.sources.registry import register_source

__all__ = ["Reduction"]


@register_source
@dataclass(frozen=True)
class Reduction(Source):
    key = "reduce_dims_param"
    # one parameter, or several whose dims are all reduced
    reduce_dims_param: str | tuple[str, ...] = opt("reduce_dims_param", one_or_more, "", kind=PARAM, draw="dims")
    keepdim_param: str = opt("keepdim_param", text, "", kind=PARAM)
    reduce_op: str | None = opt("reduce_op", read_op, "sum")

    def equation(self, call: RuleCall, whole_at: tuple[int, ...]) -> Derived:
        shape = call.inputs[0]
        names = (self.reduce_dims_param,) if isinstance(self.reduce_dims_param, str) else self.reduce_dims_param
        dims = tuple(sorted({d for name in names for d in normalize_dims(call.param(name), len(shape), name)}))
        dims = tuple(d for d in dims if d < len(shape))     # a 0-d tensor's dim 0 reduces nothing
        keepdim = bool(call.param(self.keepdim_param)) if self.keepdim_param else False
        eq = derive.reduction(shape, [len(o) for o in call.outputs], dims, keepdim)
        if self.reduce_op is None:
            return Derived(eq, frozenset(f"d{d}" for d in dims))
        reduce = tuple((f"d{d}", self.reduce_op) for d in range(len(shape))
                       if all((f"d{d}",) not in term for term in eq.outputs))
        return Derived(eq, frozenset(), reduce)
