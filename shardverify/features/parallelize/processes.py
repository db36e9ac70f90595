"""The parallelized model on real ``torch.distributed`` processes, one per rank (gloo on CPU, the
project's process pool), for what the in-process world cannot run (FSDP2's ``fully_shard``, whose
parameters are storages of their own) and as the ground truth of the in-process one. Each rank
builds the model from its name (what crosses to a process is text: the model and the plan as the
command line names them), applies the plan on the real mesh, trains on its data-parallel share of
every batch, and sends back its :class:`~shardverify.features.parallelize.execute.Trace` of one rank; the
ranks' traces are put together as the in-process world's is."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from shardverify.features.parallelize.execute import Failure, RunOptions, Trace, batches, run_steps, single_model
from shardverify.features.parallelize.models import Batch
from shardverify.features.parallelize.names import resolve_model, resolve_plan

__all__ = ["Named", "rank_program", "run_on_processes", "dp_share", "dp_splits", "rank_ops_program", "ops_on_processes"]


@dataclass(frozen=True)
class Named:
    """A model and a plan as text (what a process can rebuild them from)."""

    model: str
    plan: str
    seed: int = 0
    inputs: tuple = ()
    loss_parallel: bool = False


def dp_splits(batch: Batch, dp: int) -> bool:
    """Whether the batch splits over ``dp`` data-parallel ranks: every input (and the targets) a
    batch of one leading dim that ``dp`` divides. Inputs of other leading dims (a vision encoder's
    patches of every image packed, with one row per image beside them) cannot be split without
    knowing the model; every rank then takes the whole batch (said with the result)."""
    values = [v for v in (*batch.inputs.values(), batch.targets) if v is not None and v.dim() > 0]
    rows = {v.shape[0] for v in values}
    return dp > 1 and len(rows) == 1 and next(iter(rows)) % dp == 0


def dp_share(batch: Batch, dp: int, index: int) -> Batch:
    """This data-parallel rank's rows of every input (and target), or the whole batch where it does
    not split (:func:`dp_splits`)."""
    if not dp_splits(batch, dp):
        return batch

    def take(value: torch.Tensor | None):
        return value if value is None or value.dim() == 0 else torch.chunk(value, dp, 0)[index]

    return Batch({k: take(v) for k, v in batch.inputs.items()}, take(batch.targets))


def rank_program(comm, named: Named, shape: tuple[int, ...], options: RunOptions) -> Trace:
    """One rank's run (module level: the pool imports it by name)."""
    import logging
    import time

    import torch.distributed as dist

    began = time.process_time()

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)   # FSDP2 over TP's note
    rank = dist.get_rank()
    dp, tp = (1, shape[0]) if len(shape) == 1 else shape
    source = resolve_model(named.model, named.inputs, named.seed)
    plan = resolve_plan(named.plan, loss_parallel=named.loss_parallel)
    data = [dp_share(b, dp, rank // tp) for b in batches(source, options)]
    trace = Trace()
    model = single_model(source, options.dtype)
    try:
        model = plan.apply(model, tuple(shape)) or model
    except Exception as exc:  # noqa: BLE001 - a plan that cannot be applied is a verdict
        trace.failure = Failure("apply", "", f"{type(exc).__name__}: {str(exc).strip()[:300]}")
        trace.cpu_seconds = time.process_time() - began
        return trace
    if plan.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as loss_context
    else:
        loss_context = contextlib.nullcontext
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)    # FSDP2's and DTensor's advice, once per module and rank
        run_steps(model, source, options, trace, 1, loss_context, data)
    trace.cpu_seconds = time.process_time() - began
    return trace


def _merged(traces: list[Trace]) -> Trace:
    """The ranks' one-rank traces as one trace of every rank (values present on every rank only)."""
    first = traces[0]
    merged = Trace(module_order=list(first.module_order), owner=dict(first.owner),
                   dtensor_outputs=set(first.dtensor_outputs), grad_is_dtensor=dict(first.grad_is_dtensor),
                   parent=dict(first.parent))
    merged.failure = next((t.failure for t in traces if t.failure is not None), None)
    merged.cpu_seconds = sum(t.cpu_seconds for t in traces)
    for field in ("outputs", "arrivals"):
        mine = getattr(merged, field)
        for key in getattr(first, field):
            if all(key in getattr(t, field) for t in traces):
                mine[key] = [getattr(t, field)[key][0] for t in traces]
    steps = min(len(t.losses) for t in traces)
    merged.losses = [[t.losses[s][0] for t in traces] for s in range(steps)]
    for field in ("grads", "weights"):
        count = min(len(getattr(t, field)) for t in traces)
        setattr(merged, field, [{name: [getattr(t, field)[s][name][0] for t in traces]
                                 for name in getattr(first, field)[s]} for s in range(count)])
    return merged


def run_on_processes(named: Named, shape: tuple[int, ...], options: RunOptions, timeout: float = 300.0) -> Trace:
    """Every rank of ``shape`` as a gloo process of the project's pool."""
    from shardverify.backends.process import ProcessBackend
    from shardverify.sharding.mesh import DeviceMesh

    from shardverify.errors import BackendError

    try:
        with ProcessBackend(DeviceMesh(tuple(shape)), backend="gloo", timeout=timeout, keep_cpus=False) as backend:
            traces = backend.run(rank_program, named, tuple(shape), options)
    except BackendError as exc:   # a rank killed by its own collective (gloo aborts on a size mismatch), or hung
        trace = Trace()
        trace.failure = Failure("run", "", f"{type(exc).__name__}: {exc}")
        return trace
    return _merged(traces)


def rank_ops_program(comm, named: Named, shape: tuple[int, ...], options: RunOptions, module: str) -> tuple:
    """One rank's log of ``module``'s aten ops in one forward of the parallelized model. Every rank
    takes the whole first batch (its data-parallel share is not taken), so each rank's values are
    compared with the single device's as on a mesh of tensor parallelism only."""
    from shardverify.features.parallelize.ops import log_module_ops

    source = resolve_model(named.model, named.inputs, named.seed)
    plan = resolve_plan(named.plan, loss_parallel=named.loss_parallel)
    data = batches(source, options)[0]
    model = single_model(source, options.dtype)
    model = plan.apply(model, tuple(shape)) or model
    with warnings.catch_warnings(), (torch.no_grad() if options.mode == "inference" else contextlib.nullcontext()):
        warnings.simplefilter("ignore", UserWarning)
        return log_module_ops(model, module, lambda: model(**data.inputs), 1)


def ops_on_processes(named: Named, shape: tuple[int, ...], options: RunOptions, module: str,
                     timeout: float = 120.0) -> tuple[list, str]:
    """``module``'s aten ops as every rank of ``shape`` (a gloo process each) ran them, as the
    in-process world's log gives them: each call's values a list over the ranks."""
    from shardverify.backends.process import ProcessBackend
    from shardverify.sharding.mesh import DeviceMesh

    with ProcessBackend(DeviceMesh(tuple(shape)), backend="gloo", timeout=timeout, keep_cpus=False) as backend:
        logs = backend.run(rank_ops_program, named, tuple(shape), options, module)
    merged = []
    for calls in zip(*(calls for calls, _ in logs)):
        if len({call.key for call in calls}) != 1:   # the ranks ran different ops from here on
            break
        first = calls[0]
        first.inputs = [[values[0] for values in per] for per in zip(*(c.inputs for c in calls))]
        first.outputs = [[values[0] for values in per] for per in zip(*(c.outputs for c in calls))]
        if all(c.direct is not None for c in calls):
            first.direct = [[values[0] for values in per] for per in zip(*(c.direct for c in calls))]
        else:
            first.direct = None
        first.raised = next((c.raised for c in calls if c.raised), "")
        merged.append(first)
    return merged, next((error for _, error in logs if error), "")
