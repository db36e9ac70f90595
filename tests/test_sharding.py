import itertools
import math

import pytest
import torch

from shardverify import (
    DeviceMesh,
    DimOutOfRangeError,
    DimSpec,
    DuplicateMeshAxisError,
    MeshAxisOutOfRangeError,
    SequenceParseError,
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


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (4,), (5,), (6,), (2, 3), (3, 2), (4, 2), (2, 2, 2)])
@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 12])
def test_blocks_are_dtensors_every_rank_every_order(mesh_shape, size):
    """Each rank's block, uneven or even, in every shard order, is the one DTensor computes for
    that coordinate (``Shard`` on each mesh dim in order; a reversed order is DTensor's shard order:
    the dim split over the first listed axis first, checked against torch.chunk of chunks)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh = DeviceMesh(mesh_shape)
    full = torch.arange(size)
    for n in range(1, len(mesh_shape) + 1):
        for axes in itertools.permutations(range(len(mesh_shape)), n):
            spec = ShardingSpec.from_partition(mesh_shape, (size,), {0: axes})
            assert spec.is_even == (size % math.prod(mesh_shape[a] for a in axes) == 0)
            for rank in mesh.ranks:
                coord = mesh.coordinate(rank)
                (start, stop, _), = [s.indices(size) for s in spec.local_slices(mesh, rank)]
                blocks = [full]
                for axis in axes:    # torch.chunk of the block held so far, empty blocks at the end
                    chunks = list(torch.chunk(blocks[-1], mesh_shape[axis]))
                    chunks += [blocks[-1][:0]] * (mesh_shape[axis] - len(chunks))
                    blocks.append(chunks[coord[axis]])
                assert full[start:stop].tolist() == blocks[-1].tolist(), (axes, rank)
                assert spec.local_shape_on(mesh, rank) == (stop - start,)
                assert stop - start <= spec.local_shape()[0]
                if list(axes) == sorted(axes):
                    placements = [Shard(0) if a in axes else Replicate() for a in range(len(mesh_shape))]
                    shape, offset = _compute_local_shape_and_global_offset((size,), mesh_shape, list(coord), placements)
                    assert shape == (stop - start,) and (offset == (start,) or stop == start), (axes, rank)
            assert spec.local_shape_on(mesh, 0) == spec.local_shape()


def test_a_split_of_every_dim_over_two_axes_agrees_with_dtensor_on_a_2d_tensor():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh = DeviceMesh((2, 3))
    spec = ShardingSpec.parse("[S1, S0]", (7, 5), (2, 3))
    for rank in mesh.ranks:
        slices = spec.local_slices(mesh, rank)
        shape, offset = _compute_local_shape_and_global_offset((7, 5), (2, 3), list(mesh.coordinate(rank)),
                                                               [Shard(1), Shard(0)])
        assert tuple(s.stop - s.start for s in slices) == shape
        assert all(s.start == o or s.stop == s.start for s, o in zip(slices, offset))


@pytest.mark.parametrize("build,error,needles", [
    (lambda: ShardingSpec.from_partition((2, 2), (4, 4), {0: (0,), 1: (0,)}), DuplicateMeshAxisError,
     ["mesh axis 0", "(4, 4)", "(2, 2)"]),
    (lambda: ShardingSpec.from_partition((2, 2), (4, 4), {0: (1, 1)}), DuplicateMeshAxisError, ["used twice"]),
    (lambda: ShardingSpec.from_partition((2, 2), (4, 4), {2: (0,)}), DimOutOfRangeError, ["dim 2", "(4, 4)"]),
    (lambda: ShardingSpec.from_partition((2, 2), (4, 4), {-3: (0,)}), DimOutOfRangeError, ["dim -3"]),
    (lambda: ShardingSpec.from_partition((2, 2), (4, 4), {0: (2,)}), MeshAxisOutOfRangeError,
     ["mesh axis 2", "(2, 2)"]),
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


def test_equal_layouts_share_one_key_and_hash_however_built_and_across_pickling():
    """A check keys its slices and geometry by ``spec.key`` and hashes layouts and meshes once:
    equal layouts written differently (a negative dim, another order, empty axes) must agree on
    both, a copy sent through pickle too, and a layout of the same tensor on another mesh not."""
    import pickle

    one = ShardingSpec((2, 2), (4, 6, 8), ((2, (1,)), (-3, (0,))))
    other = ShardingSpec.from_partition((2, 2), (4, 6, 8), {0: (0,), 1: (), 2: (1,)})
    copied = pickle.loads(pickle.dumps(one))
    assert one == other == copied
    assert one.key == other.key == copied.key == ((2, 2), (4, 6, 8), ((0, (0,)), (2, (1,))))
    assert hash(one) == hash(other) == hash(copied) == hash(one.key)
    elsewhere = ShardingSpec((4,), (4, 6, 8), ((0, (0,)),))
    assert elsewhere.key != one.key and elsewhere != one
    mesh = DeviceMesh((2, 2))
    assert hash(mesh) == hash(pickle.loads(pickle.dumps(mesh))) == hash(DeviceMesh([2, 2]))
    assert DeviceMesh((2, 2), alpha=(1.0, 1.0)) != mesh
