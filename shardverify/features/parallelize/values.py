"""Tensors as every rank holds them: a DTensor as its full value (gathered, each rank's copy), a
``LocalTensor`` of the in-process world as each rank's own tensor, a plain tensor as it is on
every rank; and a module's or a model's output (a tensor, a tuple, a ``ModelOutput``) as its
tensors, each with a label, in order."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["tensors_of", "per_rank", "is_dtensor"]


def is_dtensor(value: object) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(value, DTensor)


def tensors_of(value: object, label: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``value`` with its label: ``""`` for a lone tensor, ``[i]`` for a tuple's
    i-th, ``.name`` for a mapping's (a ``ModelOutput``) entry; other values are skipped."""
    if isinstance(value, torch.Tensor):
        yield label, value
    elif isinstance(value, dict) or hasattr(value, "items") and hasattr(value, "keys"):
        for key, item in value.items():
            yield from tensors_of(item, f"{label}.{key}")
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from tensors_of(item, f"{label}[{index}]")


def per_rank(value: torch.Tensor, world: int) -> list[torch.Tensor]:
    """``value`` as each of ``world`` ranks holds it, detached, in its own dtype: a DTensor's full
    tensor (a collective: every rank must ask in the same order), a LocalTensor's rank values."""
    from torch.distributed._local_tensor import LocalTensor

    with torch.no_grad():
        if is_dtensor(value):
            value = value.full_tensor()
        value = _waited(value)
        with _outside_local_mode():
            if isinstance(value, LocalTensor):
                return [value._local_tensors[rank].detach().clone() for rank in range(world)]
            plain = value.detach().clone()
            return [plain] * world


def _waited(value: torch.Tensor) -> torch.Tensor:
    """A collective's result that has not been waited on (``AsyncCollectiveTensor``), waited."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    while isinstance(value, AsyncCollectiveTensor):
        value = value.trigger_wait()
        value = getattr(value, "elem", value) if isinstance(value, AsyncCollectiveTensor) else value
    return value


def _outside_local_mode() -> contextlib.AbstractContextManager:
    """The in-process world's mode paused (a copy made under it would be every rank's again)."""
    from torch.distributed._local_tensor import get_local_tensor_mode_list

    modes = get_local_tensor_mode_list()
    return modes[-1].disable() if modes else contextlib.nullcontext()
