"""Which aten op DTensor got wrong, and whether its rule or its runtime is to blame.

A call is often several aten ops under DTensor (einsum's views and bmm; a backward's
``select_backward``), so the rule of the op the user called is not necessarily the one at
fault. :class:`OpTrace` is a dispatch mode above DTensor that, after every aten op on DTensor
arguments, holds that op to the same op on the full values of its arguments: the first whose
DTensor result is not the op of its inputs is the culprit. Its own rule is then asked what it
decides for those placements, and the runtime watched for whether it applied it:

* the rule runs the placements locally (or redistributes) into a wrong result: *the forward
  rule* (or *the backward rule* for an op run by the backward) is wrong;
* the rule asks for a redistribution that the runtime never applied: *the runtime* is wrong.

Every output of an op with several (``nll_loss_forward``'s loss and total weight) is held to its
reference; outputs whose reduction has side effects (an embedding's ``MaskPartial``) are not read here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardverify.features.dtensor.placements import placements_text

__all__ = ["Step", "OpTrace", "backward_raise"]


@dataclass(frozen=True)
class Step:
    """One aten op DTensor ran, held to the op on its arguments' full values."""

    op: str
    phase: str                      # "forward" | "backward"
    inputs: str                     # the DTensor arguments' placements
    output: str
    error: float                    # max abs error of the DTensor result against the op of its inputs
    rule: str = ""                  # what the op's rule decides for these placements
    blame: str = ""                 # "forward rule" | "backward rule" | "runtime"

    @property
    def verdict(self) -> str:
        """Who is to blame, in a sentence."""
        if self.blame == "runtime":
            return f"the runtime is wrong: {self.op}'s rule asks for a redistribution the runtime never applies"
        return f"the {self.blame} is wrong: {self.op}'s rule gives a wrong result on these placements"

    def __str__(self) -> str:
        wrong = "of the wrong shape" if self.error == float("inf") else f"wrong by {self.error:.3g}"
        return (f"{self.blame} of {self.op} ({self.phase}): inputs {self.inputs} -> output {self.output}, "
                f"{wrong} against {self.op} of its inputs; {self.rule}")


_ATEN = re.compile(r"\b(aten\.[\w.]+)")


def backward_raise(node: str, detail: str) -> str:
    """Who is to blame when the backward raised in autograd's ``node`` (hooks.entered_nodes) with
    ``detail``: a backward function that hands DTensor a plain tensor it made itself (autograd's
    derivative formula: its zeros from the saved sizes, ``TypeAndSize::zeros``) is not a DTensor
    rule's fault; an aten op DTensor has no strategy for is a missing backward rule."""
    where = f"autograd's {node}" if node else "the backward"
    found = _ATEN.search(detail)
    op = found.group(1) if found else "an aten op"
    if "got mixed torch.Tensor and DTensor" in detail:
        return (f"runtime function {where} (backward): it passes {op} a plain torch.Tensor it made itself "
                "beside DTensors, which DTensor's dispatcher refuses; no DTensor sharding rule is involved")
    if "sharding strategy registered" in detail:
        return f"backward rule of {op} (backward): DTensor registers none; run by {where}"
    return f"raised in {where} (backward)"


def _rank0(value):
    return value._local_tensors[0] if hasattr(value, "_local_tensors") else value


def _full(value):
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return _rank0(value.full_tensor())
    if isinstance(value, (list, tuple)):
        return type(value)(_full(v) for v in value)
    return value


def _placements(args) -> str:
    from torch.distributed.tensor import DTensor

    return ", ".join(placements_text(a.placements) for a in args if isinstance(a, DTensor))


def _readable(value) -> bool:
    """An output whose full value can be read without side effects (not a MaskPartial)."""
    from torch.distributed.tensor import DTensor, Partial

    return isinstance(value, DTensor) and all(type(p) is Partial or not isinstance(p, Partial)
                                              for p in value.placements)


def _outputs(out) -> list:
    """(index, DTensor) for each readable output of an op: one, or each of a tuple's (nll_loss's
    loss and total weight), so a multi-output op is held to its reference too."""
    values = out if isinstance(out, (tuple, list)) else (out,)
    return [(i, v) for i, v in enumerate(values) if _readable(v)]


class OpTrace(TorchDispatchMode):
    """Enter above DTensor (inside LocalTensorMode) around the forward, then again around the
    backward with :attr:`phase` set; :attr:`culprit` is the first wrong :class:`Step`."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.culprit: Step | None = None
        self.redistributed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.culprit is None and not str(func).endswith("_.default") and _outputs(out):
            try:
                self._judge(func, args, kwargs, out)
            except Exception:  # noqa: BLE001 - an op that cannot be replayed on full values says nothing
                pass
        return out

    def _judge(self, func, args, kwargs, out) -> None:
        from shardverify.verify.tolerance import Tolerance, compare

        full_args, full_kwargs = _full(tuple(args)), _full(dict(kwargs))
        wants = func(*full_args, **full_kwargs)
        wants = wants if isinstance(wants, (tuple, list)) else (wants,)
        for index, got_d in _outputs(out):
            want = _rank0(wants[index]) if index < len(wants) else None
            if not isinstance(want, torch.Tensor) or not want.is_floating_point():
                continue
            got = _rank0(got_d.full_tensor())
            scale = max(float(want.abs().max()), 1.0) if want.numel() else 1.0
            found = compare(got, want, Tolerance(1e-7, 1e-7 * scale)) if got.shape == want.shape else None
            if found is not None and found.close:
                continue
            error = found.max_abs_err if found is not None else float("inf")
            rule, asks = _rule(func, args, kwargs)
            blame = "runtime" if asks and not self._redistributed_for(func) else f"{self.phase} rule"
            self.culprit = Step(str(func), self.phase, _placements(args), placements_text(got_d.placements), error,
                                rule, blame)
            return

    def _redistributed_for(self, func) -> bool:
        return any(event.startswith(f"{func}:") for event in self.redistributed)


def _rule(func, args, kwargs) -> tuple[str, bool]:
    """(what the op's rule decides, whether it asks for a redistribution first)."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    try:
        info = dispatcher.unwrap_to_op_info(func, args, kwargs)
        dispatcher.sharding_propagator.propagate(info)
    except Exception as exc:  # noqa: BLE001 - no rule, or it raises
        return f"its rule gives no answer ({type(exc).__name__})", False
    sharding = info.output_sharding
    spec = sharding.output_spec
    specs = spec if isinstance(spec, (tuple, list)) else (spec,)
    output = ", ".join(placements_text(s.placements) if s is not None else "None" for s in specs)
    if sharding.needs_redistribute and sharding.redistribute_schema is not None:
        wanted = [placements_text(s.placements) for s in sharding.redistribute_schema.args_spec]
        if wanted != [placements_text(s.placements) for s in info.schema.args_spec]:
            return f"its rule redistributes the inputs to {', '.join(wanted)} -> {output}", True
    return f"its rule runs these placements locally -> {output}", False
