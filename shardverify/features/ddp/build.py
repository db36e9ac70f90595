"""Turn a `ModelPlan` into torch objects: the model, the seeded batches, the loss, the optimizer.

Every rank calls these with the same plan and gets bit-identical results (seeded, CPU-generated
data), which is what lets the single-device reference run on every rank without communication.
"""

from __future__ import annotations


import torch
from torch import nn

from shardverify.features.ddp.plan import LayerDecl, ModelDecl, ModelPlan, OptimizerDecl
from shardverify.errors import InvalidArgument
from shardverify.spec.names import resolve_dotted
from shardverify.spec.allow import call_factory, project_of
from shardverify.spec.trust import build_checked

__all__ = ["build_model", "make_batch", "per_sample_loss", "elements_per_sample",
           "build_optimizer"]


def _build_layer(layer: LayerDecl) -> nn.Module:
    cls = resolve_dotted(layer.target)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise InvalidArgument(f"layer target {layer.target!r} is not a torch.nn.Module class")
    try:
        return cls(*layer.args, **dict(layer.kwargs))
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"cannot build {layer.target}(*{layer.args!r}, **{dict(layer.kwargs)!r}): "
                              f"{exc}") from None


def build_model(decl: ModelDecl) -> nn.Module:
    """A fresh model; parameters come from the current torch RNG state (seed it first)."""
    if decl.factory is None:
        return build_checked(lambda: nn.Sequential(*(_build_layer(layer) for layer in decl.layers)),
                             "the model's layers")
    spec_file = decl.where.split(":")[0] if decl.where else None   # the project whose code may be called
    return call_factory(decl.factory, dict(decl.factory_kwargs), project_of(spec_file))


def make_batch(plan: ModelPlan, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The global (input, target) of one micro-batch, identical on every rank."""
    generator = torch.Generator().manual_seed(plan.seed * 1_000_003 + step * 1_009 + micro)
    inputs = torch.randn(plan.input_shape, generator=generator)
    if plan.target_shape is None:
        return inputs, None
    if plan.classes is not None:
        return inputs, torch.randint(0, plan.classes, plan.target_shape, generator=generator)
    return inputs, torch.randn(plan.target_shape, generator=generator)


def per_sample_loss(plan: ModelPlan, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """Unreduced loss summed over every dim but the batch dim: shape (batch,).

    Working per sample is what lets one formula serve the global reference and every shard."""
    name = plan.loss.name
    if name == "sum":
        elementwise = output
    elif name == "mse":
        if output.shape != target.shape:  # mse_loss would broadcast them with only a warning
            raise InvalidArgument(f"mse needs the model output shape {tuple(output.shape)} to equal "
                                  f"the target shape {tuple(target.shape)}")
        elementwise = nn.functional.mse_loss(output, target, reduction="none")
    else:
        elementwise = nn.functional.cross_entropy(output, target, reduction="none")
    return elementwise.reshape(elementwise.shape[0], -1).sum(dim=1)


def elements_per_sample(plan: ModelPlan, output: torch.Tensor) -> int:
    """How many loss elements one sample contributes (the divisor of a torch "mean" loss)."""
    if plan.loss.name == "cross_entropy":
        return 1 if plan.target_shape is None else max(1, int(torch.Size(plan.target_shape[1:]).numel()))
    return int(output[0].numel())


def build_optimizer(decl: OptimizerDecl, params) -> torch.optim.Optimizer:  # noqa: ANN001 - iterable
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[decl.name]
    settings = {key: (tuple(value) if isinstance(value, list) else value) for key, value in decl.settings}
    try:
        return cls(params, **settings)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"cannot build optimizer {decl.name} with {settings!r}: {exc}") from None
