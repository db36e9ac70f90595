"""Checks a strategy's declared compute, communication and memory costs against what the rank really did.

Communication: every collective a rank issues is recorded by its communicator as
``(kind, axes, payload bytes)`` (``Communicator.traffic``); the verifier prices what was issued
in the forward pass and in the backward pass with the mesh's alpha-beta model
(``DeviceMesh.collective_cost``) and compares with the declared ``communication_cost``.

Compute: the real local op call runs under ``torch.utils.flop_counter.FlopCounterMode``
(:class:`OpMeter`); the figures the strategy must declare follow from the rule
:func:`shardverify.strategies.generators.flops.compute_cost` (forward = counted FLOPs / 2, or the numel
of the largest local operand when the counter does not count the op; backward = 2 x forward).

Memory: the bytes of the rank's real local shards and outputs (:func:`memory_mismatches`).

Uneven blocks: a strategy declares its costs for the largest blocks (the rank at coordinate 0
of every mesh axis holds them: the slowest rank sets the step time). That rank must measure
exactly the declared figures; a rank holding smaller blocks must measure no more.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import NamedTuple

import torch

from shardverify.capture.meta import tensor_meta
from shardverify.capture.call import operand_nodes
from shardverify.sharding.strategy import ShardingStrategy, TrainCycleItem
from shardverify.spec.case import OpCase
from shardverify.strategies.generators.flops import compute_cost, thread_counter
from shardverify.verify.layout import RankLayout
from shardverify.verify.memo import remembered
from shardverify.verify.report import Mismatch

__all__ = ["OpMeter", "OpWork", "price_traffic", "communication_mismatches", "compute_mismatches",
           "memory_mismatches", "REL_TOL"]

#: relative tolerance of a cost comparison (the figures are sums of floats added in other orders)
REL_TOL = 1e-6
_ABS_TOL = 1e-15


class OpWork(NamedTuple):
    """What one local op call did: FLOPs as the counter counts them, and the numel of its
    largest tensor operand (inputs as passed, outputs as returned).  (A named tuple: one per
    rank of every check.)"""

    flops: int
    largest_numel: int


class OpMeter:
    """Wraps the real local op calls of one op (``meter.call(fn, *args)``) and keeps the last
    one's :class:`OpWork`.

    ``counts``: the op's counts so far (call signature -> (FLOPs, largest numel passed in):
    one table per op, its node fixing the op and its non-tensor arguments), or None to always
    count; ``call_signed``'s ``signature``: everything else the count depends on (the shape,
    stride, dtype and device of every tensor that reaches it).  The counter's formulas read
    only shapes, and running a small op under FlopCounterMode costs several times the op, so a
    signature seen before reuses its count and the call runs bare; so does the largest operand
    passed in (the signature holds every shape), while the largest output is always measured
    on the real call's result.  One meter serves every rank of a check."""

    def __init__(self, counts: dict | None = None) -> None:
        self.work: OpWork | None = None
        self._known = counts

    def call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, counted."""
        return self.call_signed(None, fn, *args, **kwargs)

    def call_signed(self, signature: Hashable | None, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, counted unless a call of this ``signature`` (None: none) was."""
        known = self._known if signature is not None else None
        seen = known.get(signature) if known is not None else None
        if seen is None:
            with thread_counter() as counter:   # the rank's own: made once per thread
                result = fn(*args, **kwargs)
            seen = (int(counter.get_total_flops()), _largest_numel((args, kwargs)))
            if known is not None:
                known[signature] = seen
        else:
            result = fn(*args, **kwargs)
        self.work = OpWork(seen[0], max(seen[1], _largest_numel(result)))
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


def price_traffic(mesh, traffic: Mapping) -> float:
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


def _describe(traffic: Mapping) -> str:
    if not traffic:
        return "no collectives"
    return ", ".join(f"{n} x {kind} of {nbytes} B over axes {axes}"
                     for (kind, axes, nbytes), n in sorted(traffic.items()))


def communication_mismatches(strategy: ShardingStrategy, mesh, rank: int, fwd: Mapping,
                             bwd: Mapping | None, largest: bool = True) -> list[Mismatch]:
    """The declared communication cost against the priced collectives this rank issued in the
    forward pass (``fwd``) and the backward pass (``bwd``; None when backward did not run, then
    only the forward figure is checked); ``largest``: whether this rank holds the largest blocks.
    (Ranks measuring alike share one verdict in ``ranks_check``; a verdict is a few float
    comparisons, so nothing here remembers one.)"""
    detail = _communication_problems(strategy, mesh, fwd, bwd, largest)
    return [Mismatch("cost", rank, "communication cost", detail=detail)] if detail else []


def _communication_problems(strategy: ShardingStrategy, mesh, fwd: Mapping, bwd: Mapping | None,
                            largest: bool) -> str:
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
        return ""
    return (f"strategy {strategy.name!r}: " + "; ".join(problems)
            + f" (mesh alpha={mesh.alpha}, beta={mesh.beta})")


