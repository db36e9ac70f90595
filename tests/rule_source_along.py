"""A rule source written as a newcomer would, for tests/test_rule_sources.py: one module, one
frozen dataclass. ``along_param: dim`` serves an op that works along the dim a parameter names
(softmax, cumsum): that dim stays whole, every other dim passes its shard to the output."""

from __future__ import annotations

from dataclasses import dataclass

from shardverify.strategies.rules.derive import normalize_dims
from shardverify.strategies.rules.notation import Equation
from shardverify.strategies.rules.sources import Derived, RuleCall, Source, opt
from shardverify.strategies.rules.sources.base import PARAM, text


@dataclass(frozen=True)
class AlongDim(Source):
    key = "along_param"
    along_param: str = opt("along_param", text, "", kind=PARAM, draw="dims")

    def equation(self, call: RuleCall, whole_at: tuple[int, ...]) -> Derived:
        (shape,), (out,) = call.inputs, call.outputs
        term = tuple((f"d{d}",) for d in range(len(shape)))
        (along,) = normalize_dims(call.param(self.along_param), len(shape), self.along_param)
        return Derived(Equation((term,), (term[:len(out)],)), frozenset({f"d{along}"}))
