"""How a plan check compares one value with the single-device model's: in the precision the
value was computed in. The check runs the model in float64, so a difference in a float64 value
is a bug, not rounding (rtol 1e-7, atol 1e-9); but a model that computes in float32 inside
(Gemma-style RMSNorm: ``x.float()``) keeps float32 rounding there, and splitting a batch
changes the order of its float32 sums. A node's output is held to the lowest floating precision
among itself and every node it is computed from; a gradient, which flows back through every
node downstream, to the lowest precision of the whole graph (float32: torch.testing's rtol
1.3e-6, atol 1e-5, which covers a reordered sum), each element also allowed that rtol of the
tensor's largest (:class:`SummedTolerance`): a gradient element is a sum of chain-rule terms, and
one that cancels to near zero keeps the rounding of its terms, not of its sum (Llama's RMSNorm
upcast: gradients of 5e3 whose cancelling elements differ by 1e-3, 2e-7 of the largest, when a
batch split flips a float32 rounding upstream). Bool and integer values are compared exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from shardverify.sharding.reshard_plan import Layout
from shardverify.verify.tolerance import DEFAULT_TOLERANCES, Tolerance

__all__ = ["RTOL", "ATOL", "FLOAT64", "Precisions", "precisions", "mismatch_error", "PlanMismatch",
           "SummedTolerance"]

RTOL, ATOL = 1e-7, 1e-9
FLOAT64 = Tolerance(RTOL, ATOL)
_CHUNK = 1 << 20


def _rank(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _dtypes(node: fx.Node) -> list[torch.dtype]:
    meta = node.meta.get("tensor_meta")
    metas = [meta] if hasattr(meta, "dtype") else meta if isinstance(meta, (list, tuple)) else []
    return [m.dtype for m in metas if getattr(m, "dtype", None) is not None and m.dtype.is_floating_point]


def _tolerance(dtype: torch.dtype) -> Tolerance:
    if dtype == torch.float64:
        return FLOAT64
    return DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.bfloat16])


@dataclass(frozen=True)
class SummedTolerance(Tolerance):
    """``|actual - expected| <= atol + rtol * (|expected| + max |expected|)``: a gradient computed
    in a precision below float64, each element a sum of terms whose rounding scales with the
    terms (the tensor's largest element standing in for them), not with the sum. A sharding bug
    (a missing or doubled reduction) is off by the values themselves, far outside it."""


@dataclass(frozen=True)
class Precisions:
    """The tolerance of each node's output (forward) and of every gradient (backward)."""

    forward: dict
    backward: Tolerance

    def of(self, node: str) -> Tolerance:
        return self.forward.get(node, FLOAT64)


def precisions(gm: fx.GraphModule) -> Precisions:
    """Each node's lowest floating dtype among itself and its inputs' (transitively), as a tolerance."""
    lowest: dict[str, torch.dtype] = {}
    for node in gm.graph.nodes:
        found = _dtypes(node) + [lowest[a.name] for a in node.all_input_nodes if a.name in lowest]
        if found:
            lowest[node.name] = max(found, key=_rank)
    overall = max(lowest.values(), key=_rank, default=torch.float64)
    backward = _tolerance(overall)
    if overall != torch.float64:
        backward = SummedTolerance(backward.rtol, backward.atol)
    return Precisions({name: _tolerance(dtype) for name, dtype in lowest.items()}, backward)


def mismatch_error(actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance) -> float | None:
    """The largest absolute error if any element of ``actual`` is out of ``tolerance`` of
    ``expected`` (bool and integer values: any difference), else None. In chunks of a million
    elements: comparing a whole weight at once held two float64 copies of it."""
    with torch.no_grad():
        got, want = actual.detach().reshape(-1), expected.detach().reshape(-1)
        exact = not (got.is_floating_point() or got.is_complex()) and not (want.is_floating_point()
                                                                           or want.is_complex())
        worst, bad = 0.0, False
        atol = tolerance.atol
        if isinstance(tolerance, SummedTolerance) and not exact and want.numel():
            atol += tolerance.rtol * max(float(want[start:start + _CHUNK].double().abs().max())
                                         for start in range(0, want.numel(), _CHUNK))
        for start in range(0, got.numel(), _CHUNK):
            w = want[start:start + _CHUNK].double()      # no copy for float64; bool and int data as numbers
            err = got[start:start + _CHUNK].double().sub(w).abs_()
            bound = torch.zeros_like(w) if exact else w.abs().mul_(tolerance.rtol).add_(atol)
            if bool(err.gt(bound).any()):
                bad, worst = True, max(worst, float(err.max()))
        return worst if bad else None


@dataclass(frozen=True)
class PlanMismatch:
    phase: str          # "forward" (a node's output), "backward" (a node's output gradient), "grad", "error"
    order: int          # the node's position in the graph (for "grad": of the node using the tensor)
    node: str
    what: str
    rank: int
    max_abs_err: float = 0.0

    def __str__(self) -> str:
        err = f": max abs error {self.max_abs_err:.3g}" if self.phase != "error" else ""
        return f"rank {self.rank}: {self.phase} {self.what} at node {self.node!r}{err}"


def _cmp(found: list, phase: str, order: int, node: str, what: str, rank: int, actual, expected,
         tolerance=FLOAT64) -> None:
    if actual is None or expected is None:
        if (actual is None) != (expected is None):
            found.append(PlanMismatch(phase, order, node, what + " (gradient missing on one side)", rank))
        return
    if tuple(actual.shape) != tuple(expected.shape):
        found.append(PlanMismatch(phase, order, node, f"{what} (shape {tuple(actual.shape)}, expected "
                                  f"{tuple(expected.shape)})", rank, float("inf")))
        return
    worst = mismatch_error(actual, expected, tolerance)
    if worst is not None:
        found.append(PlanMismatch(phase, order, node, what, rank, worst))


def _shard(layout, value, mesh, rank):
    if isinstance(layout, Layout) and isinstance(value, torch.Tensor):
        return layout.spec.local_shard(value, mesh, rank)
    return value
