"""Checks a strategy's declared compute and communication costs against what the rank really did.

Communication: every collective a rank issues is recorded by its communicator as
``(kind, axes, payload bytes)`` (``Communicator.traffic``); the verifier prices what was issued
in the forward pass and in the backward pass with the mesh's alpha-beta model
(``DeviceMesh.collective_cost``) and compares with the declared ``communication_cost``.

Compute: the real local op call runs under ``torch.utils.flop_counter.FlopCounterMode``
(:class:`OpMeter`); the figures the strategy must declare follow from the rule
:func:`shardverify.strategies.generators.flops.compute_cost` (forward = counted FLOPs / 2, or the numel
of the largest local operand when the counter does not count the op; backward = 2 x forward).

Uneven blocks: a strategy declares its costs for the largest blocks (the rank at coordinate 0
of every mesh axis holds them: the slowest rank sets the step time). That rank must measure
exactly the declared figures; a rank holding smaller blocks must measure no more.
"""

from __future__ import annotations

import math
import weakref
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from shardverify.sharding.strategy import ShardingStrategy, TrainCycleItem
from shardverify.strategies.generators.flops import LocalFlopCounter, compute_cost
from shardverify.verify.report import Mismatch

__all__ = ["OpMeter", "OpWork", "price_traffic", "communication_mismatches", "compute_mismatches",
           "REL_TOL"]

#: relative tolerance of a cost comparison (the figures are sums of floats added in other orders)
REL_TOL = 1e-6
_ABS_TOL = 1e-15


@dataclass(frozen=True)
class OpWork:
    """What one local op call did: FLOPs as the counter counts them, and the numel of its
    largest tensor operand (inputs as passed, outputs as returned)."""

    flops: int
    largest_numel: int


#: counted FLOPs: owner (the op's node, held weakly) -> call signature -> FLOPs
_FLOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class OpMeter:
    """Wraps the real local op call (``meter.call(fn, *args)``) and keeps its :class:`OpWork`.

    ``owner`` and ``signature``: the op (its fx node: the op and its non-tensor arguments) and
    everything else the count depends on (the shape, stride, dtype and device of every tensor
    that reaches it), or None to always count.  The counter's formulas read only shapes, and
    running a small op under FlopCounterMode costs several times the op, so a signature seen
    before reuses its count and the call runs bare; the largest operand is always measured on
    the real call.  Counts go away with their owner."""

    def __init__(self, owner: object | None = None, signature: Hashable | None = None) -> None:
        self.work: OpWork | None = None
        self.owner, self.signature = owner, signature

    def call(self, fn, *args, **kwargs):
        known = _FLOPS.get(self.owner) if self.owner is not None else None
        flops = known.get(self.signature) if known is not None else None
        if flops is None:
            with LocalFlopCounter() as counter:
                result = fn(*args, **kwargs)
            flops = int(counter.get_total_flops())
            if self.owner is not None:
                if known is None:
                    known = _FLOPS.setdefault(self.owner, {})
                known[self.signature] = flops
        else:
            result = fn(*args, **kwargs)
        self.work = OpWork(flops, _largest_numel((args, kwargs, result)))
        return result


def _largest_numel(value: object) -> int:
    """The numel of the largest tensor inside nested tuples, lists and dicts, 0 without one (a
    module's own parameters are not operands: the local call passes the rank's shards in their
    place)."""
    largest, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            largest = max(largest, item.numel())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
    return largest


def price_traffic(mesh, traffic: Counter) -> float:
    """Seconds of the collectives in ``traffic`` ((kind, axes, payload bytes) -> count)."""
    return sum(n * mesh.collective_cost(kind, nbytes, axes) for (kind, axes, nbytes), n in traffic.items())


def _close(declared: float, expected: float, largest: bool = True) -> bool:
    """Whether ``declared`` states ``expected`` (on the rank holding the largest blocks), or
    bounds it (on any other rank)."""
    if largest:
        return math.isclose(declared, expected, rel_tol=REL_TOL, abs_tol=_ABS_TOL)
    return declared >= expected - max(abs(expected) * REL_TOL, _ABS_TOL)


def _claim(largest: bool) -> str:
    """How a mismatch reads: the largest blocks' rank must measure the figure, another no more."""
    return "expected" if largest else "but this rank, holding smaller blocks than the largest, measured"


def _describe(traffic: Counter) -> str:
    if not traffic:
        return "no collectives"
    return ", ".join(f"{n} x {kind} of {nbytes} B over axes {axes}"
                     for (kind, axes, nbytes), n in sorted(traffic.items()))


def communication_mismatches(strategy: ShardingStrategy, mesh, rank: int, fwd: Counter,
                             bwd: Counter | None, largest: bool = True) -> list[Mismatch]:
    """The declared communication cost against the priced collectives this rank issued in the
    forward pass (``fwd``) and the backward pass (``bwd``; None when backward did not run, then
    only the forward figure is checked); ``largest``: whether this rank holds the largest blocks."""
    expected = {"fwd": price_traffic(mesh, fwd)}
    if bwd is not None:
        expected["bwd"] = price_traffic(mesh, bwd)
        expected["total"] = expected["fwd"] + expected["bwd"]
    issued = {"fwd": fwd, "bwd": bwd, "total": None}
    problems = []
    for phase, want in expected.items():
        declared = getattr(strategy.communication_cost, phase)
        if not _close(declared, want, largest):
            what = f" ({_describe(issued[phase])})" if issued[phase] is not None else ""
            problems.append(f"{phase}: declared {declared:.6g} s, {_claim(largest)} {want:.6g} s for the "
                            f"collectives issued{what}")
    if not problems:
        return []
    return [Mismatch("cost", rank, "communication cost",
                     detail=f"strategy {strategy.name!r}: " + "; ".join(problems)
                            + f" (mesh alpha={mesh.alpha}, beta={mesh.beta})")]


def compute_mismatches(strategy: ShardingStrategy, rank: int, work: OpWork | None,
                       largest: bool = True) -> list[Mismatch]:
    """The declared compute cost against :func:`~shardverify.strategies.generators.flops.compute_cost` of
    the measured local op call; ``largest``: whether this rank holds the largest blocks."""
    if work is None:
        return []
    want = compute_cost(work.flops, [work.largest_numel])
    declared: TrainCycleItem = strategy.compute_cost
    problems = [f"{phase}: declared {getattr(declared, phase):.6g}, {_claim(largest)} {getattr(want, phase):.6g}"
                for phase in ("fwd", "bwd", "total")
                if not _close(getattr(declared, phase), getattr(want, phase), largest)]
    if not problems:
        return []
    basis = (f"{work.flops} FLOPs counted / 2" if work.flops
             else f"no FLOPs counted: largest local operand has {work.largest_numel} elements")
    return [Mismatch("cost", rank, "compute cost",
                     detail=f"strategy {strategy.name!r}: " + "; ".join(problems) + f" ({basis}; bwd = 2 x fwd)")]
