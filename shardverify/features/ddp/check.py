"""The model check: DDP training on every rank equals single-device training, step by step.

`ddp_rank_check(comm, plan)` is the SPMD function (one call per rank, module level so the process
backend can import it). Each rank

1. trains the single-device *reference* on the whole global batch (identical on every rank:
   same seed, same data, no communication) and snapshots loss, gradients, parameters and
   buffers after every optimizer step;
2. builds the same model again from the same seed, wraps it in real
   `torch.nn.parallel.DistributedDataParallel` on the backend's process group for all mesh axes
   (gloo on CPU, NCCL on GPUs), trains it on its own shard of each global batch, and compares
   after every optimizer step.

Loss scaling. DDP averages gradients: it divides the all-reduced sum by a divisor D (the world
size W; under `join(divide_by_initial_world_size=False)` the number of ranks still training).
The single-device loss over the N samples of a global batch is `L = sum_i l_i / c` with c = 1 for a
sum loss and c = N * e for a mean loss (e loss elements per sample). Rank r backpropagates
`D / c * sum_{i in r} l_i`, so DDP's gradient `1/D * sum_r grad(D / c * sum_{i in r} l_i)` is
exactly `grad L`. For a mean loss over equal shards this is the plain local mean (D / (N e) =
1 / (n_r e)), i.e. the usual DDP code; a sum loss must be multiplied by W, which is the scaling a
user has to add. With `no_sync` accumulation the same holds per micro-batch and the sums of
micro-batch gradients agree, so the comparison happens after the synchronised micro-batch.
The compared "loss" is the rank's own shard loss (sum or mean over its samples, summed over
micro-batches) against the same rows of the reference's forward pass.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardverify.features.ddp.build import (build_model, build_optimizer, elements_per_sample, make_batch,
                                   per_sample_loss)
from shardverify.features.ddp.hooks import COMPRESSION_UNIT_ROUNDOFF, register_hook
from shardverify.features.ddp.plan import ModelPlan, shard_steps
from shardverify.features.ddp.report import ModelResult, model_mismatch, model_order
from shardverify.features.ddp.syncbn import convert_sync_batchnorm
from shardverify.errors import InvalidArgument
from shardverify.verify.report import Mismatch
from shardverify.verify.tolerance import Tolerance, compare

__all__ = ["ddp_rank_check", "verify_model", "plan_tolerance", "reference_trajectory", "Snapshot",
           "FLOAT32_RTOL", "FLOAT32_ATOL"]

FLOAT32_RTOL = 1e-5
FLOAT32_ATOL = 1e-6


def plan_tolerance(plan: ModelPlan, world: int) -> Tolerance:
    """The tolerance DDP is compared with the reference within; the plan's overrides win.

    Exact float32 arithmetic differs only by summation order (the all-reduce adds W partial
    gradients instead of one sum over the batch): a few ulps, so rtol 1e-5 / atol 1e-6.

    Compressing hooks round every gradient bucket to the wire format (fp16: 10 mantissa bits,
    unit roundoff u = 2**-11 ~ 4.9e-4; bf16: 7 bits, u = 2**-8 ~ 3.9e-3) before the all-reduce, and
    the W-term sum is carried out in that format, so each averaged gradient carries a relative error
    up to about (W + 1) * u *of the largest summand*, not of the (possibly cancelling) result; hence
    an absolute as well as a relative allowance. The error enters the parameters through the
    learning rate and feeds back into later gradients, so we allow 4x that per step:
    rtol = atol = 4 * (W + 1) * u * steps. For fp16 on 4 ranks over 2 steps that is ~0.02 (vs 1e-5
    for float32); a missing average (a factor W) or an unreduced bucket is still far outside it.

    It is not a dtype's default (``verify.tolerance.tolerance_for``): those bound one op's
    rounding, while this bounds W-way summation and compression carried through optimizer steps.
    """
    unit = COMPRESSION_UNIT_ROUNDOFF.get(plan.options.comm_hook)
    if unit is None:
        rtol, atol = FLOAT32_RTOL, FLOAT32_ATOL
    else:
        rtol = atol = 4.0 * (world + 1) * unit * plan.steps
    return Tolerance(plan.rtol if plan.rtol is not None else rtol,
                     plan.atol if plan.atol is not None else atol)


@dataclass(frozen=True)
class Snapshot:
    """The reference after one optimizer step: per-shard losses (None: shard not training)."""

    losses: tuple[float | None, ...]
    grads: tuple[tuple[str, torch.Tensor | None], ...]
    params: tuple[tuple[str, torch.Tensor], ...]
    buffers: tuple[tuple[str, torch.Tensor], ...]


def _shard_value(per_sample: torch.Tensor, elements: int, reduction: str) -> float:
    total = float(per_sample.double().sum())
    return total / (per_sample.numel() * elements) if reduction == "mean" else total


def _state(model: nn.Module) -> tuple[tuple, tuple, tuple]:
    grads = tuple((name, None if p.grad is None else p.grad.detach().cpu().clone())
                  for name, p in model.named_parameters())
    params = tuple((name, p.detach().cpu().clone()) for name, p in model.named_parameters())
    buffers = tuple((name, b.detach().cpu().clone()) for name, b in model.named_buffers())
    return grads, params, buffers


def reference_trajectory(plan: ModelPlan, world: int,
                         device: torch.device | str = "cpu") -> list[Snapshot]:
    """Single-device training on the global batch of the shards still training at each step.

    It runs on the same device as the DDP model, so both use the same kernels."""
    schedule = shard_steps(plan.steps, world, plan.options.join)
    shard = plan.batch // world
    torch.manual_seed(plan.seed)
    model = build_model(plan.model).to(device)
    optimizer = build_optimizer(plan.optimizer, model.parameters())
    snapshots = []
    for step in range(plan.steps):
        active = [r for r in range(world) if schedule[r] > step]
        rows = torch.cat([torch.arange(r * shard, (r + 1) * shard) for r in active]).to(device)
        losses: list[float | None] = [0.0 if r in active else None for r in range(world)]
        for micro in range(plan.options.accumulate):
            inputs, target = make_batch(plan, step, micro)
            output = model(inputs.to(device)[rows])
            per_sample = per_sample_loss(plan, output, None if target is None else target.to(device)[rows])
            elements = elements_per_sample(plan, output)
            divisor = per_sample.numel() * elements if plan.loss.reduction == "mean" else 1
            (per_sample.sum() / divisor).backward()
            for position, r in enumerate(active):
                part = per_sample.detach().cpu()[position * shard:(position + 1) * shard]
                losses[r] += _shard_value(part, elements, plan.loss.reduction)  # type: ignore[operator]
        optimizer.step()
        snapshots.append(Snapshot(tuple(losses), *_state(model)))
        optimizer.zero_grad(set_to_none=True)
    return snapshots


_DDP_PARAMETERS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters)


class _Comparer:
    """Compares values of one rank with the reference by verify's closeness rule
    (``verify.tolerance.compare``) and collects mismatches."""

    def __init__(self, rank: int, tol: Tolerance) -> None:
        self.rank, self.tol = rank, tol
        self.mismatches: list[Mismatch] = []
        self.compared = 0

    def _add(self, kind: str, step: int | None, quantity: str, name: str, **found) -> None:
        self.mismatches.append(model_mismatch(kind, step, self.rank, quantity, name, self.tol, **found))

    def tensor(self, step: int | None, quantity: str, name: str,
               actual: torch.Tensor | None, expected: torch.Tensor | None) -> None:
        self.compared += 1
        if actual is None or expected is None:
            if actual is not None or expected is not None:
                missing = "DDP" if actual is None else "the reference"
                self._add("values", step, quantity, name, detail=f"it is None on {missing} only")
            return
        actual = actual.detach().cpu().double()
        expected = expected.double()
        shape = tuple(actual.shape)
        if actual.shape != expected.shape:
            self._add("shape", step, quantity, name, actual_shape=shape, expected_shape=tuple(expected.shape),
                      detail=f"shape {shape} vs reference {tuple(expected.shape)}")
            return
        found = compare(actual, expected, self.tol)
        if not found.close:
            self._add("values", step, quantity, name, actual_shape=shape, expected_shape=shape,
                      max_abs_err=found.max_abs_err, max_rel_err=found.max_rel_err, detail=found.nonfinite)

    def loss(self, step: int, actual: float, expected: float) -> None:
        self.tensor(step, "loss", "", torch.tensor(actual, dtype=torch.float64),
                    torch.tensor(expected, dtype=torch.float64))


def _wrap(plan: ModelPlan, module: nn.Module, group: dist.ProcessGroup,
          device: torch.device) -> DistributedDataParallel:
    options = plan.options
    # torch 2.13 renamed broadcast_buffers (per-forward buffer sync) to forward_sync_buffers.
    buffer_sync = ("forward_sync_buffers" if "forward_sync_buffers" in _DDP_PARAMETERS
                   else "broadcast_buffers")
    ddp = DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" and device.index is not None else None,
        process_group=group,
        **{buffer_sync: options.broadcast_buffers},
        bucket_cap_mb=options.bucket_cap_mb,
        find_unused_parameters=options.find_unused_parameters,
        gradient_as_bucket_view=options.gradient_as_bucket_view,
        static_graph=options.static_graph,
    )
    register_hook(ddp, options.comm_hook, group)
    return ddp


@contextlib.contextmanager
def _exact_float32() -> Iterator[None]:
    """No TF32 on GPUs: it rounds matmul/conv inputs to 10 mantissa bits, differently for the
    global and the shard batch, which would swamp the float32 tolerance."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:   # cudnn's flags through its context manager: torch's test helpers (OpInfo) lock direct setting
        with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, allow_tf32=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def ddp_rank_check(comm, plan: ModelPlan) -> tuple[tuple[Mismatch, ...], int]:  # noqa: ANN001 - Communicator
    """Train `plan` under DDP on this rank and compare with the reference after every step.

    Returns (mismatches found on this rank, number of compared values)."""
    with _exact_float32():
        return _rank_check(comm, plan)


