"""Where in a tensor a rank's result is wrong, reduced to a grid small enough to draw.

A tensor is drawn as 2-D panels: its last two dims (a 1-D tensor is one row, a scalar one cell),
one panel per index of the dims before them (at most ``MAX_PANELS`` of them), each cut into at most
``MAX_ROWS`` x ``MAX_COLS`` cells of whole elements. :func:`reduce_to_cells` puts any
per-element values of the whole tensor on that grid, each cell the largest of its elements'.

A failing check keeps, per rank and tensor, its :class:`ErrorMap`: each element's error over the
error the tolerance allows there, NaN outside the rank's block, so a drawing places every rank's
block where it sits in the whole tensor. Kept only while :func:`keep_error_maps` is active (a
report asked for them): a passing comparison never reaches this module, and a run that finds
thousands of failures on purpose (an audit, the mutants) keeps no grids it will not draw.
"""

from __future__ import annotations

import array
import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["MAX_PANELS", "Panels", "ErrorMap", "panels", "panels_showing", "reduce_to_cells", "keep_error_maps",
           "error_maps_kept", "error_map"]

MAX_PANELS = 8
MAP_PANELS = 4   # an error map's: the panels with a rank's largest errors
MAX_ROWS = 16
MAX_COLS = 32

_LOCK = threading.Lock()
_KEPT = [0]   # how many keep_error_maps blocks are active (ranks may run as threads)


@dataclass(frozen=True)
class Panels:
    """How a tensor of ``shape`` is drawn: of its ``total`` panels (one per index of the dims
    before the last two) the ``chosen`` ones, by number in row-major order, each ``rows`` x
    ``cols`` elements cut into cells at the element ranges ``row_cells`` and ``col_cells``."""

    shape: tuple[int, ...]
    chosen: tuple[int, ...]
    total: int
    rows: int
    cols: int
    row_cells: tuple[tuple[int, int], ...]
    col_cells: tuple[tuple[int, int], ...]

    @property
    def cells_per_panel(self) -> int:
        return len(self.row_cells) * len(self.col_cells)

    def index(self, number: int) -> tuple[int, ...]:
        """Panel ``number``'s indices into the dims before the last two."""
        found = []
        for size in reversed(self.shape[:-2]):
            number, at = divmod(number, size)
            found.append(at)
        return tuple(reversed(found))


def _cuts(size: int, most: int) -> tuple[tuple[int, int], ...]:
    """``size`` elements in at most ``most`` runs of whole elements, as even as they come."""
    count = max(1, min(size, most))
    return tuple((size * i // count, size * (i + 1) // count) for i in range(count))


def panels(shape: Sequence[int], chosen: Sequence[int] | None = None) -> Panels:
    """The panels and cells a tensor of ``shape`` is drawn in (module docstring): the panels
    ``chosen`` (default: the first MAX_PANELS)."""
    shape = tuple(int(n) for n in shape)
    rows, cols = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[0] if shape else 1)
    total = math.prod(shape[:-2])
    chosen = tuple(range(min(total, MAX_PANELS))) if chosen is None else tuple(sorted(set(chosen)))[:MAX_PANELS]
    return Panels(shape, chosen, total, rows, cols, _cuts(rows, MAX_ROWS), _cuts(cols, MAX_COLS))


def panels_showing(values: torch.Tensor, most: int = MAX_PANELS) -> tuple[int, ...]:
    """The panels of a tensor shaped as ``values`` that hold its largest values (NaN: nothing
    there), at most ``most`` of them."""
    if values.dim() < 3 or not values.numel():
        return (0,)
    flat = torch.nan_to_num(values.detach().to(torch.float64).reshape(math.prod(values.shape[:-2]), -1),
                            nan=-math.inf).amax(dim=1)
    held = [i for i in flat.argsort(descending=True, stable=True).tolist() if flat[i] > -math.inf]
    return tuple(held[:most]) or (0,)


def reduce_to_cells(values: torch.Tensor, grid: Panels) -> tuple[float, ...]:
    """``values`` (a float tensor of ``grid.shape``; NaN: nothing there) on the grid, panel by
    panel, row by row: each cell the largest value of its elements that is not NaN, NaN when
    they all are (no value is -inf)."""
    if not values.numel():
        return (math.nan,) * (len(grid.chosen) * grid.cells_per_panel)
    flat = values.detach().to(torch.float64).reshape(-1, grid.rows, grid.cols)[list(grid.chosen)]
    flat = torch.nan_to_num(flat, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    bands = torch.stack([flat[:, top:bottom].amax(dim=1) for top, bottom in grid.row_cells], dim=1)
    cells = torch.stack([bands[:, :, left:right].amax(dim=2) for left, right in grid.col_cells], dim=2)
    return tuple(math.nan if c == -math.inf else c for c in cells.flatten().tolist())


@dataclass(frozen=True)
class ErrorMap:
    """One rank's error in one tensor (``tensor``: "output", "grad of weight") of ``shape``, on
    ``panels(shape, chosen)`` (the panels of the rank's block with its largest errors): per cell the largest ratio of an element's error to the error its
    tolerance allows (above 1: out of tolerance; inf: a NaN or inf where the reference has
    another value), NaN outside the rank's block."""

    rank: int
    tensor: str
    shape: tuple[int, ...]
    chosen: tuple[int, ...]
    packed: bytes   # the cells as float32 (a failing run may keep thousands of maps)

    @property
    def cells(self) -> tuple[float, ...]:
        return tuple(array.array("f", self.packed))

    @property
    def grid(self) -> Panels:
        return panels(self.shape, self.chosen)

    @property
    def worst(self) -> float:
        found = [c for c in self.cells if not math.isnan(c)]
        return max(found) if found else math.nan


@contextlib.contextmanager
def keep_error_maps() -> Iterator[None]:
    """Failing comparisons inside the block keep their error maps (a report will draw them)."""
    with _LOCK:
        _KEPT[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _KEPT[0] -= 1


def error_maps_kept() -> bool:
    return _KEPT[0] > 0


def error_map(rank: int, tensor: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float,
              shape: Sequence[int], where: tuple[slice, ...]) -> ErrorMap:
    """The map of ``actual`` against ``expected`` (the rank's block, at ``where`` in a tensor of
    ``shape``), errors measured as :func:`~shardverify.verify.tolerance.compare` measures them."""
    wide = torch.float64 if not (actual.is_complex() or expected.is_complex()) else torch.complex128
    got, want = actual.detach().to(wide), expected.detach().to(wide)
    diff = (got - want).abs()
    allowed = want.abs().mul(rtol).add(atol)
    ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / allowed)
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    ratio = torch.where(same, torch.zeros_like(ratio), ratio)
    ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)
    whole = torch.full(tuple(shape), math.nan, dtype=torch.float64)
    whole[where] = ratio.real if ratio.is_complex() else ratio
    grid = panels(shape, panels_showing(whole, MAP_PANELS))
    return ErrorMap(rank, tensor, grid.shape, grid.chosen, array.array("f", reduce_to_cells(whole, grid)).tobytes())
