import pytest
import torch

from shardverify import (
    DeviceMesh,
    DimOutOfRangeError,
    DimSpec,
    DuplicateMeshAxisError,
    MeshAxisOutOfRangeError,
    SequenceParseError,
    ShardingNotDivisibleError,
    ShardingSpec,
    ShardingSpecError,
)


@pytest.mark.parametrize("text,shape,mesh", [
    ("[R, S0, R, S1]", (4, 4, 4, 16), (2, 2)),
    ("[S01, R]", (8, 3), (2, 2)),
    ("[S10]", (4,), (2, 2)),
    ("[R, S2, S0]", (3, 4, 2), (2, 1, 2)),
    ("[S012, R]", (8, 1), (2, 2, 2)),
    ("[R, R]", (3, 5), (4,)),
    ("[]", (), (2,)),
])
def test_parse_print_round_trip(text, shape, mesh):
    spec = ShardingSpec.parse(text, shape, mesh)
    assert str(spec) == text
    assert str(spec.sharding_sequence) == text
    again = ShardingSpec.from_partition(mesh, shape, spec.partition_dict())
    assert again == spec and hash(again) == hash(spec)


def test_partition_views_and_local_shape():
    spec = ShardingSpec.from_partition((2, 2), (4, 4, 4, 16), {1: (0,), -1: (1,)})
    assert spec.partition_dict() == {1: (0,), 3: (1,)}
    assert spec.shard_counts() == (1, 2, 1, 2)
    assert spec.local_shape() == (4, 2, 4, 8)
    assert spec.sharded_axes() == {0, 1}
    assert spec.sharding_sequence[1] == DimSpec((0,))
    assert str(spec.sharding_sequence[:-1]) == "[R, S0, R]"
    assert ShardingSpec.from_partition((2, 2), (8,), {0: (0, 1)}).local_shape() == (2,)
    assert ShardingSpec.from_partition((2, 2), (8,), {0: ()}) == ShardingSpec.replicated((2, 2), (8,))


@pytest.mark.parametrize("mesh_shape,text", [((2, 2), "[S0, S1]"), ((2, 2), "[S10, R]"),
                                             ((2, 2, 2), "[S2, S01]"), ((4,), "[R, S0]")])
def test_local_shards_tile_the_tensor(mesh_shape, text):
    mesh = DeviceMesh(mesh_shape)
    spec = ShardingSpec.parse(text, (8, 4), mesh_shape)
    full = torch.arange(32.0).reshape(8, 4)
    copies = torch.zeros_like(full)
    for rank in mesh.ranks:
        shard = spec.local_shard(full, mesh, rank)
        assert tuple(shard.shape) == spec.local_shape()
        copies[spec.local_slices(mesh, rank)] += 1
    replicas = mesh.size // spec.shard_counts()[0] // spec.shard_counts()[1]
    assert torch.equal(copies, torch.full_like(full, replicas))


def test_s01_and_s10_order_shards_differently():
    mesh = DeviceMesh((2, 2))
    s01 = ShardingSpec.parse("[S01]", (4,), (2, 2))
    s10 = ShardingSpec.parse("[S10]", (4,), (2, 2))
    assert [s01.local_slices(mesh, r)[0].start for r in mesh.ranks] == [0, 1, 2, 3]
    assert [s10.local_slices(mesh, r)[0].start for r in mesh.ranks] == [0, 2, 1, 3]


@pytest.mark.parametrize("build,error,needles", [
    (lambda: ShardingSpec.from_partition((2, 2), (4, 4), {0: (0,), 1: (0,)}), DuplicateMeshAxisError,
     ["mesh axis 0", "(4, 4)", "(2, 2)"]),
    (lambda: ShardingSpec.from_partition((2, 2), (4, 4), {0: (1, 1)}), DuplicateMeshAxisError, ["used twice"]),
    (lambda: ShardingSpec.from_partition((2, 2), (4, 4), {2: (0,)}), DimOutOfRangeError, ["dim 2", "(4, 4)"]),
    (lambda: ShardingSpec.from_partition((2, 2), (4, 4), {-3: (0,)}), DimOutOfRangeError, ["dim -3"]),
    (lambda: ShardingSpec.from_partition((2, 2), (4, 4), {0: (2,)}), MeshAxisOutOfRangeError,
     ["mesh axis 2", "(2, 2)"]),
    (lambda: ShardingSpec.from_partition((2, 2), (3, 4), {0: (0,)}), ShardingNotDivisibleError,
     ["dim 0 of size 3", "2 shards", "(3, 4)", "(2, 2)"]),
    (lambda: ShardingSpec.parse("R, S0", (4, 4), (2, 2)), SequenceParseError, ["bracketed"]),
    (lambda: ShardingSpec.parse("[R, X0]", (4, 4), (2, 2)), SequenceParseError, ["'X0'"]),
    (lambda: ShardingSpec.parse("[R]", (4, 4), (2, 2)), SequenceParseError, ["1 dims", "(4, 4)"]),
])
def test_every_error_class_names_the_problem(build, error, needles):
    with pytest.raises(error) as info:
        build()
    assert isinstance(info.value, ShardingSpecError)
    for needle in needles:
        assert needle in str(info.value)


def test_local_shard_rejects_wrong_tensor_or_mesh():
    spec = ShardingSpec.parse("[S0, R]", (4, 4), (2, 2))
    with pytest.raises(ShardingSpecError, match="shape"):
        spec.local_shard(torch.zeros(4, 2), DeviceMesh((2, 2)), 0)
    with pytest.raises(ShardingSpecError, match="mesh"):
        spec.local_slices(DeviceMesh((4,)), 0)
