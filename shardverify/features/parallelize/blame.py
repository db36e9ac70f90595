"""The first culprit of a parallelized model that differs from the single device, and why.

The run's values come in order (each module's input as it arrives and as the plan's style prepares
it, its output, then each step's loss, gradients and weights), so the first one out of its budget
is where the difference enters. A module input is the plan's layouts at fault (what reaches the
module is not what the plan declares it to be: a replicated tensor taken as a shard). A module
output is looked into op by op: the module runs again on the single device and on every rank, its
aten ops paired by name and occurrence, and the first op whose result differs is the culprit;
that op re-run on the full values of its own inputs tells a DTensor rule or runtime that computes
wrong (the inputs were right) from right arithmetic on inputs that already differ (a weight or an
activation the plan laid out wrong), and a local op of a style's fast path from both. A gradient
whose ranks' parts sum to the single device's is a partial gradient nothing reduces."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from shardverify.features.parallelize.compare import Finding, budget, compare_values, reading

__all__ = ["Culprit", "blame", "known_dtensor_bug"]

CAUSES = {
    "plan layouts": "the plan's layouts do not fit together",
    "DTensor": "DTensor computes this op wrong",
    "plan style": "the style applying the plan hands on a wrong value",
    "partial gradient": "a partial gradient is never reduced",
    "raised": "the parallelized model raised",
    "inputs": "the op's inputs already differ",
    "loss": "the loss differs while every module output matches",
    "optimizer": "the optimizer step differs while the gradients match",
    "values": "its output differs from the single device's",
}


#: ops whose result over a dim depends on every element of it (computed on a block, they are another value)
_STATISTICS = ("mean", "std", "var", "sum", "amax", "amin", "norm", "softmax", "topk", "sort", "cumsum", "cumprod",
               "logsumexp", "max.dim", "min.dim", "median", "quantile")


@dataclass(frozen=True)
class Culprit:
    module: str
    what: str = ""          # the value that shows it (an output, an input, a parameter)
    op: str = ""            # the first aten op in the module that goes wrong (or raises)
    cause: str = ""         # a key of CAUSES
    detail: str = ""
    upstream: str = ""      # a known DTensor bug page (docs/upstream/NAME.md)

    def line(self) -> str:
        where = self.module + (f", {self.op}" if self.op else "")
        return f"{where}: {CAUSES.get(self.cause, self.cause)}" + (f" ({self.detail})" if self.detail else "") + \
            (f"; known DTensor bug: docs/upstream/{self.upstream}.md" if self.upstream else "")


def known_dtensor_bug(op: str) -> str:
    """The docs/upstream page (by name) whose op is ``op``, where this checkout has the pages."""
    folder = Path(__file__).resolve().parents[3] / "docs" / "upstream"
    stem = op.split(".")[1] if op.count(".") >= 1 else op
    if not folder.is_dir():
        return ""
    for page in sorted(folder.glob("*.md")):
        if page.stem.split("-")[0] == stem.split("_backward")[0] or page.stem.startswith(stem.replace("_", "-")):
            return page.stem
    return ""


def _describe(values: list[torch.Tensor], truth: torch.Tensor, single: torch.Tensor, dtype, tp: int) -> str:
    """How the ranks hold ``truth``: whole, a block on a dim, or neither."""
    read = reading(values, truth, single, dtype, tp, lambda rank: rank % tp, len(values) // tp)
    if read is not None:
        return f"as {read} of the single device's {list(truth.shape)}"
    shapes = sorted({tuple(v.shape) for v in values})
    return f"with shape {' / '.join(str(list(s)) for s in shapes)} and values no block of the single device's has"


def _mixed_culprit(found, failure) -> Culprit | None:
    """A plain tensor and a DTensor met in one op: the module that handed on the DTensor (the innermost
    of the last chain of modules whose outputs were DTensors)."""
    order = [key for key in found.outputs if key in found.dtensor_outputs]
    if not order:
        return None
    last = found.owner[order[-1]]
    keys = list(found.outputs)
    position = keys.index(order[-1])
    culprit = last
    while position > 0:
        position -= 1
        key = keys[position]
        module = found.owner.get(key, "")
        if key in found.dtensor_outputs and module.startswith(culprit + ".") and " input" not in key:
            culprit = module
        elif not module.startswith(last + ".") or " input" in key:
            break
    return Culprit(culprit, cause="plan style", op="", detail=(
        f"its output is a DTensor (use_local_output=False, or an output layout no later style takes), and "
        f"{failure.module or 'the model'} mixes it with plain tensors: {failure.error}"))


def _input_culprit(first: Finding, found, truth, single, tp: int, dtype) -> Culprit:
    module = found.owner.get(first.what, first.what)
    arrived = found.arrivals.get(first.what)
    prepared = found.outputs[first.what]
    want = truth.outputs[first.what][0]
    reading = "" if arrived is None else _describe(arrived, want, single.outputs[first.what][0], dtype, tp)
    detail = (f"its input reaches it {reading}, " if reading else "its input ") + \
        f"and the plan takes it as a tensor of global shape {list(prepared[0].shape)} where the single device has " \
        f"{list(want.shape)}: the layout the plan declares for this input is not the one the tensor has"
    return Culprit(module, first.what, cause="plan layouts", detail=detail)


def _gradient_culprit(first: Finding, found, truth, tp: int, dtype) -> Culprit:
    name = first.what
    module = name.rpartition(".")[0] or "(model)"
    per_rank = found.grads[first.step][name]
    want = truth.grads[first.step][name][0]
    if not found.grad_is_dtensor.get(name, True) and all(g is not None for g in per_rank) and len(per_rank) >= tp > 1:
        group = per_rank[:tp]
        if all(tuple(g.shape) == tuple(want.shape) for g in group):
            total = sum(g.double() for g in group)
            scale = float(want.abs().max()) if want.numel() else 0.0
            if float((total - want).abs().max()) <= budget(0.0, scale, dtype) * 4:
                return Culprit(module, name, cause="partial gradient", detail=(
                    f"each rank's gradient of {name} is its own part and the parts sum to the single device's: "
                    "the weight is a plain replicated tensor while the module runs on a shard of its input "
                    "(sequence or heads), and nothing sums the parts across the ranks (a SequenceParallel or "
                    "grad-all-reduce style on this module)"))
    return Culprit(module, name, cause="gradient", detail=f"the forward matches; {first.line()}")


def _fits(call, want, tp: int) -> bool:
    """Whether ``call``'s first output can be ``want``'s (each dim the same, or a rank's block of it
    over ``tp``): what tells two calls of one op apart when their order differs between the sides."""
    if not call.outputs or not want.outputs or not call.outputs[0] or not want.outputs[0]:
        return not call.outputs and not want.outputs
    mine, theirs = call.outputs[0][0].shape, want.outputs[0][0].shape
    return len(mine) == len(theirs) and all(a == b or a * tp == b or a == -(-b // tp) for a, b in zip(mine, theirs))


def _paired(parallel: list, reference: list, tp: int) -> dict[int, int]:
    """Each parallel call's place in the single device's calls: the next call of the same op whose
    output it can be (:func:`_fits`), in order. The parallelized model runs some of the model's ops
    inside the code applying the plan (transformers' MoE experts style), which the log leaves out,
    so the n-th call of an op on one side need not be the n-th on the other."""
    pairs, start = {}, {}
    for index, call in enumerate(parallel):
        if call.raised:
            continue
        position = start.get(call.name, 0)
        while position < len(reference) and not (reference[position].name == call.name
                                                 and _fits(call, reference[position], tp)):
            position += 1
        if position < len(reference):
            pairs[index] = position
            start[call.name] = position + 1
    return pairs


def _op_culprit(source, plan, shape, options, module: str, first: Finding, tp: int, named=None) -> Culprit:
    """The first aten op of ``module`` that goes wrong, looked for in process, or on gloo processes
    where ``named`` gives the model and plan by name; the module alone where neither can run."""
    try:
        return _first_wrong_op(source, plan, shape, options, module, first, tp, named)
    except Exception as exc:  # noqa: BLE001 - blame is a diagnosis: the verdict stands without it
        where = "in process" if named is None else "on gloo processes"
        return Culprit(module, first.what, cause="values", detail=(
            f"{first.line()}; its ops could not be looked into {where} ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''})"))


def _parallel_ops(source, plan, shape, options, module: str, data, named) -> tuple[list, str]:
    """``module``'s ops in one forward of the parallelized model on ``data``, each value a list over
    the ranks: in process, or (``named`` given) on a gloo process per rank, which draws the same
    first batch itself."""
    from shardverify.features.parallelize.execute import prepared_parallel
    from shardverify.features.parallelize.ops import log_module_ops

    if named is not None:
        from shardverify.features.parallelize.processes import ops_on_processes
        return ops_on_processes(named, shape, options, module)
    with prepared_parallel(source, plan, shape, options) as model:
        with (torch.no_grad() if options.mode == "inference" else contextlib.nullcontext()):
            return log_module_ops(model, module, lambda: model(**data.inputs), math.prod(shape))


def _first_wrong_op(source, plan, shape, options, module: str, first: Finding, tp: int, named=None) -> Culprit:
    from shardverify.features.parallelize.execute import batches, single_model
    from shardverify.features.parallelize.ops import log_module_ops

    data = batches(source, options)[0]
    logs = []
    for dtype in (torch.float64, options.dtype):
        model = single_model(source, dtype)
        batch = data.cast(dtype)
        with (torch.no_grad() if options.mode == "inference" else contextlib.nullcontext()):
            logs.append(log_module_ops(model, module, lambda m=model, b=batch: m(**b.inputs), 1)[0])
    if [call.name for call in logs[0]] != [call.name for call in logs[1]]:
        # the float64 truth runs the module as other ops (an MoE's eager experts loop where the run's
        # dtype takes the grouped GEMM): paired by occurrence they would meet the wrong calls, so the
        # single device in the run's dtype is the reference, each value held to that dtype's tolerance
        logs[0] = logs[1]
    parallel, error = _parallel_ops(source, plan, shape, options, module, data, named)
    pairs = _paired(parallel, logs[1], tp)
    index = (lambda rank: rank % tp)
    for position, call in enumerate(parallel):
        if call.raised:
            return Culprit(module, first.what, call.name, "raised", call.raised)
        if position not in pairs or not call.outputs or not logs[1][pairs[position]].outputs:
            continue
        want, mine = logs[0][pairs[position]], logs[1][pairs[position]]
        wrong = compare_values("forward", call.name, call.outputs[0], want.outputs[0][0], mine.outputs[0][0],
                               options.dtype, tp, index)
        if not wrong:
            continue
        if call.direct is not None:
            scale = float(want.outputs[0][0].abs().max()) if want.outputs[0][0].numel() else 0.0
            worst = max(float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
                        for a, b in zip(call.outputs[0], call.direct[0]) if a.shape == b.shape) \
                if all(a.shape == b.shape for a, b in zip(call.outputs[0], call.direct[0])) else math.inf
            if worst > budget(0.0, scale, options.dtype) * 8:
                page = known_dtensor_bug(call.name)
                return Culprit(module, first.what, call.name, "DTensor", (
                    f"DTensor's result differs from the same op on the full values of its own inputs by {worst:.3g} "
                    f"(values up to {scale:.3g}): a DTensor rule or runtime bug"), page)
        bad_inputs = []
        for position, values in enumerate(call.inputs):
            if position < len(want.inputs) and compare_values("forward", "", values, want.inputs[position][0],
                                                              mine.inputs[position][0] if position < len(mine.inputs)
                                                              else want.inputs[position][0], options.dtype, tp, index):
                bad_inputs.append(position)
        if bad_inputs:
            return Culprit(module, first.what, call.name, "plan layouts", (
                f"{call.name} computes right on what it gets, but its input {bad_inputs[0]} already differs from the "
                "single device's: a weight or an activation is laid out other than the plan's next step takes it"))
        reduces = any(word in call.name for word in _STATISTICS)
        return Culprit(module, first.what, call.name, "plan style", (
            f"its inputs match the single device's and {call.name} ran on this rank's local tensors; its result is "
            "no block of the single device's"
            + (": a statistic taken over a dim each rank holds only a block of (it needs the whole dim: gather "
               "it, or reduce the statistic across the ranks)" if reduces else "")))
    if error:
        return Culprit(module, first.what, "", "raised", error)
    return Culprit(module, first.what, "", "plan style", (
        "every aten op inside it matches the single device; the output the plan's style hands on does not "
        "(its output layouts or use_local_output)"))


def blame(source, plan, shape, options, found, findings: list[Finding], truth, single=None,
          backend: str = "local", named=None) -> Culprit:
    """The first culprit of a run that differs (``findings`` in the run's order) or raised; the aten
    op inside a module is looked for in process, or for a gloo run on gloo processes again when
    ``named`` (a :class:`~shardverify.features.parallelize.processes.Named`, given for a gloo run only)
    rebuilds model and plan there (without it, a gloo run's culprit stays at the module)."""
    in_process = backend == "local" or named is not None
    _, tp = (1, shape[0]) if len(shape) == 1 else shape
    first = findings[0] if findings else None
    if first is not None and first.phase in ("forward", "inference"):
        if first.what in found.arrivals:
            parent = found.parent.get(first.what, "")
            arrived_wrong = reading(found.arrivals[first.what], truth.outputs[first.what][0],
                                    (single or truth).outputs[first.what][0], options.dtype, tp,
                                    lambda rank: rank % tp, math.prod(shape) // tp) is None
            if arrived_wrong and parent and in_process:
                return _op_culprit(source, plan, shape, options, parent, first, tp, named)
            return _input_culprit(first, found, truth, single or truth, tp, options.dtype)
        module = found.owner.get(first.what, first.what)
        if not in_process:
            return Culprit(module, first.what, cause="values", detail=first.line())
        return _op_culprit(source, plan, shape, options, module, first, tp, named)
    if found.failure is not None:
        failing = found.failure.module or "(model)"
        if "mixed torch.Tensor and DTensor" in found.failure.error:
            mixed = _mixed_culprit(found, found.failure)
            if mixed is not None:
                return mixed
        if found.failure.stage == "forward" and found.failure.module and in_process:
            culprit = _op_culprit(source, plan, shape, options, failing,
                                  Finding("forward", failing, 0, "raised", math.inf, 0, 0, 0), tp, named)
            if culprit.op:
                return culprit
        return Culprit(failing, cause="raised", detail=f"{found.failure.stage}: {found.failure.error}")
    if first.phase == "gradient":
        return _gradient_culprit(first, found, truth, tp, options.dtype)
    if first.phase == "loss":
        return Culprit("loss", "loss", cause="loss", detail=first.line())
    return Culprit(first.what.rpartition(".")[0] or "(model)", first.what, cause="optimizer", detail=first.line())
