"""Property-based exploration of an op spec with hypothesis, beyond the grid its author listed:
``draw`` derives sizes, parameters and meshes from the spec, ``search`` verifies what is drawn.
``from shardverify import explore`` gives both (the generated property tests use it so)."""

from shardverify.explore.draw import (DEFAULT_MESH_MAX_SIZE, MAX_MESH_SIZE, PROFILE_ENV, PROFILES, SIZES, Example,
                                      ParamDraw, SizeSlot, all_mesh_shapes, dims_strategy, examples, load_profile,
                                      load_spec, mesh_shapes, param_draws, param_strategies, profile_settings,
                                      size_groups, world_size)
from shardverify.explore.search import Failure, check_example, layout_problems, replay, search

__all__ = ["SIZES", "MAX_MESH_SIZE", "DEFAULT_MESH_MAX_SIZE", "PROFILE_ENV", "PROFILES", "load_profile",
           "profile_settings", "world_size", "load_spec", "SizeSlot", "size_groups", "dims_strategy",
           "ParamDraw", "param_draws", "param_strategies", "all_mesh_shapes", "mesh_shapes", "Example", "examples",
           "layout_problems", "check_example", "replay", "Failure", "search"]