def _rank_check(comm, plan: ModelPlan) -> tuple[tuple[Mismatch, ...], int]:  # noqa: ANN001 - Communicator
    axes = tuple(range(len(comm.mesh.shape)))
    group = comm.process_group(axes)
    if group is None:
        raise InvalidArgument("model checks need real torch.distributed process groups (DDP); "
                              "run them on the process backend, not the simulated one")
    world, shard = dist.get_world_size(group), dist.get_rank(group)
    plan.check_world(world)
    device = comm.device
    options = plan.options
    reference = reference_trajectory(plan, world, device)
    schedule = shard_steps(plan.steps, world, options.join)
    size = plan.batch // world
    rows = slice(shard * size, (shard + 1) * size)

    torch.manual_seed(plan.seed)
    module = build_model(plan.model).to(device)
    if options.sync_batchnorm:
        module = convert_sync_batchnorm(module, group, device)
    ddp = _wrap(plan, module, group, device)
    optimizer = build_optimizer(plan.optimizer, ddp.parameters())
    comparer = _Comparer(comm.rank, plan_tolerance(plan, world))

    joining = (ddp.join(divide_by_initial_world_size=options.divide_by_initial_world_size)
               if options.join else contextlib.nullcontext())
    with joining:
        for step in range(schedule[shard]):
            active = sum(1 for count in schedule if count > step)
            divisor = active if options.join and not options.divide_by_initial_world_size else world
            loss = 0.0
            for micro in range(options.accumulate):
                inputs, target = make_batch(plan, step, micro)
                last = micro == options.accumulate - 1
                with contextlib.nullcontext() if last else ddp.no_sync():
                    output = ddp(inputs[rows].to(device))
                    local_target = None if target is None else target[rows].to(device)
                    per_sample = per_sample_loss(plan, output, local_target)
                    elements = elements_per_sample(plan, output)
                    scale = (divisor / (active * size * elements) if plan.loss.reduction == "mean"
                             else float(divisor))
                    (per_sample.sum() * scale).backward()
                loss += _shard_value(per_sample.detach().cpu(), elements, plan.loss.reduction)
            optimizer.step()
            _compare_step(comparer, step, reference[step], ddp.module, loss, shard)
            optimizer.zero_grad(set_to_none=True)
    if options.join:  # joined ranks were stale; join broadcast the last joiner's model to all
        final = reference[-1]
        _compare_states(comparer, None, ddp.module, final, grads=False)
    return tuple(comparer.mismatches), comparer.compared


