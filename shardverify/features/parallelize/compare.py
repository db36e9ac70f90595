"""Rounding or a bug: each value of the parallelized run against the single-device model computed
in float64 (the truth), allowed what the single device itself errs by in the training dtype.

A parallelized model adds and multiplies in another order than the single device (a row-parallel
projection sums partial products, a sequence-parallel norm's gradient is reduced across ranks), so
it cannot match the single device bit for bit; but it computes in the same dtype, so its distance
from the truth is of the size of the single device's own. The budget of each value is
``max(FACTOR x |single - truth|, the dtype's tolerance at the value's scale)``; a wrong layout, a
missing reduction or a partial sum taken whole errs by the size of the value itself and leaves it
by orders of magnitude. A value a rank holds as a shard of the module's output (a column-parallel
layer's local output) is compared with the rank's block of the truth (torch.chunk's blocks along
the one dim whose size differs, or a packed projection's blocks of each half)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shardverify.verify.tolerance import tolerance_for

__all__ = ["Finding", "Margin", "FACTOR", "compare_values", "budget", "reading", "dp_shares"]

#: how many times the single device's own rounding a parallelized value may err by
FACTOR = 8.0


@dataclass(frozen=True)
class Finding:
    """One value that left its budget (or has another shape, or is missing) on one rank."""

    phase: str          # "forward" | "inference" | "loss" | "gradient" | "weights"
    what: str           # module output key, parameter name or "loss"
    rank: int
    kind: str           # "values" | "shape" | "missing"
    error: float        # the largest absolute error against the truth
    budget: float
    single: float       # the single device's own error there
    scale: float        # the truth's largest magnitude
    step: int = 0
    layout: str = ""    # how the rank's value was read ("" whole; "block 1 of 2 on dim 2")
    shape: tuple = ()
    expected_shape: tuple = ()

    def line(self) -> str:
        where = f"{self.phase}" + (f" (step {self.step + 1})" if self.phase in ("loss", "gradient", "weights") else "")
        if self.kind == "shape":
            return (f"{where}: {self.what} on rank {self.rank} has shape {list(self.shape)}, which no block of "
                    f"the single device's {list(self.expected_shape)} has")
        if self.kind == "missing":
            return f"{where}: {self.what} on rank {self.rank}: present on one side only"
        return (f"{where}: {self.what} on rank {self.rank}: max abs error {self.error:.3g} against a budget of "
                f"{self.budget:.3g} (the single device's own rounding {self.single:.3g}, values up to {self.scale:.3g})"
                + (f", read as {self.layout}" if self.layout else ""))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    if a.is_complex() or b.is_complex():   # both parts compared (a cast to a real dtype drops the imaginary)
        a, b = (torch.view_as_real(t.detach().to(torch.complex128)) for t in (a, b))
    diff = (a.detach().to(torch.float64) - b.detach().to(torch.float64)).abs()
    if not torch.isfinite(diff).all():
        same_nonfinite = (~torch.isfinite(a.double())) & (a.double() == b.double())
        diff = torch.where(same_nonfinite, torch.zeros_like(diff), diff)
        diff = torch.nan_to_num(diff, nan=float("inf"))
    return float(diff.max())


def _coarser(value_dtype: torch.dtype, run_dtype: torch.dtype) -> torch.dtype:
    """The precision a value carries: its own dtype's or the run's, whichever is coarser (a loss taken
    in float32 of bfloat16 logits carries bfloat16's rounding)."""
    if not value_dtype.is_floating_point:
        return run_dtype
    return max(value_dtype, run_dtype, key=lambda d: torch.finfo(d).eps)


def budget(single_error: float, scale: float, dtype: torch.dtype) -> float:
    tol = tolerance_for(dtype)
    return max(FACTOR * single_error, tol.atol + tol.rtol * scale)


def _block(t: torch.Tensor, parts: int, dim: int, index: int) -> torch.Tensor:
    """torch.chunk's (and DTensor's) block ``index`` of ``parts`` along ``dim``; empty past the last."""
    chunks = torch.chunk(t, parts, dim)
    return chunks[index] if index < len(chunks) else t.narrow(dim, 0, 0)


def _blocks(truth: torch.Tensor, shape: tuple, parts: int, index: int) -> Iterator[tuple[str, object]]:
    """Ways a rank's local value of ``shape`` can be its block of ``truth``: the whole, torch.chunk's
    block ``index`` of ``parts`` along the one dim that differs, or a packed (gate/up, q/k/v) layout."""
    if tuple(truth.shape) == tuple(shape):
        yield "", lambda t: t
        return
    if truth.dim() != len(shape):
        return
    differing = [d for d in range(truth.dim()) if truth.shape[d] != shape[d]]
    if len(differing) != 1 or parts <= 1:
        return
    dim = differing[0]
    yield f"block {index + 1} of {parts} on dim {dim}", lambda t, d=dim: _block(t, parts, d, index)
    for packed in (2, 3):
        if truth.shape[dim] % packed == 0:
            def take(t, d=dim, k=packed):
                return torch.cat([_block(part, parts, d, index) for part in torch.chunk(t, k, d)], d)
            yield f"block {index + 1} of {parts} of each of {packed} packed parts on dim {dim}", take


@dataclass
class Margin:
    """The value that came closest to its budget (or went furthest past it)."""

    ratio: float = 0.0
    what: str = ""
    error: float = 0.0
    budget: float = 0.0
    single: float = 0.0

    def note(self, what: str, error: float, allowed: float, own: float) -> None:
        ratio = error / allowed if allowed > 0 else (0.0 if error == 0 else math.inf)
        if ratio > self.ratio:
            self.ratio, self.what, self.error, self.budget, self.single = ratio, what, error, allowed, own


def _best(value: torch.Tensor, truth: torch.Tensor, single: torch.Tensor, dtype: torch.dtype, tp: int, index: int,
          floor: float = 0.0):
    """``(within, error, layout, budget, own, scale)`` of the reading of ``value`` closest to ``truth``
    (None: no block of ``truth`` has its shape)."""
    best = None
    for layout, take in _blocks(truth, tuple(value.shape), tp, index):
        want, mine = take(truth), take(single)
        if tuple(want.shape) != tuple(value.shape):
            continue
        scale = float(want.detach().abs().max()) if want.numel() else 0.0
        own = _err(mine, want)
        allowed = max(budget(own, scale, _coarser(value.dtype, dtype)), floor)
        error = _err(value, want)
        candidate = (error <= allowed, error, layout, allowed, own, scale)
        if best is None or (candidate[0], -candidate[1]) > (best[0], -best[1]):
            best = candidate
        if candidate[0]:
            break
    return best


def dp_shares(value: torch.Tensor, mine: torch.Tensor, dp: int, index: int) -> list[torch.Tensor]:
    """What a data-parallel rank may hold of a single-device ``value``: its block of each dim where
    its own value ``mine`` holds a dp-th of it (the batch; the batch flattened with the sequence, an
    MoE router's tokens; the batch behind a stack of streams, Gemma 3n's altup), then the whole (a
    value of no batch, or a rank given the whole batch). Which one it holds is read from the values:
    a tensor-parallel shard can halve a dim as the data-parallel split does."""
    if dp == 1 or value.dim() == 0 or mine.dim() != value.dim():
        return [value]
    shares = []
    for d in range(value.dim()):
        rows = mine.shape[d]
        if rows * dp != value.shape[d]:
            continue
        # the batch's block, or its block within each of k groups (experts x tokens, flattened)
        for groups in (k for k in range(1, rows + 1) if rows % k == 0):
            shares.append(value.unflatten(d, (groups, dp, rows // groups)).select(d + 1, index).flatten(d, d + 1))
    return shares + [value]


def reading(found: list[torch.Tensor], truth: torch.Tensor, single: torch.Tensor, dtype: torch.dtype, tp: int,
            tp_index, dp: int = 1) -> str | None:
    """How every rank holds ``truth`` ("the whole value", "block 1 of 2 on dim 2" on rank 0), or None
    when some rank holds no block of it within its budget; with ``dp`` > 1 (ranks dp-major), each
    rank is held to its data-parallel share (:func:`dp_shares`)."""
    layouts = []
    for rank, value in enumerate(found):
        index = rank // (len(found) // dp) if dp > 1 else 0
        shares = zip(dp_shares(truth, value, dp, index), dp_shares(single, value, dp, index))
        best = next((b for b in (_best(value, t, s, dtype, tp, tp_index(rank)) for t, s in shares) if b and b[0]), None)
        if best is None or not best[0]:
            return None
        layouts.append(best[2])
    return f"{layouts[0]} on rank 0" if layouts and layouts[0] else "the whole value on every rank"


def _partial_sum(found: list, truth: torch.Tensor, single: torch.Tensor, dtype: torch.dtype, tp: int) -> bool:
    """Every tensor-parallel group's values sum to the truth: a module value held as a partial sum that
    a later reduction completes (transformers' identity expert, pre-divided by the ranks it is summed
    over). Not wrong by itself: if nothing completes it, the values after it differ."""
    if tp <= 1 or len(found) % tp or any(v is None or tuple(v.shape) != tuple(truth.shape) for v in found):
        return False
    for start in range(0, len(found), tp):
        total = sum(v.double() for v in found[start:start + tp])
        best = _best(total, truth, single, dtype, 1, 0)
        if best is None or not best[0]:
            return False
    return True


def compare_values(phase: str, what: str, found: list[torch.Tensor | None], truth: torch.Tensor | None,
                   single: torch.Tensor | None, dtype: torch.dtype, tp: int, tp_index, step: int = 0,
                   margin: Margin | None = None, floor: float = 0.0) -> list[Finding]:
    """Findings for each rank's ``found`` against ``truth``; ``tp_index(rank)`` is the rank's place on
    the tensor-parallel axis (its block of a local shard); ``margin`` notes the closest call; ``floor``
    the least budget (a weight after optimizer steps: a fraction of the steps' size)."""
    mine = Margin()
    out = _compared(phase, what, found, truth, single, dtype, tp, tp_index, step, mine, floor)
    if out and phase in ("forward", "inference") and truth is not None and \
            _partial_sum(found, truth, single, dtype, tp):
        return []
    if margin is not None and mine.ratio > margin.ratio:
        margin.note(mine.what, mine.error, mine.budget, mine.single)
    return out


def _compared(phase: str, what: str, found: list, truth, single, dtype: torch.dtype, tp: int, tp_index, step: int,
              margin: Margin | None, floor: float) -> list[Finding]:
    out: list[Finding] = []
    for rank, value in enumerate(found):
        if value is None or truth is None:
            if (value is None) != (truth is None):
                out.append(Finding(phase, what, rank, "missing", float("inf"), 0.0, 0.0, 0.0, step))
            continue
        best = _best(value, truth, single, dtype, tp, tp_index(rank), floor)
        if best is None:
            out.append(Finding(phase, what, rank, "shape", float("inf"), 0.0, 0.0, 0.0, step,
                               shape=tuple(value.shape), expected_shape=tuple(truth.shape)))
        else:
            _, error, layout, allowed, own, scale = best
            if margin is not None:
                margin.note(f"{phase} {what}", error, allowed, own)
            if not best[0]:
                out.append(Finding(phase, what, rank, "values", error, allowed, own, scale, step, layout))
    return out