def compute_mismatches(strategy: ShardingStrategy, rank: int, work: OpWork | None,
                       largest: bool = True) -> list[Mismatch]:
    """The declared compute cost against :func:`~shardverify.strategies.generators.flops.compute_cost` of
    the measured local op call; ``largest``: whether this rank holds the largest blocks."""
    if work is None:
        return []
    detail = _compute_problems(strategy, work, largest)
    return [Mismatch("cost", rank, "compute cost", detail=detail)] if detail else []


def _compute_problems(strategy: ShardingStrategy, work: OpWork, largest: bool) -> str:
    want = compute_cost(work.flops, [work.largest_numel])
    declared: TrainCycleItem = strategy.compute_cost
    if (_close(declared.fwd, want.fwd, largest) and _close(declared.bwd, want.bwd, largest)
            and _close(declared.total, want.total, largest)):
        return ""   # the common case, without building the phases' list
    problems = [f"{phase}: declared {getattr(declared, phase):.6g}, {_claim(largest)} {getattr(want, phase):.6g}"
                for phase in ("fwd", "bwd", "total")
                if not _close(getattr(declared, phase), getattr(want, phase), largest)]
    basis = (f"{work.flops} FLOPs counted / 2" if work.flops
             else f"no FLOPs counted: largest local operand has {work.largest_numel} elements")
    return f"strategy {strategy.name!r}: " + "; ".join(problems) + f" ({basis}; bwd = 2 x fwd)"


def memory_mismatches(strategy: ShardingStrategy, rank: int, leaves: dict, outputs: tuple, case: OpCase,
                      layout: RankLayout) -> list[Mismatch]:
    """The declared memory cost against the bytes this rank really holds (:func:`_memory_problems`)."""
    problems = _memory_problems(strategy, leaves, outputs, case, layout)
    return [Mismatch("memory", rank, "memory cost", detail="; ".join(problems))] if problems else []


def _memory_problems(strategy: ShardingStrategy, leaves: dict, outputs: tuple, case: OpCase,
                     layout: RankLayout) -> tuple[str, ...]:
    """The declared memory cost against the bytes this rank really holds: forward holds
    every operand's local shard, backward a gradient of each input and parameter. Sizes come
    from the real tensors (local shard elements x the traced tensor's element size) and the
    parameter/activation split from whether the tensor is module state (a parameter or
    buffer), never from what the strategy says about its operands. Uneven blocks: the rank
    holding the largest blocks holds exactly the declared bytes, any other no more."""
    real, out_dtypes = _real_operands(case)
    activation = parameter = 0
    lies = []   # operands whose declared dtype is not the real tensor's
    for operand in layout.inputs:
        data = operand.data
        dtype, is_state = real[(data.locator.kind, data.locator.key)]
        size = leaves[data.name].numel() * dtype.itemsize
        if is_state:
            parameter += size
        else:
            activation += size
        if data.dtype != dtype:
            lies.append(f"operand {data.name!r} is declared {data.dtype} but the tensor is {dtype}")
    lies += [f"operand {operand.data.name!r} is declared {operand.data.dtype} but the tensor is {dtype}"
             for operand, dtype in zip(layout.outputs, out_dtypes) if operand.data.dtype != dtype]
    out_bytes = sum([out.numel() * dtype.itemsize for out, dtype in zip(outputs, out_dtypes)])
    # (activation, parameter) bytes held in the forward pass, the backward pass and in total
    held = ((activation + out_bytes, parameter), (activation, parameter), (2 * activation + out_bytes, 2 * parameter))
    largest = layout.holds_largest
    problems = [f"{phase}: declared {d.activation} activation + {d.parameter} parameter bytes, "
                f"local shards hold {act} + {par}"
                + ("" if largest else " (a rank with smaller blocks than the largest may hold less, never more)")
                for phase, d, (act, par) in zip(("fwd", "bwd", "total"), strategy.memory_cost, held)
                if ((d.activation != act or d.parameter != par) if largest else (act > d.activation or par > d.parameter))]
    return tuple(problems + lies)


_REAL: dict = {}


def _real_operands(case: OpCase) -> tuple[dict, list[torch.dtype]]:
    """({operand locator: (dtype, is module state)}, [dtype of each output]) of the traced
    harness: the real tensors the strategy describes, whatever dtype a check runs in.
    Remembered per case object."""
    return remembered(_REAL, id(case), case, lambda: _traced_operands(case), limit=256)


def _traced_operands(case: OpCase) -> tuple[dict, list[torch.dtype]]:
    from shardverify.verify.reference import _meta_dtypes

    traced, node_name = case.build()
    node = next(n for n in traced.graph.nodes if n.name == node_name)
    found = {loc: (meta.dtype, arg.op == "get_attr")
             for loc, arg in operand_nodes(node).items() if (meta := tensor_meta(arg)) is not None}
    if node.op == "call_module":
        module = traced.get_submodule(str(node.target))
        found.update({("param", n): (p.dtype, True) for n, p in module.named_parameters()})
        found.update({("buffer", n): (b.dtype, True) for n, b in module.named_buffers()})
    return found, _meta_dtypes(traced, node_name)


