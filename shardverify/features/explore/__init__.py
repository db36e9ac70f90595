"""Property-based exploration of an op spec with hypothesis, beyond the grid its author listed:
``draw`` derives examples (sizes, with ``params`` and ``meshes``) from the spec under a hypothesis
``profiles`` setting, ``search`` verifies what is drawn.
``from shardverify.features import explore`` gives both (the generated property tests use it so)."""

from shardverify.features.explore.draw import SIZES, Example, SizeSlot, examples, load_spec, size_groups
from shardverify.features.explore.meshes import DEFAULT_MESH_MAX_SIZE, MAX_MESH_SIZE, all_mesh_shapes, mesh_shapes, world_size
from shardverify.features.explore.params import ParamDraw, dims_strategy, param_draws, param_strategies
from shardverify.features.explore.profiles import PROFILE_ENV, PROFILES, load_profile, profile_settings
from shardverify.features.explore.search import Failure, check_example, layout_problems, replay, search

__all__ = ["SIZES", "MAX_MESH_SIZE", "DEFAULT_MESH_MAX_SIZE", "PROFILE_ENV", "PROFILES", "load_profile",
           "profile_settings", "world_size", "load_spec", "SizeSlot", "size_groups", "dims_strategy",
           "ParamDraw", "param_draws", "param_strategies", "all_mesh_shapes", "mesh_shapes", "Example", "examples",
           "layout_problems", "check_example", "replay", "Failure", "search"]
