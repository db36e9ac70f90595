"""The meshes exploration draws: 1-D to 3-D shapes, axes of size 1 included, of at least 2 and at
most ``mesh_max_size`` devices (or $WORLD_SIZE under torchrun): a mesh of one device shards nothing,
so nothing drawn on it would be checked (and an op spec refuses it)."""

from __future__ import annotations

import itertools
import math
import os

from hypothesis import strategies as st

from shardverify.errors import InvalidArgument

__all__ = ["MAX_MESH_SIZE", "DEFAULT_MESH_MAX_SIZE", "MAX_MESH_NDIM", "world_size", "all_mesh_shapes",
           "mesh_shapes", "check_mesh_max_size"]

MAX_MESH_SIZE = 8
DEFAULT_MESH_MAX_SIZE = 4
MAX_MESH_NDIM = 3


def world_size(default: int = DEFAULT_MESH_MAX_SIZE) -> int:
    """Devices a drawn mesh may use: $WORLD_SIZE when set (torchrun), else ``default``."""
    text = os.environ.get("WORLD_SIZE")
    value = int(text) if text and text.isdigit() else default
    return max(2, min(value, MAX_MESH_SIZE))


def all_mesh_shapes(max_size: int = DEFAULT_MESH_MAX_SIZE,
                    max_ndim: int = MAX_MESH_NDIM) -> tuple[tuple[int, ...], ...]:
    """Every mesh shape of 1 to ``max_ndim`` axes (sizes >= 1) with 2 to ``max_size`` devices,
    simplest first: fewer axes, then fewer devices."""
    shapes = [shape for ndim in range(1, max_ndim + 1)
              for shape in itertools.product(range(1, max_size + 1), repeat=ndim) if 2 <= math.prod(shape) <= max_size]
    return tuple(sorted(shapes, key=lambda shape: (len(shape), math.prod(shape), shape)))


def mesh_shapes(max_size: int = DEFAULT_MESH_MAX_SIZE, max_ndim: int = MAX_MESH_NDIM) -> st.SearchStrategy:
    """Mesh shapes drawn evenly from :func:`all_mesh_shapes` (shrinking towards ``(2,)``)."""
    return st.sampled_from(all_mesh_shapes(max_size, max_ndim))


def check_mesh_max_size(mesh_max_size: object) -> int:
    if isinstance(mesh_max_size, bool) or not isinstance(mesh_max_size, int) or not (
            2 <= mesh_max_size <= MAX_MESH_SIZE):
        raise InvalidArgument(f"mesh_max_size={mesh_max_size!r} must be an int from 2 to {MAX_MESH_SIZE} (a mesh of "
                              "one device shards nothing)")
    return mesh_max_size
