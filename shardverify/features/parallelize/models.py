"""What is parallelized: a model built the same way on every call (seeded weights), the batch of
each step, and the loss a training step takes of its output (:mod:`shardverify.features.parallelize.names`
finds one by the name a user gives it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardverify.errors import InvalidArgument
from shardverify.features.parallelize.values import tensors_of

__all__ = ["Batch", "ModelSource", "default_loss", "from_factory"]


@dataclass(frozen=True)
class Batch:
    """One step's data: the model's keyword inputs and the targets its loss takes (None: the loss
    reads the model's own output, as a transformers model given ``labels`` does)."""

    inputs: dict[str, torch.Tensor]
    targets: torch.Tensor | None = None

    def cast(self, dtype: torch.dtype) -> Batch:
        """Floating inputs in ``dtype``; ids and masks as they are."""
        return Batch({k: v.to(dtype) if v.is_floating_point() else v for k, v in self.inputs.items()}, self.targets)


def default_loss(output: object, targets: torch.Tensor | None) -> torch.Tensor:
    """The output's own ``loss`` (a transformers model given labels), else cross-entropy of the
    first output against ``targets`` (logits over the last dim), else the mean square of the
    first floating output: a loss every element of the output reaches."""
    own = getattr(output, "loss", None)
    if isinstance(own, torch.Tensor):
        return own
    first = next((t for _, t in tensors_of(output) if t.is_floating_point()), None)
    if first is None:
        raise InvalidArgument("the model's output holds no floating tensor to take a loss of")
    if targets is not None:
        return torch.nn.functional.cross_entropy(first.flatten(0, -2), targets.flatten())
    return first.float().pow(2).mean() if first.dtype != torch.float64 else first.pow(2).mean()


@dataclass(frozen=True)
class ModelSource:
    """A model to parallelize: ``build()`` gives the same weights every call; ``batch(step)`` the
    full (single-device) batch of a step; ``loss(output, targets)`` a training step's loss."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], Batch]
    loss: Callable[[object, torch.Tensor | None], torch.Tensor] = default_loss
    note: str = ""                    # what was built (said with the result)
    heads: int | None = None          # attention heads, where known (a plan on a mesh that does not divide them is said)


def from_factory(name: str, factory: Callable[[], nn.Module], inputs: Sequence, seed: int = 0,
                 targets: Callable[[int], torch.Tensor | None] | None = None) -> ModelSource:
    """A model from a callable (seeded before each call) and its input specs
    (:class:`shardverify.plan.inputs.InputSpec`), drawn afresh each step; a positional input is
    passed by the name of the forward's parameter in its place."""
    import inspect

    from shardverify.plan.inputs import draw_inputs

    def build() -> nn.Module:
        torch.manual_seed(seed)
        model = factory()
        if not isinstance(model, nn.Module):
            raise InvalidArgument(f"{name}: the factory returned {type(model).__name__}, not a torch.nn.Module")
        return model

    names: list[str] = []

    def batch(step: int) -> Batch:
        positional, keywords = draw_inputs(inputs, torch.Generator().manual_seed(seed * 1000 + step))
        if positional and not names:
            names.extend(inspect.signature(build().forward).parameters)
        named = dict(zip(names, positional))
        return Batch({**named, **keywords}, targets(step) if targets else None)

    return ModelSource(name, build, batch)
