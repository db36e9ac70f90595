"""Comparison tolerances per dtype, and the one closeness rule every check uses.

The defaults follow ``torch.testing.assert_close`` so a sharded result is held to the
same standard as any other PyTorch numerical test; a spec may override them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardverify.errors import InvalidArgument
from shardverify.spec.fields import dtype_from_name

__all__ = ["Tolerance", "SummedTolerance", "DEFAULT_TOLERANCES", "tolerance_for", "compare", "max_error", "is_close",
           "as_real", "max_abs_difference", "own_error"]


@dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise."""

    rtol: float
    atol: float

    def __post_init__(self) -> None:
        for field in ("rtol", "atol"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise InvalidArgument(f"{field} must be a number >= 0, got {value!r}")
            object.__setattr__(self, field, float(value))

    def __str__(self) -> str:
        return f"rtol={self.rtol:.3g}, atol={self.atol:.3g}"


DEFAULT_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(rtol=1e-7, atol=1e-7),
    torch.float32: Tolerance(rtol=1.3e-6, atol=1e-5),
    # a complex value is two of its real dtype, compared part by part (``as_real``)
    torch.complex128: Tolerance(rtol=1e-7, atol=1e-7),
    torch.complex64: Tolerance(rtol=1.3e-6, atol=1e-5),
    torch.complex32: Tolerance(rtol=1e-3, atol=1e-5),   # two float16s (Tensor.chalf)
    torch.bfloat16: Tolerance(rtol=1.6e-2, atol=1e-5),
    torch.float16: Tolerance(rtol=1e-3, atol=1e-5),
}


def tolerance_for(dtype: str | torch.dtype, rtol: float | None = None, atol: float | None = None) -> Tolerance:
    """The default tolerance of a floating dtype, with ``rtol``/``atol`` overriding either part."""
    dtype = dtype_from_name(dtype)
    if dtype not in DEFAULT_TOLERANCES:
        if dtype.is_floating_point or dtype.is_complex:
            raise InvalidArgument(f"no default tolerance for {dtype}; pass rtol and atol")
        base = Tolerance(0.0, 0.0)  # integer and bool results must be exact
    else:
        base = DEFAULT_TOLERANCES[dtype]
    return Tolerance(base.rtol if rtol is None else rtol, base.atol if atol is None else atol)


@dataclass(frozen=True)
class Comparison:
    """The outcome of comparing one tensor with its reference; ``nonfinite`` describes the
    first non-finite disagreement (inf against a number, +inf against -inf, NaN where the
    reference is not NaN or the reverse), with its index, when there is one."""

    close: bool
    max_abs_err: float
    max_rel_err: float
    nonfinite: str = ""


