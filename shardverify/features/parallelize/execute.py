"""The runs a check compares: the single-device model (in float64, the values' truth, and in the
training dtype, whose own rounding sets the budget) and the parallelized model on every rank of an
in-process world (DTensor's ``LocalTensorMode`` on a fake process group: each tensor holds every
rank's value, collectives combine them). Each run is a :class:`Trace`: every module's output of the
first forward in the order modules finished, each step's loss, every parameter's gradient and
every weight after each AdamW step; each value as every rank holds it (a DTensor gathered)."""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from shardverify.features.parallelize.models import Batch, ModelSource
from shardverify.features.parallelize.plans import Plan
from shardverify.features.parallelize.values import is_dtensor, per_rank, tensors_of

__all__ = ["Trace", "Failure", "RunOptions", "run_single", "run_parallel", "run_steps", "batches", "single_model",
           "prepared_parallel", "LEARNING_RATE", "EPSILON", "zero_dropout"]

#: AdamW's step size in a check: large enough that a wrong gradient moves the weights measurably
LEARNING_RATE = 1e-2
#: AdamW's epsilon in a check. Adam's first step is ``lr * g / (|g| + eps)``: with the usual 1e-8 an
#: element whose gradient is rounding noise (1e-9 on one side, -1e-9 on the other) moves by a whole
#: ``lr`` one way or the other, and a correct plan would differ by ``2 lr`` after one step. With
#: 1e-4 a gradient difference d moves a weight by at most ``lr * d / eps``: rounding stays rounding,
#: and a gradient wrong by its own size (1e-3 and up) still moves the weights by a visible fraction of lr.
EPSILON = 1e-4


@dataclass(frozen=True)
class RunOptions:
    mode: str = "train"                   # "train" (steps of AdamW) or "inference" (torch.no_grad forward)
    steps: int = 3
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class Failure:
    """The parallelized run raised: in applying the plan, or in a module during a step."""

    stage: str        # "apply" | "forward" | "loss" | "backward" | "step"
    module: str       # the innermost module running when it raised ("" outside any)
    error: str        # the exception's type and first line
    step: int = 0


@dataclass
class Trace:
    outputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)     # "module#call.label" -> per rank
    module_order: list[str] = field(default_factory=list)                     # modules as they finished
    losses: list[list[torch.Tensor]] = field(default_factory=list)            # per step, per rank
    grads: list[dict[str, list[torch.Tensor | None]]] = field(default_factory=list)
    weights: list[dict[str, list[torch.Tensor]]] = field(default_factory=list)
    arrivals: dict[str, list[torch.Tensor]] = field(default_factory=dict)      # module inputs before a style's hook
    owner: dict[str, str] = field(default_factory=dict)                        # output or input key -> its module
    dtensor_outputs: set[str] = field(default_factory=set)                     # keys whose value was a DTensor
    parent: dict[str, str] = field(default_factory=dict)                       # input key -> the module running it
    grad_is_dtensor: dict[str, bool] = field(default_factory=dict)
    failure: Failure | None = None
    dropouts: int = 0                                                          # dropout modules set to p=0
    cpu_seconds: float = 0.0                                                   # the rank processes' own, on gloo


