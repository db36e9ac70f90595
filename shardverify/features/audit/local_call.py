"""One rank's op call as the audit makes it and reads it: the op run with its backward (as a
training step runs a rank's empty block), outputs widened to float64 or complex128 to compare, the
magnitude an absolute tolerance scales with, and blocks whose dtypes differ between ranks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardverify.capture.call import backward_from_ones, call_op

__all__ = ["mixed_dtypes", "widened", "call_with_backward", "output_scale"]


def mixed_dtypes(tensors: Sequence[torch.Tensor]) -> str:
    """"" where every rank's block has one dtype, else the dtypes found (sorted)."""
    dtypes = {t.dtype for t in tensors}
    return "" if len(dtypes) < 2 else ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def widened(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached in float64, or complex128 where it is complex (its imaginary part kept)."""
    return tensor.detach().to(torch.complex128 if tensor.is_complex() else torch.float64)


def call_with_backward(node, module, values: dict, *, owned: bool = False):
    """The op on ``values`` with its backward run from gradients of ones (what a training step
    does with a rank's empty block); the outputs, detached. Every floating operand is asked for
    a gradient, constants too, as the strategy generator's probe of an empty block asks
    (strategies/generators/common.py): the two must agree on which empty blocks an op takes.
    ``owned``: as :func:`~shardverify.capture.call.call_op` takes it."""
    values = {k: v.detach().requires_grad_() if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
              else v
              for k, v in values.items()}
    out = call_op(node, module, values, owned=owned)
    backward_from_ones(list(values.values()), out if isinstance(out, (tuple, list)) else (out,))
    if isinstance(out, (tuple, list)):
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in out)
    return out.detach() if isinstance(out, torch.Tensor) else out


def output_scale(output: torch.Tensor) -> float:
    """The magnitude the absolute tolerance scales with: the largest finite value, at least 1
    (an inf would make every finite difference pass, a NaN every one fail)."""
    finite = output[torch.isfinite(output)]
    return max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