def _index_of(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat_index, rest = divmod(flat_index, size)
        index.append(rest)
    return tuple(reversed(index))


def _nonfinite_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """"" when the non-finite values agree exactly (inf with inf of the same sign, NaN with
    NaN, at the same positions); else what differs at the first such index."""
    a_nan, e_nan = actual.isnan(), expected.isnan()
    a_inf, e_inf = actual.isinf(), expected.isinf()
    bad = (a_inf | e_inf) & (actual != expected)          # inf vs number, or +inf vs -inf
    bad |= a_nan ^ e_nan                                  # NaN on one side only
    if not bad.any():
        return ""
    flat = int(bad.flatten().nonzero()[0])
    index = _index_of(flat, tuple(actual.shape))
    got, want = float(actual.flatten()[flat]), float(expected.flatten()[flat])
    return (f"{int(bad.sum())} non-finite mismatch(es), first at index {list(index)}: "
            f"got {got!r}, expected {want!r}")


def as_real(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float64, a complex one as its real and imaginary parts (a trailing dim of 2):
    the values every comparison looks at (``.to(float64)`` would drop the imaginary part)."""
    tensor = tensor.detach()
    if tensor.is_complex():   # a conjugate view (torch.conj's) resolved first: view_as_real refuses it
        return torch.view_as_real(tensor.to(torch.complex128).resolve_conj())
    return tensor.to(torch.float64)


def max_abs_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest finite ``|actual - expected|`` (0.0 when none is finite): a low-precision
    result's error against its float64 counterpart, where an inf both sides share says nothing."""
    diff = (as_real(actual) - as_real(expected)).abs_()
    if not diff.numel():
        return 0.0
    worst = float(diff.max())
    if math.isfinite(worst):   # the common case, without the copy a mask makes
        return worst
    finite = diff[torch.isfinite(diff)]
    return float(finite.max()) if finite.numel() else 0.0


def own_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """What a low-precision result owns as its error against its float64 ``expected``: its largest
    difference, and no less than rounding the largest finite expected value once into its dtype
    (the unit roundoff times it). A few elements' measured error is a few draws of that rounding,
    which may all fall near zero (a 0-d sum's one draw) far below what rounding it may lose."""
    found = max_abs_difference(actual, expected)
    if not (actual.is_floating_point() or actual.is_complex()) or not expected.numel():
        return found
    real = as_real(expected).abs()
    largest = float(real.max())
    if not math.isfinite(largest):
        finite = real[torch.isfinite(real)]
        largest = float(finite.max()) if finite.numel() else 0.0
    return max(found, torch.finfo(actual.dtype).eps / 2 * largest)


def compare(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> Comparison:
    """Compare in float64 (``expected`` is the float64 reference); shapes must already match.

    Finite values must be within ``tol``; non-finite values must agree exactly: an inf
    matches only an inf of the same sign at the same position, a NaN only a NaN at the same
    position (an op whose reference legitimately has NaN, log of a negative number, passes
    when the sharded run has NaN exactly there)."""
    actual, expected = as_real(actual), as_real(expected)
    if actual.numel() == 0:
        return Comparison(True, 0.0, 0.0)
    both_finite = torch.isfinite(actual) & torch.isfinite(expected)
    nonfinite = "" if bool(both_finite.all()) else _nonfinite_mismatch(actual, expected)
    zero = torch.zeros((), dtype=torch.float64)
    diff = torch.where(both_finite, actual - expected, zero).abs()
    finite_expected = torch.where(both_finite, expected, zero)
    rel = diff / finite_expected.abs().clamp_min(torch.finfo(torch.float64).tiny)
    max_abs, max_rel = float(diff.max()), float(rel.max())
    if nonfinite:
        max_abs = max_rel = float("inf")
    return Comparison(not nonfinite and _within(diff, finite_expected, tol), max_abs, max_rel, nonfinite)


def _within(diff: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> bool:
    """The finite part of the rule: ``diff <= atol + rtol * |expected|`` everywhere."""
    return bool((diff <= tol.atol + tol.rtol * expected.abs()).all())


def is_close(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, *, finite: bool | None = None) -> bool:
    """``compare(actual, expected, tol).close`` (False for another shape), cheaply: callers that
    only need the verdict, many times over (the audit), get verify's rule without the error
    figures.  Where ``expected`` is finite the tolerance check alone is that rule (a NaN or inf
    in ``actual`` breaks it); an inf or NaN in ``expected`` goes through :func:`compare`.
    ``finite``: whether ``expected`` is all finite, when the caller knows (None: checked here)."""
    if actual.shape != expected.shape:
        return False
    if not actual.numel():
        return True
    if actual.dtype != torch.float64:
        actual = as_real(actual)
    if expected.dtype != torch.float64:
        expected = as_real(expected)
    if finite is None:
        finite = bool(torch.isfinite(expected).all())
    if finite and math.isfinite(tol.atol) and math.isfinite(tol.rtol):
        return _within((actual - expected).abs(), expected, tol)
    return compare(actual, expected, tol).close


@dataclass(frozen=True)
class SummedTolerance(Tolerance):
    """``|actual - expected| <= atol + rtol * (|expected| + max |expected|)``: a value computed
    below float64 whose elements are sums of terms (a gradient), each keeping the rounding of its
    terms (the tensor's largest element standing in for them), not of its sum. A sharding bug (a
    missing or doubled reduction) is off by the values themselves, far outside it."""


_CHUNK = 1 << 20


def max_error(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> float | None:
    """:func:`compare`'s rule, a million elements at a time (comparing a whole weight at once held
    two float64 copies of it): the largest absolute error of the chunks out of ``tol`` (inf for a
    non-finite disagreement), or None when ``actual`` is close to ``expected``. Bool and integer
    values are compared exactly; shapes must already match."""
    with torch.no_grad():
        got, want = actual.detach().reshape(-1), expected.detach().reshape(-1)
        exact = not (got.is_floating_point() or got.is_complex()) and not (want.is_floating_point()
                                                                           or want.is_complex())
        if exact:
            tol = Tolerance(0.0, 0.0)
        elif isinstance(tol, SummedTolerance) and want.numel():
            largest = max(float(as_real(want[start:start + _CHUNK]).abs().nan_to_num(0.0, 0.0, 0.0).max())
                          for start in range(0, want.numel(), _CHUNK))
            tol = Tolerance(tol.rtol, tol.atol + tol.rtol * largest)
        worst = None
        for start in range(0, got.numel(), _CHUNK):
            found = compare(got[start:start + _CHUNK], want[start:start + _CHUNK], tol)
            if not found.close:
                worst = max(worst or 0.0, found.max_abs_err)
        return worst