def zero_dropout(model: nn.Module) -> int:
    """Dropout off in every module (p=0) so training runs compare; returns how many had p > 0."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p = 0.0
            count += 1
    return count


def _choice(args: tuple, kwargs: dict) -> str:
    """A call's text and flag arguments (``layer_type="sliding_attention"``), as part of its key: a
    module called once per choice in an order of no meaning (a loop over a ``set``, whose order
    follows each process's string hash seed) has each call paired with the same call elsewhere.
    Numbers are left out: a data-parallel rank passes its own batch size."""
    chosen = [repr(v) for v in args if isinstance(v, (str, bool))]
    chosen += [f"{k}={v!r}" for k, v in sorted(kwargs.items()) if isinstance(v, (str, bool))]
    return f"({', '.join(chosen)})" if chosen else ""


class _Recorder:
    """Forward hooks on every module: the output of each call (first forward only), per rank,
    and the stack of modules running (to name where an exception rose). A call is keyed by its
    module, its text and flag arguments (:func:`_choice`) and how many such calls came before."""

    def __init__(self, model: nn.Module, trace: Trace, world: int):
        self.trace, self.world, self.stack, self.on = trace, world, [], True
        self.calls: Counter = Counter()
        self.handles = []
        for name, module in model.named_modules():
            label = name or "(model)"
            self.handles.append(module.register_forward_pre_hook(self._arrive(label), prepend=True, with_kwargs=True))
            self.handles.append(module.register_forward_pre_hook(self._enter(label), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._leave(label), with_kwargs=True))

    def _arrive(self, label: str) -> Callable:
        """What reaches the module, before a plan's style prepares it (``"M arrives"``)."""
        def hook(module, args, kwargs):
            base = label + _choice(args, kwargs)
            if self.on and self.calls[base] == 0:
                for sub, tensor in tensors_of(args):
                    if tensor.is_floating_point() or tensor.is_complex():
                        self.trace.arrivals[f"{base} input{sub}"] = per_rank(tensor, self.world)
                        self.trace.parent[f"{base} input{sub}"] = self.stack[-1] if self.stack else ""
        return hook

    def _enter(self, label: str) -> Callable:
        def hook(module, args, kwargs):
            self.stack.append(label)
            base = label + _choice(args, kwargs)
            if self.on and self.calls[base] == 0:
                for sub, tensor in tensors_of(args):
                    if tensor.is_floating_point() or tensor.is_complex():
                        self.trace.outputs[f"{base} input{sub}"] = per_rank(tensor, self.world)
                        self.trace.owner[f"{base} input{sub}"] = label
        return hook

    def _leave(self, label: str) -> Callable:
        def hook(module, args, kwargs, output):
            if self.stack and self.stack[-1] == label:
                self.stack.pop()
            if not self.on:
                return
            base = label + _choice(args, kwargs)
            self.calls[base] += 1
            key = base if self.calls[base] == 1 else f"{base}#{self.calls[base]}"
            self.trace.module_order.append(key)
            self.trace.owner[key] = label
            for sub, tensor in tensors_of(output):
                if tensor.is_floating_point() or tensor.is_complex():
                    self.trace.outputs[key + sub] = per_rank(tensor, self.world)
                    self.trace.owner[key + sub] = label
                    if is_dtensor(tensor):
                        self.trace.dtensor_outputs.add(key + sub)
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def _snapshot(model: nn.Module, world: int, grads: bool) -> dict[str, list]:
    found = {}
    for name, param in model.named_parameters():
        value = param.grad if grads else param
        found[name] = per_rank(value, world) if value is not None else [None] * world
    return found


def batches(source: ModelSource, options: RunOptions) -> list[Batch]:
    """Every step's batch in the run's dtype, drawn before any world exists (its random functions
    are every rank's own)."""
    count = 1 if options.mode == "inference" else options.steps
    return [source.batch(step).cast(options.dtype) for step in range(count)]


#: the random state each forward starts from, on every side: a model that draws inside its forward
#: (DiffusionGemma's random canvas when no decoder input is given) draws the same on each
FORWARD_SEED = 1234


def run_steps(model: nn.Module, source: ModelSource, options: RunOptions, trace: Trace, world: int,
           loss_context: Callable[[], contextlib.AbstractContextManager], data: list[Batch]) -> None:
    """Run the steps on ``data``, filling ``trace``; an exception is caught as the trace's failure."""
    recorder = _Recorder(model, trace, world)
    stage, step = "forward", 0
    try:
        if options.mode == "inference":
            model.eval()
            with torch.no_grad():
                torch.manual_seed(FORWARD_SEED)
                model(**data[0].inputs)
            return
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, eps=EPSILON)
        for step in range(options.steps):
            batch = data[step]
            stage = "forward"
            torch.manual_seed(FORWARD_SEED + step)
            output = model(**batch.inputs)
            recorder.on = False
            stage = "loss"
            with loss_context():
                loss = source.loss(output, batch.targets)
                trace.losses.append(per_rank(loss, world))
                stage = "backward"
                loss.backward()
            trace.grads.append(_snapshot(model, world, grads=True))
            stage = "step"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            trace.weights.append(_snapshot(model, world, grads=False))
        trace.grad_is_dtensor = {name: is_dtensor(p) for name, p in model.named_parameters()}
    except Exception as exc:  # noqa: BLE001 - a plan that fails loudly is a verdict, said with where
        trace.failure = Failure(stage, recorder.stack[-1] if recorder.stack else "", _first_line(exc), step)
    finally:
        recorder.remove()


