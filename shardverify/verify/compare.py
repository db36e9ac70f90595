"""A rank's results against its slices of the single-device reference.

A rank checks its output and each gradient: the dtype and device it must have, then its values
against the rank's slice of the reference tensor, remembered per (tensor, layout, rank) with its
bounds ``expected -/+ (atol + rtol * |expected|)``, so the common passing comparison is a clamp
and an equality.  The bounds are worked out once per reference tensor and tolerance, over the
whole tensor, and each slice takes views of them (elementwise: the same numbers as the slice's
own), so a layout seen for the first time costs a few views, not a dozen ops.  For a result of
float32 or narrower the bounds are kept in float32, rounded inward (the lowest float32 at or
above the float64 bound, the highest at or below), so the result is compared as it is, without
a float64 copy: a float32 value lies within the float32 bounds exactly when it lies within the
float64 ones.  Anything else (a NaN, a value out of
bound) goes to :func:`_out_of_bound`: finite values have their errors measured in float64 by the
same rule as :func:`~shardverify.verify.tolerance.compare`, which decides, and reports, every
other mismatch.  (Comparing a rank's tensors flattened into one batch was
tried: it saved ~6 us of ~30 per rank, and keeping the flattened reference slices per layout
combination thrashed on (2,2,2) meshes, where the strategies' combinations outnumber any cache
that holds their copies in reasonable memory; it was slower there.  So was comparing one tensor
of every rank at once, against the ranks' bounds laid end to end, when every rank is checked in
one thread: no faster at the grid shapes, and at 4x their leading dims, where float32 results
often leave the default tolerance and are compared rank by rank anyway, 1.8x slower.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from shardverify.verify.error_map import error_map, error_maps_kept
from shardverify.verify.layout import LocalOperand, stacked_shards
from shardverify.verify.memo import case_table, recalled, remembered
from shardverify.verify.report import Mismatch
from shardverify.verify.tolerance import Comparison, Tolerance, compare

__all__ = ["kind_mismatch", "compare_all", "compare_ranks", "rows_within_bounds"]

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
    return compare_ranks([rank], [entries], mesh, tolerance)[0]


def compare_ranks(ranks: list[int], entries: list[list[Entry | list[Mismatch]]], mesh,
                  tolerance: Callable[[torch.dtype], Tolerance]) -> list[list[Mismatch]]:
    """``compare_all`` for each rank (``entries[i]``: rank ``ranks[i]``'s), where a rank whose
    result at a position is bit-identical to the last rank's there, which passed against the
    same slice of the same reference (a replicated output on every rank), passes without
    comparing again: the verdict is a function of those alone."""
    with torch.no_grad():   # nothing compared is differentiated: no tensor needs detaching
        return _compare_ranks(ranks, entries, mesh, tolerance)


def _compare_ranks(ranks: list[int], entries: list[list[Entry | list[Mismatch]]], mesh,
                   tolerance: Callable[[torch.dtype], Tolerance]) -> list[list[Mismatch]]:
    found: list[list[Mismatch]] = []
    passed: dict[int, tuple] = {}   # position -> the last rank's entry there, while it passed
    tolerances: dict = {}   # dtype -> its tolerance, asked once per check
    for rank, rank_entries in zip(ranks, entries):
        mismatches: list[Mismatch] = []
        for position, entry in enumerate(rank_entries):
            if isinstance(entry, list):
                mismatches += entry
                passed.pop(position, None)
                continue
            before = passed.get(position)
            if before is not None and entry[4] is None and _same_result(entry, before):
                continue
            dtype = entry[1].dtype
            tol = tolerances.get(dtype)
            if tol is None:
                tol = tolerances[dtype] = tolerance(dtype)
            missed = _compare(rank, *entry, mesh, tol)
            mismatches += missed
            if missed or entry[4] is not None:
                passed.pop(position, None)
            else:
                passed[position] = entry
        found.append(mismatches)
    return found


def _same_result(entry: Entry, before: Entry) -> bool:
    """Whether ``entry`` holds the same values as ``before`` against the same reference slice."""
    actual, other = entry[1], before[1]
    return (entry[2] is before[2] and entry[3].slices == before[3].slices and actual.dtype == other.dtype
            and actual.shape == other.shape and torch.equal(*(torch.view_as_real(t.resolve_conj()) if t.dtype ==
                                                               torch.complex32 else t for t in (actual, other))))


def _compare(rank: int, label: str, actual: torch.Tensor, full: torch.Tensor, operand: LocalOperand,
             holds: torch.Tensor | None, mesh, tol: Tolerance) -> list[Mismatch]:
    """[] when ``actual`` matches this rank's slice of the reference tensor ``full`` (zero
    outside ``holds``) within ``tol``, else the one mismatch found."""
    expected, bounds = _reference_slice(full, operand, mesh, rank)
    if holds is not None:
        if _within_masked_bound(actual, full, operand.slices, expected, bounds, holds, tol):
            return []
        expected, bounds = torch.where(holds, expected, torch.zeros((), dtype=expected.dtype)), {}
    if actual.shape != expected.shape:
        return [Mismatch("shape", rank, label, actual_shape=tuple(actual.shape), expected_shape=tuple(expected.shape))]
    bound = None
    if actual.is_floating_point() and actual.numel():   # the cheap path of the common passing comparison
        narrow = actual.dtype.itemsize <= 4
        bound = _kept_bound(full, operand.slices, expected, bounds, tol, narrow, holds is None)
        if bound is not None:
            got = actual if actual.dtype == bound[0].dtype else actual.to(bound[0].dtype)
            if torch.equal(got.clamp(*bound), got):   # every value within its bounds
                return []   # NaN compares unequal: ``compare`` alone decides, and reports, everything else
    found = _out_of_bound(actual, expected, tol, bounds) if bound is not None else compare(actual, expected, tol)
    if found.close:
        return []
    drawn = error_map(rank, label, actual, expected, tol.rtol, tol.atol, full.shape, operand.slices) \
        if error_maps_kept() else None
    return [Mismatch("values", rank, label, actual_shape=tuple(actual.shape), expected_shape=tuple(expected.shape),
                     max_abs_err=found.max_abs_err, max_rel_err=found.max_rel_err, rtol=tol.rtol, atol=tol.atol,
                     dtype=str(actual.dtype).removeprefix("torch."), detail=found.nonfinite, error_map=drawn)]


def rows_within_bounds(actual: torch.Tensor, full: torch.Tensor, operands: list[LocalOperand], mesh,
                       tol: Tolerance) -> bool:
    """Whether row i of ``actual`` (every rank's result stacked on a new leading dim, rank i's
    slice of the reference ``full`` laid out as ``operands[i]``, one layout for all) lies within
    its bounds for ``tol``: :func:`_compare`'s cheap passing comparison for every rank at once,
    against the same bounds, stacked once per (tensor, layout, tolerance, width).  False where
    a row does not, or a slice has no cheap bounds: the ranks are then compared one by one
    (:func:`compare_ranks`), which decides and reports."""
    if not actual.is_floating_point() or not actual.numel():
        return False
    narrow = actual.dtype.itemsize <= 4
    with torch.no_grad():
        if actual.numel() > _STACKED_MOST:   # each row against its own bounds' views: stacked, they would be copies
            return all(_row_within(row, full, operand, mesh, rank, tol, narrow)
                       for rank, (row, operand) in enumerate(zip(actual, operands)))
        key = (id(full), operands[0].spec.key, len(operands), tol.rtol, tol.atol, narrow)
        found = recalled(_STACKED, key, full)
        if found is None:
            found = remembered(_STACKED, key, full, lambda: _stacked_bounds(full, operands, mesh, tol, narrow),
                               limit=512)
        if found[0] is None or found[0].shape != actual.shape:
            return False
        got = actual if actual.dtype == found[0].dtype else actual.to(found[0].dtype)
        return torch.equal(got.clamp(*found), got)


def _within_masked_bound(actual: torch.Tensor, full: torch.Tensor, slices: tuple[slice, ...], expected: torch.Tensor,
                         bounds: dict, holds: torch.Tensor, tol: Tolerance) -> bool:
    """Whether ``actual`` lies within the bounds of ``where(holds, expected, 0)`` (the gradient of
    a piece of a partial max/min), taken elementwise from the slice's kept bounds and zero's
    instead of worked out for the masked tensor at every comparison: the same bounds, so the same
    verdict where it passes; anything else is left to the comparison of the masked tensor."""
    if not actual.is_floating_point() or not actual.numel() or actual.shape != expected.shape:
        return False
    narrow = actual.dtype.itemsize <= 4
    bound = _kept_bound(full, slices, expected, bounds, tol, narrow, True)
    zero = _zero_bound(tol, narrow)
    if bound is None or zero is None:
        return False
    low, high = torch.where(holds, bound[0], zero[0]), torch.where(holds, bound[1], zero[1])
    got = actual if actual.dtype == low.dtype else actual.to(low.dtype)
    return torch.equal(got.clamp(low, high), got)


@functools.lru_cache(maxsize=64)
def _zero_bound(tol: Tolerance, narrow: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`_bound` of a zero, the expected value outside a partial max/min piece's holdings."""
    return _bound(torch.zeros((), dtype=torch.float64), tol, narrow, {})


