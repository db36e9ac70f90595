"""What DTensor's sharding rule decides for one aten call on given input placements (run
locally, or redistribute the inputs first, into which output placements), beside the execution:
the report can then say "the rule is right, the runtime wrong"."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardverify.features.dtensor.placements import placements_text

__all__ = ["RuleVerdict", "rule_verdict", "with_redistributed", "error_text"]


@dataclass(frozen=True)
class RuleVerdict:
    """What DTensor's sharding rule for the call's aten op says for these input placements."""

    op: str
    local: bool | None            # True: runs on the inputs as placed; False: redistributes first; None: no rule
    inputs: str = ""              # the input placements the rule asks for (when it redistributes)
    output: str = ""              # the output placements it propagates
    error: str = ""               # why the rule gives no answer
    redistributed: bool | None = None   # whether the runtime changed any input's placements

    def __str__(self) -> str:
        if self.local is None:
            return f"{self.op}: no rule ({self.error})"
        how = "runs locally" if self.local else f"redistributes inputs to {self.inputs}"
        text = f"{self.op}: rule {how} -> {self.output}"
        if not self.local and self.redistributed is False:
            text += "; the runtime did not redistribute"
        return text



def rule_verdict(aten, passed: dict, operands, values: dict, mode, answers: dict | None = None) -> RuleVerdict | None:
    """What DTensor's sharding rule says for the call's one aten op (None when the call is
    several aten ops, or one of its tensor arguments is not an operand itself)."""
    if aten is None:
        return None
    from torch.distributed.tensor import DTensor

    func, args, kwargs = aten
    missing = []

    def swap(value):
        if isinstance(value, torch.Tensor):
            position = passed.get(id(value))
            if position is None:
                missing.append(value)
                return value
            return values[operands[position].locator]
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        return value

    dargs, dkwargs = swap(args), {k: swap(v) for k, v in kwargs.items()}
    if missing:
        return None
    dispatcher = DTensor._op_dispatcher
    try:
        with mode:
            info = dispatcher.unwrap_to_op_info(func, dargs, dkwargs)
            dispatcher.sharding_propagator.propagate(info)
        if answers is not None:   # the forward's dispatch is handed this answer (hooks.reuse_propagation)
            answers[info.schema] = info.output_sharding
    except Exception as exc:  # noqa: BLE001 - no rule, or the rule raises
        return RuleVerdict(str(func), None, error=error_text(exc))
    sharding = info.output_sharding
    spec = sharding.output_spec
    specs = spec if isinstance(spec, (tuple, list)) else (spec,)
    output = ", ".join(placements_text(s.placements) if s is not None else "None" for s in specs)
    inputs = ""
    if sharding.needs_redistribute and sharding.redistribute_schema is not None:
        inputs = ", ".join(placements_text(s.placements) for s in sharding.redistribute_schema.args_spec)
        if inputs == ", ".join(placements_text(s.placements) for s in info.schema.args_spec):
            inputs = ""   # a view's arguments rewritten to local sizes: the placements are kept
    return RuleVerdict(str(func), not inputs, inputs, output)


def with_redistributed(rule: RuleVerdict | None, ops: list[str]) -> RuleVerdict | None:
    """``rule`` with whether the runtime redistributed (said only where the rule asks it to)."""
    if rule is None or rule.local is not False:
        return rule
    return RuleVerdict(rule.op, rule.local, rule.inputs, rule.output, rule.error, redistributed=bool(ops))


def error_text(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:200]}"