def single_model(source: ModelSource, dtype: torch.dtype, dropouts: list | None = None) -> nn.Module:
    """The single-device model in ``dtype``, dropout off. In float64 (the truth) a transformers
    model's experts run transformers' eager loop: its grouped-GEMM kernels take no float64, and the
    loop computes the same function."""
    model = source.build()
    zeroed = zero_dropout(model)
    if dropouts is not None:
        dropouts.append(zeroed)
    if dtype == torch.float64 and hasattr(model, "set_experts_implementation"):
        with contextlib.suppress(Exception):
            model.set_experts_implementation("eager")
    return model.to(dtype)


def run_single(source: ModelSource, options: RunOptions, dtype: torch.dtype | None = None) -> Trace:
    """The single-device model, in ``dtype`` (default: the options'), on the full batch."""
    run_dtype = dtype or options.dtype
    zeroed: list[int] = []
    model = single_model(source, run_dtype, zeroed)
    trace = Trace(dropouts=zeroed[0])
    run = RunOptions(options.mode, options.steps, run_dtype)
    run_steps(model, source, run, trace, 1, contextlib.nullcontext, batches(source, run))
    if trace.failure is not None:
        raise RuntimeError(f"the single-device model fails in its {trace.failure.stage} "
                           f"({trace.failure.module or 'model'}): {trace.failure.error}")
    return trace


@contextlib.contextmanager
def _world(shape: tuple[int, ...]) -> Iterator:
    from shardverify.features.dtensor.world import local_world
    import logging

    noisy = logging.getLogger("torch._subclasses.fake_tensor")   # logs every op a wrong plan makes raise
    level = noisy.level
    noisy.setLevel(logging.CRITICAL)
    try:
        with local_world(tuple(shape)) as (_, mode):
            yield mode
    finally:
        noisy.setLevel(level)


class PlanFailed(Exception):
    """The plan did not apply (the trace's failure says why)."""


@contextlib.contextmanager
def prepared_parallel(source: ModelSource, plan: Plan, shape: tuple[int, ...], options: RunOptions) -> Iterator:
    """Inside an in-process world of ``shape``'s size (its mode entered), the model with ``plan``
    applied and every weight a per-rank value; raises :class:`PlanFailed` from the plan's error."""
    model = single_model(source, options.dtype)
    with _world(shape) as mode, mode:
        try:
            model = plan.apply(model, tuple(shape)) or model
        except Exception as exc:  # noqa: BLE001 - a plan that cannot be applied is a verdict
            raise PlanFailed(_first_line(exc)) from exc
        _own_copies(model, mode)
        yield model


def run_parallel(source: ModelSource, plan: Plan, shape: tuple[int, ...], options: RunOptions) -> Trace:
    """The parallelized model on every rank of an in-process world of ``shape``'s size."""
    world = math.prod(shape)
    trace = Trace()
    data = batches(source, options)
    if plan.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as loss_context
    else:
        loss_context = contextlib.nullcontext
    try:
        with prepared_parallel(source, plan, shape, options) as model:
            run_steps(model, source, options, trace, world, loss_context, data)
    except PlanFailed as failed:
        trace.failure = Failure("apply", "", str(failed))
    return trace


def _own_copies(model: nn.Module, mode) -> None:
    """Every parameter and buffer a per-rank value: the in-process world runs an in-place op on a
    plain tensor once for every rank, so a replicated weight that is a plain tensor (a module the
    plan leaves alone, a DTensor's replicated local) would take every optimizer step once per rank."""
    from torch.distributed._local_tensor import LocalTensor

    def spread(tensor: torch.Tensor) -> torch.Tensor:
        return mode.rank_map(lambda rank: tensor.detach().clone())

    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if is_dtensor(param):
                if not isinstance(param._local_tensor, LocalTensor):
                    param._local_tensor = spread(param._local_tensor)
            elif not isinstance(param, LocalTensor):
                module._parameters[name] = nn.Parameter(spread(param), requires_grad=param.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and not is_dtensor(buffer) and not isinstance(buffer, LocalTensor):
                module._buffers[name] = spread(buffer)



