"""How a plan check compares one value with the single-device model's: in the precision the
value was computed in, by :mod:`shardverify.verify.tolerance`'s one rule and defaults (an op
check's). The check runs the model in float64, so a difference in a float64 value is a bug, not
rounding; but a model that computes in float32 inside
(Gemma-style RMSNorm: ``x.float()``) keeps float32 rounding there, and splitting a batch
changes the order of its float32 sums. A node's output is held to the lowest floating precision
among itself and every node it is computed from; a gradient, which flows back through every
node downstream, to the lowest precision of the whole graph (float32: torch.testing's rtol
1.3e-6, atol 1e-5, which covers a reordered sum), each element also allowed that rtol of the
tensor's largest (:class:`~shardverify.verify.tolerance.SummedTolerance`): a gradient element is a
sum of chain-rule terms, and
one that cancels to near zero keeps the rounding of its terms, not of its sum (Llama's RMSNorm
upcast: gradients of 5e3 whose cancelling elements differ by 1e-3, 2e-7 of the largest, when a
batch split flips a float32 rounding upstream). Bool and integer values are compared exactly.
What differs is a :class:`~shardverify.verify.report.Mismatch` naming its phase and node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from shardverify.capture.meta import output_metas
from shardverify.sharding.layout import ShapedLayout
from shardverify.verify.report import Mismatch
from shardverify.verify.tolerance import SummedTolerance, Tolerance, max_error, tolerance_for

__all__ = ["Precisions", "precisions", "compare_value", "expected_shard"]

_FLOAT64 = tolerance_for(torch.float64)


def _rank(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _dtypes(node: fx.Node) -> list[torch.dtype]:
    return [m.dtype for m in output_metas(node) or () if m is not None and m.dtype.is_floating_point]


def _tolerance(dtype: torch.dtype) -> Tolerance:
    try:
        return tolerance_for(dtype)
    except Exception:  # noqa: BLE001 - a floating dtype without a default (float8): bfloat16's
        return tolerance_for(torch.bfloat16)


@dataclass(frozen=True)
class Precisions:
    """The tolerance of each node's output (forward) and of every gradient (backward)."""

    forward: dict
    backward: Tolerance

    def of(self, node: str) -> Tolerance:
        return self.forward.get(node, _FLOAT64)


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


def compare_value(found: list, phase: str, order: int, node: str, what: str, rank: int, actual, expected,
                  tolerance: Tolerance = _FLOAT64) -> None:
    """Append to ``found`` what differs between this rank's ``actual`` and its ``expected`` share
    of the single-device value (a gradient on one side only, another shape, values out of
    ``tolerance``)."""
    where = {"phase": phase, "node": node, "order": order}
    if actual is None or expected is None:
        if (actual is None) != (expected is None):
            found.append(Mismatch("values", rank, what + " (gradient missing on one side)", max_abs_err=0.0, **where))
        return
    if tuple(actual.shape) != tuple(expected.shape):
        found.append(Mismatch("shape", rank, f"{what} (shape {tuple(actual.shape)}, expected {tuple(expected.shape)})",
                              actual_shape=tuple(actual.shape), expected_shape=tuple(expected.shape),
                              max_abs_err=float("inf"), **where))
        return
    worst = max_error(actual, expected, tolerance)
    if worst is not None:
        found.append(Mismatch("values", rank, what, actual_shape=tuple(actual.shape), max_abs_err=worst,
                              rtol=tolerance.rtol, atol=tolerance.atol, dtype=str(actual.dtype).replace("torch.", ""),
                              **where))


def expected_shard(layout, value, mesh, rank):
    """This rank's share of the single-device ``value`` under ``layout`` (a non-tensor as it is)."""
    if isinstance(layout, ShapedLayout) and isinstance(value, torch.Tensor):
        return layout.spec.local_shard(value, mesh, rank)
    return value
