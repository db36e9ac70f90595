"""Decompositions of libraries' custom ops that PyTorch has none for, by the op's qualified name,
written in ATen ops the specs serve. A custom op is opaque to torch.export (one node, its kernel
a Python function no table decomposes) and exists only once its library is loaded, so no spec can
name it as a target; matched by name here, nothing is imported.

``transformers::grouped_mm_fallback(input [S, K], weight [E, K, N], offs [E]) -> [S, N]`` is
transformers' grouped matmul of a mixture of experts, what its default ``grouped_mm`` experts run
under torch.export on float32 (``torch._grouped_mm`` takes no float64 on the CPU and is not used
there while compiling): the rows of ``input`` sorted by expert, ``offs`` the running end of each
expert's rows, each block of rows multiplied by its expert's matrix in a Python loop over
``offs.tolist()`` (a data-dependent loop no capture can trace), rows past the last end left zero.
The same values without the loop: each row's expert is the number of ends at or before it (``le``,
``sum``); its matrix looked up by that id (``index``, the lookup an expert-parallel layout masks)
and applied with ``bmm``, as transformers' ``batched_mm`` experts do; a row past the last end
multiplied by zero. The single-device reference runs these pieces too, so their agreement with the
op itself is checked where they are written (tests/test_moe_defaults.py), on empty experts and rows
past the end, forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["DECOMPOSITIONS", "custom_decomposition", "grouped_mm_rows"]


def grouped_mm_rows(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``transformers::grouped_mm_fallback`` without its loop (see the module docstring); ``offs``
    non-decreasing, as the op takes it."""
    experts = weight.shape[0]
    rows = torch.arange(input.shape[0], device=input.device)
    expert = (offs.unsqueeze(0) <= rows.unsqueeze(1)).sum(dim=1)        # [S]: ends at or before each row
    inside = (expert < experts).unsqueeze(-1)                           # rows past the last end: zero
    picked = weight[expert.clamp(max=experts - 1)]                      # [S, K, N]: each row's expert
    out = torch.bmm(input.unsqueeze(1), picked).squeeze(1)
    return out * inside.to(out.dtype)


#: qualified op name ("namespace::name", the default overload) -> its decomposition
DECOMPOSITIONS: dict[str, Callable[..., torch.Tensor]] = {
    "transformers::grouped_mm_fallback": grouped_mm_rows,
}


def custom_decomposition(target: object) -> Callable[..., torch.Tensor] | None:
    """The decomposition of a library's custom op overload, or None (an ATen op, an unknown one)."""
    if not isinstance(target, torch._ops.OpOverload) or target._overloadname != "default":
        return None
    return DECOMPOSITIONS.get(target.name())
