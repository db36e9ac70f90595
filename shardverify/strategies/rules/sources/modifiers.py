"""The keys every rule takes, whatever its source: output dims kept whole by a parameter,
operands added after the reduction or taking no gradient, the operands a partial value may
arrive in, and how strategies are named and ordered.

``whole_dims_param: dim``            output dims a parameter names stay whole (softmax, split, cat)
``whole_trailing_param: p``          the last len(p) dims stay whole (layer_norm's normalized_shape)
``whole_padded_param: pad``          a pad list, a (before, after) pair per dim from the last dim
                                     backward as F.pad takes it: each dim with a nonzero pair stays
                                     whole, the others pass their shard
``additive_operands: [bias]``        added once after a partial output is reduced
``constant_operands: [running_var]`` inputs the op takes no gradient for
``linear_in: [input, mat2]``         the operands the op is linear in: a name alone, or a group the
                                     op is linear in jointly (``[[input, other]]``: add in both
                                     terms), ``bias?`` for a member whose absence adds nothing;
                                     such inputs are also offered as partial sums over free mesh
                                     axes, the output then partial too
``monotone_in: [input]``             the op is nondecreasing in the operand, the others fixed, and
                                     each output element takes it elementwise or by a max/min: it
                                     is also offered as a partial max or min; ``-input`` for a
                                     nonincreasing op (a max turns into a min); ``input:max`` where
                                     only a max passes (amax)
``naming: colossalai``               ColossalAI's names and order (rules/colossal.py)
``follow: input``                    the operand whose producer's layouts are taken up (follow.py)
"""

from __future__ import annotations

from dataclasses import dataclass

from shardverify.errors import InvalidArgument
from shardverify.strategies.rules.derive import normalize_dims
from shardverify.strategies.rules.notation import ELLIPSIS, Equation
from shardverify.strategies.rules.sources.base import (
    GROUPS, MARKED, OPERAND, PARAM, OptionError, RuleCall, choice, names, opt, text)

__all__ = ["Modifiers", "padded_dims"]


def _linear_in(key: str, value: object) -> tuple[tuple[str, ...], ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise OptionError(f"rule option 'linear_in' must be a list of operand names or of groups "
                          f"(lists) of names, got {value!r}", key)
    for i, item in enumerate(value):
        if not (isinstance(item, str) or isinstance(item, (list, tuple)) and item and
                all(isinstance(v, str) for v in item)):
            raise OptionError(f"rule option 'linear_in': each item must be an operand name or a non-empty "
                              f"list of names, got {value!r}", key, (i,))
    return tuple((item,) if isinstance(item, str) else tuple(item) for item in value)


def _monotone_in(key: str, value: object) -> tuple[tuple[str, str, str], ...]:
    """``monotone_in`` items as (role, the partial op it may arrive as, the output's partial op)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise OptionError(f"rule option 'monotone_in' must be a list of operand names, got {value!r}", key)
    found = []
    for i, item in enumerate(value):
        role, _, only = item.partition(":")
        decreasing = role.startswith("-")
        role = role.removeprefix("-")
        if not role or only not in ("", "max", "min"):
            raise OptionError(f"rule option 'monotone_in': {item!r} is not `name`, `-name` (nonincreasing) or "
                              f"either with `:max` or `:min` (the only partial op that passes)", key, (i,))
        for op in (only,) if only else ("max", "min"):
            found.append((role, op, {"max": "min", "min": "max"}[op] if decreasing else op))
    return tuple(found)


def padded_dims(value: object, rank: int, name: str) -> tuple[int, ...]:
    """The dims a pad list pads: pair k ``(before, after)`` of ``value`` pads dim ``rank - 1 - k``
    (F.pad's order, last dim first); a ``(0, 0)`` pair leaves its dim as it is. A pad beyond the
    tensor's rank names no dim (torch refuses the call itself)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,) * 2      # nn.ReflectionPad1d(2): one int pads both sides of the last dim
    if not isinstance(value, (list, tuple)) or len(value) % 2 or \
            not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InvalidArgument(f"call parameter {name!r} must be a pad list of (before, after) int pairs, got {value!r}")
    return tuple(rank - 1 - k for k in range(len(value) // 2) if (value[2 * k], value[2 * k + 1]) != (0, 0)
                 and rank - 1 - k >= 0)


@dataclass(frozen=True)
class Modifiers:
    """The keys of any rule (see the module docstring)."""

    whole_dims_param: str = opt("whole_dims_param", text, "", kind=PARAM, draw="dims")
    whole_trailing_param: str = opt("whole_trailing_param", text, "", kind=PARAM, draw="shape")
    whole_padded_param: str = opt("whole_padded_param", text, "", kind=PARAM)
    additive: tuple[str, ...] = opt("additive_operands", names, (), kind=OPERAND)
    constant: tuple[str, ...] = opt("constant_operands", names, (), kind=OPERAND)
    linear_in: tuple[tuple[str, ...], ...] = opt("linear_in", _linear_in, (), kind=OPERAND, form=GROUPS)
    # (operand role, partial op it may arrive as, partial op the output then is): max/min only
    monotone_in: tuple[tuple[str, str, str], ...] = opt("monotone_in", _monotone_in, (), kind=OPERAND, form=MARKED)
    naming: str = opt("naming", choice("rules", "colossalai"), "rules")
    follow: str = opt("follow", text, "", kind=OPERAND)

    def check(self) -> None:
        linear = {role.rstrip("?") for group in self.linear_in for role in group}
        if linear & set(self.additive):
            raise OptionError(f"linear_in names additive operand(s) {sorted(linear & set(self.additive))}: they are "
                              f"added after a partial output is reduced, so they never reach the op as partial sums",
                              "linear_in")

    def whole_at(self, call: RuleCall) -> tuple[int, ...]:
        """The output dims the whole_* parameters keep whole in ``call``."""
        out_rank = call.out_rank
        positions: tuple[int, ...] = ()
        if self.whole_dims_param:
            positions = normalize_dims(call.param(self.whole_dims_param), out_rank, self.whole_dims_param)
        if self.whole_trailing_param:
            value = call.param(self.whole_trailing_param)
            count = 1 if isinstance(value, int) else len(value)  # type: ignore[arg-type]
            positions += tuple(range(out_rank - count, out_rank))
        if self.whole_padded_param:
            positions += padded_dims(call.param(self.whole_padded_param), out_rank, self.whole_padded_param)
        return tuple(p for p in positions if p < out_rank)   # a 0-d tensor's dim 0 (torch takes it) is no dim

    @staticmethod
    def whole_names(equation: Equation, positions: tuple[int, ...]) -> frozenset[str]:
        """The factors of the first output's dims at ``positions``."""
        if not positions:
            return frozenset()
        if any((ELLIPSIS,) == dim for dim in equation.outputs[0]):
            raise InvalidArgument("whole_dims_param/whole_trailing_param/whole_padded_param need an output term "
                                  "without '...'")
        names = [dim[0] if len(dim) == 1 else None for dim in equation.outputs[0]]
        return frozenset(n for p in positions if (n := names[p]) is not None)