def _row_within(row: torch.Tensor, full: torch.Tensor, operand: LocalOperand, mesh, rank: int, tol: Tolerance,
                narrow: bool) -> bool:
    """Whether one rank's result lies within the bounds :func:`_compare` holds it to (False where
    its slice has none)."""
    bound = _rank_bound(full, operand, mesh, rank, tol, narrow)
    if bound is None or bound[0].shape != row.shape:
        return False
    got = row if row.dtype == bound[0].dtype else row.to(bound[0].dtype)
    return torch.equal(got.clamp(*bound), got)


def _rank_bound(full: torch.Tensor, operand: LocalOperand, mesh, rank: int, tol: Tolerance,
                narrow: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The bounds of this rank's slice of ``full`` for ``tol`` (:func:`_compare`'s), remembered with the slice."""
    expected, bounds = _reference_slice(full, operand, mesh, rank)
    return _kept_bound(full, operand.slices, expected, bounds, tol, narrow, True)


def _kept_bound(full: torch.Tensor, slices: tuple[slice, ...], expected: torch.Tensor, bounds: dict, tol: Tolerance,
                narrow: bool, sliced: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The bounds of ``expected`` for ``tol`` kept in ``bounds`` (its slice's), worked out on first
    ask: views of the whole's (:func:`_slice_bound`) where ``expected`` is ``full[slices]``, else its
    own (:func:`_bound`)."""
    bound = bounds.get((tol.rtol, tol.atol, narrow), False)
    if bound is False:
        bound = bounds[(tol.rtol, tol.atol, narrow)] = \
            _slice_bound(full, slices, expected, tol, narrow, bounds) if sliced else _bound(expected, tol, narrow, bounds)
    return bound


