"""Resharding verification: every (source, target) layout pair of a mesh and tensor, pruned by
symmetry (``check``), and the "reshard" spec kind of ``specs/reshard/`` (``spec``). The maths
of a reshard lives in :mod:`shardverify.sharding.reshard_plan`, its execution in
:mod:`shardverify.collectives.reshard`."""