def _compare_step(comparer: _Comparer, step: int, expected: Snapshot, module: nn.Module,
                  loss: float, shard: int) -> None:
    expected_loss = expected.losses[shard]
    assert expected_loss is not None, "the reference did not train this shard at this step"
    comparer.loss(step, loss, expected_loss)
    _compare_states(comparer, step, module, expected, grads=True)


def _compare_states(comparer: _Comparer, step: int | None, module: nn.Module, expected: Snapshot,
                    *, grads: bool) -> None:
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    if grads:
        for name, grad in expected.grads:
            comparer.tensor(step, "grad", name, params[name].grad, grad)
    for name, value in expected.params:
        comparer.tensor(step, "param", name, params[name], value)
    for name, value in expected.buffers:
        comparer.tensor(step, "buffer", name, buffers[name], value)


def dry_run(plan: ModelPlan) -> None:
    """Build the model and run one forward + loss on the declared shapes in this process, so a
    factory that fails or a shape mistake is one error naming the plan, not a traceback from
    every rank. (Reading the spec runs none of this: only checking it does.)"""
    where = f"{plan.model.where}: " if plan.model.where else ""
    try:
        torch.manual_seed(plan.seed)
        model = build_model(plan.model)
        inputs, target = make_batch(plan, 0, 0)
        per_sample_loss(plan, model(inputs), target).sum()
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}model {plan.name!r}: {exc}") from None
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise InvalidArgument(f"{where}model {plan.name!r} does not run on the declared data: {exc}") from None


def verify_model(backend, plan: ModelPlan, *, timeout: float | None = None) -> ModelResult:  # noqa: ANN001
    """Run the model check on every rank of `backend` and gather one result."""
    plan.check_world(backend.mesh.size)
    dry_run(plan)
    per_rank = backend.run(ddp_rank_check, plan, timeout=timeout)
    mismatches = tuple(sorted((m for found, _ in per_rank for m in found), key=model_order))
    compared = sum(count for _, count in per_rank)
    return ModelResult(plan, tuple(backend.mesh.shape), mismatches, compared)