_STACKED: dict = case_table()
#: elements of a stacked result compared against stacked bounds at most (kept for the case's other checks:
#: at most 512 MiB in all, as these are copies, unlike the slices' views); a larger one row by row
_STACKED_MOST = 1 << 16


def _stacked_bounds(full: torch.Tensor, operands: list[LocalOperand], mesh, tol: Tolerance,
                    narrow: bool) -> tuple:
    """(low, high) of each rank's slice (the bounds :func:`_compare` takes), stacked, or (None,)
    where some slice has none: the whole tensor's bounds laid out as the ranks hold it, or where
    the whole has none (a slice of it not finite), each slice's own."""
    whole = _whole_of(full, tol, narrow)
    if whole[0] is not None:
        return stacked_shards(whole[0][0], operands[0].spec), stacked_shards(whole[0][1], operands[0].spec)
    found = [_rank_bound(full, operand, mesh, rank, tol, narrow) for rank, operand in enumerate(operands)]
    if any(bound is None for bound in found):
        return (None,)
    return torch.stack([low for low, _ in found]), torch.stack([high for _, high in found])


_TINY = torch.finfo(torch.float64).tiny
#: elements of a result measured at once out of bound: float64 temporaries of 2 MB were each
#: fresh pages from the system (~1000 page faults a comparison, 4x the time of four pieces)
_PIECE = 1 << 16


