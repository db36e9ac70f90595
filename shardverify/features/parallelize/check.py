"""One check: the parallelized model against the single device, a verdict and its first culprit.

The verdicts: ``right``; ``silently wrong`` (in the forward, the gradients or only after the
optimizer steps: the first phase a value left its budget in); ``fails loudly`` (the parallelized
model raised, named with the module it was in); ``cannot apply`` (the plan itself did not apply:
transformers or PyTorch refused it, with their reason)."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from shardverify.errors import InvalidArgument
from shardverify.features.parallelize.blame import Culprit, blame
from shardverify.features.parallelize.compare import Finding, Margin, compare_values, dp_shares
from shardverify.features.parallelize.execute import LEARNING_RATE, Failure, RunOptions, Trace, run_parallel, run_single
from shardverify.features.parallelize.models import ModelSource
from shardverify.features.parallelize.names import resolve_model, resolve_plan
from shardverify.features.parallelize.plans import Plan, mesh_names
from shardverify.features.parallelize.processes import dp_splits

__all__ = ["ParallelizeResult", "check_parallelize", "VERDICTS"]

VERDICTS = ("right", "silently wrong", "fails loudly", "cannot apply")
#: the share of what AdamW's steps can move a weight (about ``lr`` an element a step) that a weight after
#: them may differ by: Adam divides each gradient by its own running size, so where a gradient is
#: rounding noise (the embedding rows of tokens a batch never holds) its update is decided by that
#: noise; a wrong gradient moves the weights by a whole step's size and more
STEP_SHARE = 0.05


@dataclass(frozen=True)
class ParallelizeResult:
    model: str
    plan: str
    mesh: tuple[int, ...]
    mode: str
    dtype: str
    steps: int
    verdict: str
    phase: str = ""                       # where a silent verdict first shows: forward / gradients / after steps
    findings: tuple[Finding, ...] = ()
    compared: int = 0                     # values compared (each on every rank)
    failure: Failure | None = None
    culprit: Culprit | None = None
    cpu_seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())
    margin: Margin | None = None          # the value closest to its budget
    unmatched: tuple[str, ...] = ()       # the plan's rules that name no module of the model
    @property
    def passed(self) -> bool:
        return self.verdict == "right"


def _dp_tp(shape: tuple[int, ...]) -> tuple[int, int]:
    return (1, shape[0]) if len(shape) == 1 else (shape[0], shape[1])


def _against(phase: str, what: str, values: list, truth, single, options: RunOptions, shape,
             margin: Margin, step: int = 0) -> list[Finding]:
    """``compare_values`` with each rank held to its data-parallel rows of the truth; a weight after
    ``step + 1`` AdamW steps may differ by :data:`STEP_SHARE` of what those steps can move it."""
    dp, tp = _dp_tp(shape)
    floor = STEP_SHARE * LEARNING_RATE * (step + 1) if phase == "weights" else 0.0
    if dp > 1 and truth is not None and truth.dim() == 0:
        # a value reduced over the batch (a model's own loss): each dp rank's is over its rows; their mean is the whole's
        values = [sum(values[d * tp + rank % tp].double() for d in range(dp)) / dp for rank in range(len(values))]
        dp = 1
    if dp == 1 or truth is None:
        return compare_values(phase, what, values, truth, single, options.dtype, tp, lambda rank: rank % tp, step,
                              margin, floor)
    found = []
    for rank, value in enumerate(values):
        shares = [(truth, single)] if value is None else \
            zip(dp_shares(truth, value, dp, rank // tp), dp_shares(single, value, dp, rank // tp))
        for share, share_single in shares:   # the first share it fits; else the last, the whole
            closest = Margin()
            mine = compare_values(phase, what, [value], share, share_single, options.dtype, tp, lambda _: rank % tp,
                                  step, closest, floor)
            if not mine:
                break
        margin.note(closest.what, closest.error, closest.budget, closest.single)
        found += [replace(f, rank=rank) for f in mine]
    return found


def _computed_otherwise(truth: Trace, single: Trace) -> set[str]:
    """Module values the float64 truth computes another way than the run's dtype (transformers' eager
    experts loop calls a module once per expert where the grouped GEMM calls it once): a module
    called a different number of times, or a value of another shape. They are not compared."""
    def calls(trace: Trace) -> Counter:
        return Counter(trace.owner.get(key, key) for key in trace.module_order)

    mine, theirs = calls(single), calls(truth)
    other = {module for module in mine | theirs if mine[module] != theirs[module]}
    return {key for key, owner in {**single.owner, **truth.owner}.items() if owner in other} | \
        {key for key in single.outputs if key in truth.outputs and
         tuple(single.outputs[key][0].shape) != tuple(truth.outputs[key][0].shape)}


def _routed(single: Trace) -> set[str]:
    """Module values of calls made once per expert on the tokens routed to it (a module called more
    than once in a forward, its calls' values of different shapes): a data-parallel rank routes its
    own rows, so its n-th call is another expert's, on other tokens, than the single device's n-th."""
    shapes: dict[str, set] = {}
    for key in single.module_order:
        value = single.outputs.get(key)
        shapes.setdefault(single.owner.get(key, key), set()).add(None if value is None else tuple(value[0].shape))
    routed = {module for module, seen in shapes.items() if len(seen) > 1}
    return {key for key, owner in single.owner.items() if owner in routed}


def _compare(truth: Trace, single: Trace, found: Trace, options: RunOptions, shape: tuple[int, ...],
             margin: Margin) -> tuple[list[Finding], int, int]:
    """Every value of ``found`` against the truth, the findings in the order the run made the values:
    the first forward's module inputs and outputs, then each step's loss, gradients (in the order the
    backward pass reaches their modules) and weights. A data-parallel rank is held to its rows of
    each activation; its loss (the mean over its rows) is averaged over the data-parallel ranks.
    Returns the findings, the values compared, the module values the truth computes otherwise, and
    the parameters the single device names otherwise (a tied weight listed under its other name)."""
    dp, tp = _dp_tp(shape)
    findings: list[Finding] = []
    compared = 0
    forward_phase = "inference" if options.mode == "inference" else "forward"
    differs = _computed_otherwise(truth, single) | (_routed(single) if dp > 1 else set())
    for key, values in found.outputs.items():
        if key in truth.outputs and key in single.outputs and key not in differs:
            compared += 1
            findings += _against(forward_phase, key, values, truth.outputs[key][0], single.outputs[key][0],
                                 options, shape, margin)
    first_seen, unnamed = {}, set()
    for position, key in enumerate(found.module_order):
        first_seen.setdefault(found.owner.get(key, key), position)

    def backward_order(name: str) -> int:
        module = name.rpartition(".")[0] or "(model)"
        return -first_seen.get(module, -1)

    for step, losses in enumerate(found.losses):
        compared += 1
        findings += _against("loss", "loss", losses, truth.losses[step][0], single.losses[step][0], options,
                             shape, margin, step)
        for kind, values in (("gradient", found.grads), ("weights", found.weights)):
            if step >= len(values):
                continue
            theirs = (truth.grads if kind == "gradient" else truth.weights)[step]
            single_runs = (single.grads if kind == "gradient" else single.weights)[step]
            for name in sorted(values[step], key=backward_order if kind == "gradient" else (lambda n: 0)):
                if name not in theirs or name not in single_runs:
                    unnamed.add(name)
                    continue
                compared += 1
                findings += _against(kind, name, values[step][name], theirs[name][0],
                                     single_runs[name][0], options, (1, tp), margin, step)
    return findings, compared, len(differs & set(found.outputs)), sorted(unnamed)


def _named(model: str, plan: str, seed: int, inputs, loss_parallel: bool):
    from shardverify.features.parallelize.processes import Named
    return Named(model, plan, seed, tuple(inputs), loss_parallel)


def _on_gloo(model: str, plan: str, seed: int, inputs, loss_parallel: bool, shape, options: RunOptions) -> Trace:
    from shardverify.features.parallelize.processes import run_on_processes
    return run_on_processes(_named(model, plan, seed, inputs, loss_parallel), shape, options)


def _phase(first: Finding) -> str:
    """Where a silent difference first shows: the first forward, its gradients, or only after steps."""
    if first.phase in ("forward", "inference") or (first.phase == "loss" and first.step == 0):
        return "forward"
    if first.phase == "gradient" and first.step == 0:
        return "gradients"
    return "after steps"


def check_parallelize(model: str | ModelSource, plan: str | Plan, mesh: tuple[int, ...] = (2,), *,
                      mode: str = "train", steps: int = 3, dtype: torch.dtype = torch.float32,
                      inputs=(), seed: int = 0, explain: bool = True, backend: str = "auto",
                      loss_parallel: bool = False) -> ParallelizeResult:
    """The parallelized ``model`` (a :class:`ModelSource`, ``hf:TYPE``, ``zoo:NAME`` or a factory's
    name) under ``plan`` (a :class:`Plan`, ``hf``, ``zoo:NAME`` or the name of a dict of
    ParallelStyles or of a ``parallelize(model, mesh)`` function) on ``mesh`` (``(tp,)`` or
    ``(dp, tp)``), against the single device: ``mode`` "train" (``steps`` AdamW steps) or "inference".
    ``backend``: "local" (every rank in this process), "gloo" (a process per rank: model and plan
    given by name) or "auto" (local for a 1-D mesh, gloo for a 2-D one, whose data-parallel axis
    takes FSDP2, which runs on real processes only)."""
    began = time.process_time()
    shape = tuple(int(s) for s in mesh)
    _check_run(shape, mode, steps)
    source = model if isinstance(model, ModelSource) else resolve_model(model, inputs, seed)
    the_plan = plan if isinstance(plan, Plan) else resolve_plan(plan, loss_parallel=loss_parallel)
    if backend not in ("auto", "local", "gloo"):
        raise InvalidArgument(f"backend {backend!r}: expected auto, local or gloo")
    auto = backend == "auto"
    if auto:
        backend = "local" if len(shape) == 1 else "gloo"
    if backend == "gloo" and not (isinstance(model, str) and isinstance(plan, str)):
        raise InvalidArgument("the gloo backend rebuilds the model and the plan in each process from their names: "
                              "give both as text (hf:TYPE, zoo:NAME, a dotted name)")
    options = RunOptions(mode, steps, dtype)
    notes = [f"built: {source.note}"] if source.note else []
    dp, tp = _dp_tp(shape)
    if source.heads and source.heads % tp:
        notes.append(f"{source.heads} attention heads do not divide over {tp} tensor-parallel ranks")
    unmatched = the_plan.unmatched(source.build()) if the_plan.unmatched is not None else ()
    if unmatched:
        notes.append(f"{len(unmatched)} plan rule(s) name no module of the model and apply to nothing: "
                     + ", ".join(unmatched[:6]) + (", ..." if len(unmatched) > 6 else ""))
    head = dict(model=source.name, plan=the_plan.name, mesh=shape, mode=mode, dtype=str(dtype).replace("torch.", ""),
                steps=steps if mode == "train" else 0, unmatched=unmatched)
    named = isinstance(model, str) and isinstance(plan, str)
    if backend == "gloo":
        found = _on_gloo(model, plan, seed, inputs, loss_parallel, shape, options)
        notes.append(f"ran on {math.prod(shape)} gloo processes")
        if dp > 1 and not dp_splits(source.batch(0), dp):
            notes.append(f"the batch does not split over {dp} data-parallel ranks (its inputs' leading dims differ, or "
                         f"{dp} does not divide them): every data-parallel rank takes the whole batch")
    else:
        found = run_parallel(source, the_plan, shape, options)
        if found.failure is not None and named and auto:
            # the in-process world cannot run everything a process group can (uneven blocks make
            # DTensor's sizes symbolic there): a failure is confirmed, or not, on real processes
            local = found.failure
            found = _on_gloo(model, plan, seed, inputs, loss_parallel, shape, options)
            backend = "gloo"
            notes.append(f"in process it raised in its {local.stage} ({local.error}); run again on "
                         f"{math.prod(shape)} gloo processes, which give the verdict")
    if found.failure is not None and found.failure.stage == "apply":
        return ParallelizeResult(**head, verdict="cannot apply", failure=found.failure,
                                 cpu_seconds=time.process_time() - began + found.cpu_seconds, notes=tuple(notes))
    single, truth = _single_device(source, options, head["dtype"], notes)
    margin = Margin()
    findings, compared, otherwise, unnamed = _compare(truth, single, found, options, shape, margin)
    notes += _not_compared(unnamed, otherwise, dp)
    culprit = None
    names = _named(model, plan, seed, inputs, loss_parallel) if backend == "gloo" else None
    if found.failure is not None:
        verdict, phase = "fails loudly", found.failure.stage
        culprit = blame(source, the_plan, shape, options, found, findings, truth, single, backend, names) \
            if explain else None
    elif findings:
        verdict, phase = "silently wrong", _phase(findings[0])
        culprit = blame(source, the_plan, shape, options, found, findings, truth, single, backend, names) \
            if explain else None
    else:
        verdict, phase = "right", ""
    return ParallelizeResult(**head, verdict=verdict, phase=phase, findings=tuple(findings), compared=compared,
                             failure=found.failure, culprit=culprit,
                             cpu_seconds=time.process_time() - began + found.cpu_seconds,
                             notes=tuple(notes), margin=margin)


def _check_run(shape: tuple[int, ...], mode: str, steps: int) -> None:
    """InvalidArgument naming a mesh, mode or step count no check can run."""
    mesh_names(shape)
    if math.prod(shape) < 2:
        raise InvalidArgument(f"mesh {shape}: a parallel plan needs at least 2 ranks")
    if mode not in ("train", "inference"):
        raise InvalidArgument(f"mode {mode!r}: expected 'train' or 'inference'")
    if steps < 1 or steps > 100:
        raise InvalidArgument(f"steps {steps}: expected 1 to 100")


def _single_device(source: ModelSource, options: RunOptions, dtype: str, notes: list[str]):
    """(the single device in the run's dtype, the reference: the single device in float64, or in the
    run's dtype where the model cannot run in float64), each such fallback said in ``notes``."""
    single = run_single(source, options)
    try:
        truth = run_single(source, options, torch.float64)
    except RuntimeError as exc:
        # a model that cannot run in float64 (a router kept in float32, a kernel without float64):
        # the single device in the run's dtype is the reference, each value held to its dtype's tolerance
        truth = single
        notes.append(f"the single device does not run in float64 ({str(exc).split(': ', 1)[-1][:160]}): the "
                     f"{dtype} single device is the reference and every value is held to {dtype}'s "
                     "default tolerance, not to its own rounding")
    if truth.dropouts:
        notes.append(f"{truth.dropouts} dropout module(s) set to p=0 on both sides (random masks cannot be compared)")
    return single, truth


def _not_compared(unnamed, otherwise: int, dp: int) -> list[str]:
    """The notes saying which parameters and module values were not compared, and why."""
    notes: list[str] = []
    if unnamed:
        notes.append(f"{len(unnamed)} parameter(s) of the parallelized model not compared: the single device has none "
                     "of that name (a tied weight listed under its other name): " + ", ".join(unnamed[:4])
                     + (", ..." if len(unnamed) > 4 else ""))
    if otherwise:
        notes.append(f"{otherwise} module values not compared: the float64 single device computes them another way "
                     "(transformers' eager experts loop where the run's dtype takes the grouped GEMM)"
                     + (", or a data-parallel rank routes its own rows to each expert" if dp > 1 else ""))
    return notes
