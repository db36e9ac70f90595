"""A rank's results against its slices of the single-device reference.

A rank checks its output and each gradient: the dtype and device it must have, then its values
against the rank's slice of the reference tensor, remembered per (tensor, layout, rank) with its
bounds ``expected -/+ (atol + rtol * |expected|)``, so the common passing comparison is a cast, a
clamp and an equality; anything else (a NaN, a value out of bound) goes to
:func:`~shardverify.verify.tolerance.compare`, which decides, and reports, every mismatch.  (Comparing a rank's tensors flattened into one batch was
tried: it saved ~6 us of ~30 per rank, and keeping the flattened reference slices per layout
combination thrashed on (2,2,2) meshes, where the strategies' combinations outnumber any cache
that holds their copies in reasonable memory; it was slower there.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardverify.verify.layout import LocalOperand
from shardverify.verify.memo import remembered
from shardverify.verify.report import Mismatch
from shardverify.verify.tolerance import Tolerance, compare

__all__ = ["kind_mismatch", "compare_all"]

Entry = tuple   # (label, actual, full reference tensor, LocalOperand, holds or None)


def kind_mismatch(rank: int, label: str, actual: torch.Tensor, dtype: torch.dtype, device) -> list[Mismatch]:
    """[] when ``actual`` has the dtype the single-device op gives (a rank returning float64 for
    float32 would pass a values check) and lives on the rank's device."""
    problems = []
    if actual.dtype != dtype:
        problems.append(f"dtype {str(actual.dtype).removeprefix('torch.')}, the single-device op gives "
                        f"{str(dtype).removeprefix('torch.')}")
    if torch.device(device).type != actual.device.type:
        problems.append(f"on device {actual.device}, the rank's device is {device}")
    return [Mismatch("dtype", rank, label, detail="; ".join(problems))] if problems else []


def compare_all(rank: int, entries: list[Entry | list[Mismatch]], mesh,
                tolerance: Callable[[torch.dtype], Tolerance]) -> list[Mismatch]:
    """The mismatches of every entry, in order: an entry is either mismatches already found (a
    wrong dtype) or a tensor to compare, ``(label, actual, full, operand, holds)``: ``actual``
    against this rank's slice of ``full`` laid out as ``operand`` (zero outside ``holds``: the
    gradient of a piece of a partial max/min)."""
    found: list[Mismatch] = []
    for entry in entries:
        found += entry if isinstance(entry, list) else _compare(rank, *entry, mesh, tolerance)
    return found


def _compare(rank: int, label: str, actual: torch.Tensor, full: torch.Tensor, operand: LocalOperand,
             holds: torch.Tensor | None, mesh, tolerance: Callable[[torch.dtype], Tolerance]) -> list[Mismatch]:
    """[] when ``actual`` matches this rank's slice of the reference tensor ``full`` (zero
    outside ``holds``), else the one mismatch found."""
    expected, bounds = _reference_slice(full, operand, mesh, rank)
    if holds is not None:
        expected, bounds = torch.where(holds, expected, torch.zeros((), dtype=expected.dtype)), {}
    if actual.shape != expected.shape:
        return [Mismatch("shape", rank, label, actual_shape=tuple(actual.shape), expected_shape=tuple(expected.shape))]
    tol = tolerance(actual.dtype)
    if actual.is_floating_point() and actual.numel():   # the cheap path of the common passing comparison
        bound = bounds.get((tol.rtol, tol.atol), False)
        if bound is False:
            bound = bounds[(tol.rtol, tol.atol)] = _bound(expected, tol)
        if bound is not None:
            got = actual.detach().to(torch.float64)
            if torch.equal(got.clamp(*bound), got):   # every value within its bounds
                return []   # NaN compares unequal: ``compare`` alone decides, and reports, everything else
    found = compare(actual, expected, tol)
    if found.close:
        return []
    return [Mismatch("values", rank, label, actual_shape=tuple(actual.shape), expected_shape=tuple(expected.shape),
                     max_abs_err=found.max_abs_err, max_rel_err=found.max_rel_err, rtol=tol.rtol, atol=tol.atol,
                     dtype=str(actual.dtype).removeprefix("torch."), detail=found.nonfinite)]


_SLICES: dict = {}


def _reference_slice(full: torch.Tensor, operand: LocalOperand, mesh, rank: int) -> tuple[torch.Tensor, dict]:
    """This rank's slice of the reference tensor ``full`` laid out as ``operand``, and its
    bounds by tolerance (filled by the comparisons).  Remembered per (tensor, layout, rank):
    every strategy laying the tensor out alike compares against the same slice."""
    return remembered(_SLICES, (id(full), operand.spec, rank), full, lambda: (operand.shard(full, mesh, rank), {}),
                      limit=8192)


def _bound(expected: torch.Tensor, tol: Tolerance) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The lowest and highest value each element may take, ``expected -/+ (atol + rtol *
    |expected|)`` in float64, for the cheap passing comparison (a value is in bounds when
    clamping it to them leaves it unchanged: two ops where the difference, its magnitude, the
    comparison and the reduction took four and a sync), or None where only ``compare`` may
    decide: a slice that is not float64 or holds an inf or NaN."""
    if expected.dtype != torch.float64 or not bool(torch.isfinite(expected).all()):
        return None
    allowed = expected.abs().mul_(tol.rtol).add_(tol.atol)
    return expected - allowed, expected + allowed