def _out_of_bound(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, bounds: dict) -> Comparison:
    """``compare(actual, expected, tol)`` for a real floating ``actual`` against a finite float64
    ``expected`` whose bounds for ``tol`` are in ``bounds``: where every difference is finite,
    the same figures by the same float64 arithmetic, without the masks that set non-finite
    pairs aside, with what depends on ``expected`` alone (``atol + rtol * |expected|``, the
    magnitude the relative error divides by) kept with the slice, and a large result measured
    in pieces of its leading dim (a result out of its float32 tolerance, whose errors the
    low-precision budget then judges, is the common case at larger shapes, on every rank of
    every strategy); anything else goes to ``compare``."""
    allowed = bounds.get(("allowed", tol.rtol, tol.atol))
    if allowed is None:   # the slice of the whole's (_slice_bound)
        whole_allowed, whole_magnitude, slices = bounds[("whole", tol.rtol, tol.atol)]
        allowed = bounds[("allowed", tol.rtol, tol.atol)] = whole_allowed[slices]
        bounds.setdefault("magnitude", whole_magnitude[slices])
    magnitude = bounds.get("magnitude")
    if magnitude is None:   # a slice's own (its bounds were its own: _bound)
        magnitude = bounds["magnitude"] = expected.abs().clamp_min(_TINY)
    actual = actual.detach()
    rows = actual.shape[0] if actual.dim() else 1
    step = max(1, rows * _PIECE // actual.numel()) if actual.dim() else 1
    close, max_abs, max_rel = True, 0.0, 0.0
    for start in range(0, rows, step):
        part = slice(start, start + step) if actual.dim() else ...
        diff = actual[part].to(torch.float64).sub(expected[part]).abs_()
        worst = float(diff.max())   # a NaN or inf in ``actual`` shows here
        if not math.isfinite(worst):
            return compare(actual, expected, tol)
        close = close and bool((diff <= allowed[part]).all())
        max_abs, max_rel = max(max_abs, worst), max(max_rel, float(diff.div_(magnitude[part]).max()))
    return Comparison(close, max_abs, max_rel)


_SLICES: dict = case_table()


def _reference_slice(full: torch.Tensor, operand: LocalOperand, mesh, rank: int) -> tuple[torch.Tensor, dict]:
    """This rank's slice of the reference tensor ``full`` laid out as ``operand``, and its
    bounds by tolerance (filled by the comparisons).  Remembered per (tensor, layout, rank):
    every strategy laying the tensor out alike compares against the same slice."""
    key = (id(full), operand.spec.key, rank)
    found = recalled(_SLICES, key, full)
    if found is None:
        found = remembered(_SLICES, key, full, lambda: (operand.shard(full, mesh, rank), {}), limit=8192)
    return found


_WHOLE: dict = case_table()


def _slice_bound(full: torch.Tensor, slices: tuple[slice, ...], expected: torch.Tensor, tol: Tolerance,
                 narrow: bool, bounds: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`_bound` of ``expected``, the slice ``full[slices]``, as views of the bounds of the
    whole reference tensor, worked out once per (tensor, tolerance, width) and shared by every
    slice of every layout (elementwise, so a slice of the whole's bounds is the slice's bounds;
    a whole that is not finite leaves each slice to its own, so a finite slice keeps its cheap
    comparison).  The whole's allowed difference and magnitude go into ``bounds``, for
    :func:`_out_of_bound` to slice when a result leaves its bounds."""
    whole = _whole_of(full, tol, narrow)
    if whole[0] is None:
        return _bound(expected, tol, narrow, bounds)
    bounds[("whole", tol.rtol, tol.atol)] = (whole[1], whole[2], slices)   # sliced when out of bound
    return whole[0][0][slices], whole[0][1][slices]


def _whole_of(full: torch.Tensor, tol: Tolerance, narrow: bool) -> tuple:
    """:func:`_whole_bound` of ``full``, remembered per (tensor, tolerance, width)."""
    whole = recalled(_WHOLE, (id(full), tol.rtol, tol.atol, narrow), full)
    if whole is None:
        whole = remembered(_WHOLE, (id(full), tol.rtol, tol.atol, narrow), full,
                           lambda: _whole_bound(full, tol, narrow), limit=1024)
    return whole


def _whole_bound(full: torch.Tensor, tol: Tolerance, narrow: bool) -> tuple:
    """((low, high), allowed, magnitude) of the whole tensor ``full`` (:func:`_bound`), or
    (None,) where it has no cheap bounds (not float64, or not finite)."""
    kept: dict = {}
    found = _bound(full, tol, narrow, kept)
    if found is None:
        return (None,)
    return found, kept[("allowed", tol.rtol, tol.atol)], full.abs().clamp_min(_TINY)


def _bound(expected: torch.Tensor, tol: Tolerance, narrow: bool,
           bounds: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The lowest and highest value each element may take, ``expected -/+ (atol + rtol *
    |expected|)`` in float64, for the cheap passing comparison (a value is in bounds when
    clamping it to them leaves it unchanged: two ops where the difference, its magnitude, the
    comparison and the reduction took four and a sync), or None where only ``compare`` may
    decide: a slice that is not float64 or holds an inf or NaN.  ``narrow``: for a result of
    float32 or narrower, the bounds in float32 rounded inward (:func:`_inward_float32`), or in
    float64 where some element's bounds hold no float32 (an exact tolerance on a value float32
    cannot hold).  The allowed difference ``atol + rtol * |expected|`` is kept in ``bounds``
    (the slice's) for :func:`_out_of_bound`."""
    if expected.dtype != torch.float64 or not bool(torch.isfinite(expected).all()):
        return None
    allowed = bounds[("allowed", tol.rtol, tol.atol)] = expected.abs().mul_(tol.rtol).add_(tol.atol)
    low, high = expected - allowed, expected + allowed
    return (_inward_float32(low, high) if narrow else None) or (low, high)


def _inward_float32(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The float64 bounds ``low``, ``high`` as float32 bounds holding the same float32 values:
    the lowest float32 at or above ``low``, the highest at or below ``high`` (a float32 value,
    exact in float64, is at or above ``low`` exactly when it is at or above the first float32
    there); None where some element's interval holds no float32."""
    low32, high32 = low.to(torch.float32), high.to(torch.float32)
    low32 = torch.where(low32.to(torch.float64) < low, torch.nextafter(low32, low32.new_tensor(float("inf"))), low32)
    high32 = torch.where(high32.to(torch.float64) > high, torch.nextafter(high32, high32.new_tensor(float("-inf"))),
                         high32)
    return (low32, high32) if bool((low32 <= high32).all()) else None
