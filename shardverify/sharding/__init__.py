"""The sharding vocabulary every other room speaks: the device mesh and its alpha-beta costs
(``mesh``, ``calibration_file``), tensor layouts on it (``sharding_spec``; ``layout``: with partial
values, shape-free or bound to shapes), strategies and the collectives they declare
(``strategy``), resharding between layouts (``reshard_plan``) and the index arithmetic of a
sharded vocabulary (``indexing``). Pure logic: no process, no collective runs here."""

from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.sharding_spec import DimSpec, ShardingSequence, ShardingSpec

__all__ = ["DeviceMesh", "DimSpec", "ShardingSequence", "ShardingSpec"]
