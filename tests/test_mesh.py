import pytest

from shardverify import DeviceMesh, MeshError


@pytest.mark.parametrize("shape", [(4,), (2, 2), (1, 4), (2, 2, 2), (2, 3)])
def test_coordinate_and_rank_round_trip(shape):
    mesh = DeviceMesh(shape)
    coords = [mesh.coordinate(r) for r in mesh.ranks]
    assert len(set(coords)) == mesh.size
    assert all(mesh.rank_at(c) == r for r, c in enumerate(coords))
    assert coords == sorted(coords)  # row-major
    assert mesh.ndim == len(shape) and mesh.device_ids == tuple(range(mesh.size))


def test_coordinates_are_row_major_on_2d():
    mesh = DeviceMesh((2, 3))
    assert mesh.coordinate(4) == (1, 1)
    assert mesh.coordinate(2) == (0, 2)
    assert mesh.rank_at((1, 0)) == 3


def test_group_ranks_order_follows_axes():
    mesh = DeviceMesh((2, 2))
    assert mesh.group_ranks(0, (0,)) == (0, 2)
    assert mesh.group_ranks(3, (1,)) == (2, 3)
    assert mesh.group_ranks(0, (0, 1)) == (0, 1, 2, 3)
    assert mesh.group_ranks(0, (1, 0)) == (0, 2, 1, 3)
    assert [mesh.group_index(r, (1, 0)) for r in mesh.ranks] == [0, 2, 1, 3]
    assert mesh.groups((1,)) == ((0, 1), (2, 3))


@pytest.mark.parametrize("shape,axes", [((2, 2, 2), (0,)), ((2, 2, 2), (2, 0)), ((4,), (0,)), ((1, 4), (1,))])
def test_groups_partition_the_mesh(shape, axes):
    mesh = DeviceMesh(shape)
    groups = mesh.groups(axes)
    flat = sorted(r for g in groups for r in g)
    assert flat == list(mesh.ranks)
    assert all(len(g) == mesh.axes_size(axes) for g in groups)
    for rank in mesh.ranks:
        group = mesh.group_ranks(rank, axes)
        assert group[mesh.group_index(rank, axes)] == rank
        # members differ from rank only on the group's axes
        for other in group:
            diff = [i for i, (a, b) in enumerate(zip(mesh.coordinate(rank), mesh.coordinate(other))) if a != b]
            assert set(diff) <= set(axes)


def test_explicit_device_ids_and_costs():
    mesh = DeviceMesh((2, 2), device_ids=(4, 5, 6, 7), alpha=(1e-6, 2e-6), beta=(1e-9, 1e-9))
    assert mesh.device_ids == (4, 5, 6, 7)
    assert mesh.all_gather_cost(1000, (0,)) > 0
    assert mesh.all_reduce_cost(1000, (0,)) == pytest.approx(2 * mesh.reduce_scatter_cost(1000, (0,)))
    assert mesh.all_reduce_cost(1000, (1,)) > mesh.all_reduce_cost(1000, (0,))  # slower link
    assert mesh.all_reduce_cost(10_000, (0,)) > mesh.all_reduce_cost(1000, (0,))
    assert mesh.all_to_all_cost(1000, (0, 1)) > 0
    assert DeviceMesh((1, 4)).all_reduce_cost(1000, (0,)) == 0.0  # a group of one moves nothing


@pytest.mark.parametrize("kwargs,needle", [
    (dict(shape=()), "at least one axis"),
    (dict(shape=(2, 0)), "positive"),
    (dict(shape=(2, 2.0)), "2.0"),
    (dict(shape=(2, 2), device_ids=(0, 1, 2)), "needs 4"),
    (dict(shape=(2,), device_ids=(1, 1)), "duplicates"),
    (dict(shape=(2, 2), alpha=(1.0,)), "alpha"),
    (dict(shape=(2,), beta=(-1.0,)), "beta"),
])
def test_invalid_meshes_are_rejected(kwargs, needle):
    with pytest.raises(MeshError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        DeviceMesh(**kwargs)


def test_bad_ranks_and_axes_are_named():
    mesh = DeviceMesh((2, 2))
    with pytest.raises(MeshError, match="rank 4"):
        mesh.coordinate(4)
    with pytest.raises(MeshError, match="mesh axis 2"):
        mesh.group_ranks(0, (2,))
    with pytest.raises(MeshError, match="repeat"):
        mesh.axes_size((0, 0))
    with pytest.raises(MeshError, match="outside"):
        mesh.rank_at((2, 0))


def test_remembered_axes_and_prices_validate_like_the_first_call():
    """check_axes and collective_cost remember their answers: a bool axis (which hashes like
    0 or 1) must still be refused after the int was accepted, a refused call must stay refused,
    and a remembered price must equal the one worked out afresh."""
    mesh = DeviceMesh((2, 4), alpha=(1e-5, 2e-5), beta=(1e-10, 3e-10))
    assert mesh.check_axes((1,)) == (1,) and mesh.check_axes([0, 1]) == (0, 1)
    for _ in range(2):
        with pytest.raises(MeshError, match="True"):
            mesh.check_axes((True,))
        with pytest.raises(MeshError, match="repeat"):
            mesh.check_axes((1, 1))
        with pytest.raises(MeshError, match="True"):
            mesh.collective_cost("all_reduce", 64, (True,))
        with pytest.raises(MeshError, match="no alpha-beta model"):
            mesh.collective_cost("gossip", 64, (0,))
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        for axes in ((0,), (1,), (0, 1), (1, 0), ()):
            fresh = mesh._collective_cost(kind, 4096, axes)
            assert mesh.collective_cost(kind, 4096, axes) == fresh == mesh.collective_cost(kind, 4096.0, list(axes))
    other = DeviceMesh((2, 4), alpha=(1e-5, 2e-5), beta=(1e-10, 1e-10))   # another mesh, another price
    assert other.collective_cost("all_reduce", 4096, (1,)) != mesh.collective_cost("all_reduce", 4096, (1,))
