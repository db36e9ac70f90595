"""A failing check keeps, while a report asks for it, where in the whole tensor each rank's values
are wrong: the grid cuts the tensor into whole elements, a rank's block lands where it sits, and
nothing is kept otherwise."""

from __future__ import annotations

import math

import pytest
import torch

from shardverify import DeviceMesh
from shardverify.backends import SimulatedBackend
from shardverify.verify.engine import verify_case
from shardverify.verify.error_map import (MAX_PANELS, error_map, keep_error_maps, panels, panels_showing,
                                          reduce_to_cells)

from test_verify_broken import LINEAR, drop_required_all_reduces, generated


def test_the_grid_cuts_whole_elements_and_keeps_every_one():
    grid = panels((3, 5, 40, 7))
    assert grid.total == 15 and grid.chosen == tuple(range(MAX_PANELS))
    assert grid.row_cells[0][0] == 0 and grid.row_cells[-1][1] == 40 and len(grid.row_cells) == 16
    assert all(a[1] == b[0] for a, b in zip(grid.row_cells, grid.row_cells[1:]))
    assert grid.col_cells == tuple((i, i + 1) for i in range(7))
    assert grid.index(7) == (1, 2)
    assert panels(()).cells_per_panel == 1 and panels((9,)).rows == 1


def test_cells_take_the_largest_value_and_nan_only_where_nothing_is():
    values = torch.full((2, 4, 4), math.nan)
    values[1, 2, 3] = 5.0
    values[1, 0, 0] = 1.0
    grid = panels(values.shape, panels_showing(values))
    assert grid.chosen == (1,)
    cells = reduce_to_cells(values, grid)
    assert cells[2 * 4 + 3] == 5.0 and cells[0] == 1.0
    assert sum(not math.isnan(c) for c in cells) == 2


def test_a_block_lands_where_it_sits_in_the_whole_tensor():
    expected = torch.ones(4, 6, dtype=torch.float64)
    actual = expected.clone()
    actual[1, 2] = 3.0   # off by 2 where 1e-3 is allowed
    drawn = error_map(3, "output", actual, expected, 0.0, 1e-3, (8, 6), (slice(4, 8), slice(0, 6)))
    cells = drawn.cells
    assert drawn.rank == 3 and drawn.shape == (8, 6)
    assert all(math.isnan(c) for c in cells[:4 * 6])           # rows 0-3: another rank's block
    assert cells[(4 + 1) * 6 + 2] == pytest.approx(2000.0)
    assert drawn.worst == pytest.approx(2000.0)
    assert sum(c == 0 for c in cells) == 4 * 6 - 1


def test_a_nan_where_a_number_belongs_is_infinitely_wrong_and_nan_against_nan_is_right():
    expected = torch.tensor([1.0, math.nan, 2.0], dtype=torch.float64)
    actual = torch.tensor([math.nan, math.nan, 2.0])
    drawn = error_map(0, "output", actual, expected, 1e-5, 1e-8, (3,), (slice(0, 3),))
    assert drawn.cells == (math.inf, 0.0, 0.0)


def test_maps_are_kept_only_while_asked_and_with_the_strategy():
    mesh = DeviceMesh((2, 2))
    broken, tensor = next(iter(drop_required_all_reduces(generated(LINEAR, mesh))))
    backend = SimulatedBackend(mesh)
    plain = verify_case(backend, LINEAR, [broken])[0]
    assert not plain.passed and plain.checked is None
    assert all(m.error_map is None for m in plain.mismatches)
    with keep_error_maps():
        kept = verify_case(backend, LINEAR, [broken])[0]
    assert kept.checked == broken
    values = [m for m in kept.mismatches if m.kind == "values"]
    assert values and all(m.error_map is not None and m.error_map.tensor == m.tensor for m in values)
    assert {m.tensor for m in values} == {tensor}
    assert all(m.error_map.worst > 1 for m in values)
