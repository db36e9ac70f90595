"""Tensor layouts on a device mesh: which mesh axes split which tensor dims.

A layout is stored as a sorted dim -> axes mapping (hashable, canonical) and printed as
a sharding sequence such as ``[R, S0, R, S1]``; ``S01`` is one dim split over axes 0 then 1,
``S10`` the same dim split over axis 1 first (DTensor's shard order).

Blocks follow DTensor (``torch.chunk``): a dim of size n split k ways gives blocks of
ceil(n/k), the last ones smaller or empty; a dim split over several axes is split over the
first axis, then each block over the next (:mod:`shardverify.sharding.blocks`). So a size need
not divide: ``is_even`` tells whether every block has the same size, and :meth:`ShardingSpec.local_shape`
is the largest block (the rank at coordinate 0 of every axis holds it), which is what costs
and memory are declared for. Every constructor validates eagerly so an impossible layout
never reaches a generator.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardverify.errors import (
    DimOutOfRangeError,
    DuplicateMeshAxisError,
    MeshAxisOutOfRangeError,
    SequenceParseError,
    ShardingSpecError,
)
from shardverify.sharding.blocks import nested_block

if TYPE_CHECKING:
    import torch

    from shardverify.sharding.mesh import DeviceMesh

_DIM_RE = re.compile(r"^(R|S(\d+))$")


def dim_text(axes: Sequence[int]) -> str:
    """How a dim split over ``axes`` is written: ``S01``, or ``R`` for none (a layout's text is
    written from its axes directly, without a DimSpec per dim)."""
    return "S" + "".join(str(a) for a in axes) if axes else "R"


@dataclass(frozen=True)
class DimSpec:
    """The mesh axes one tensor dim is split over; ``()`` is replicated (R)."""

    axes: tuple[int, ...] = ()

    @property
    def is_replica(self) -> bool:
        return not self.axes

    @classmethod
    def parse(cls, text: str) -> DimSpec:
        """``"R"`` -> ``DimSpec(())``, ``"S01"`` -> ``DimSpec((0, 1))`` (one digit per axis)."""
        text = text.strip()
        match = _DIM_RE.match(text)
        if not match:
            raise SequenceParseError(f"cannot parse dim spec {text!r}: expected 'R' or 'S' followed by axis digits")
        return cls(tuple(int(d) for d in match.group(2) or ""))

    def __str__(self) -> str:
        return dim_text(self.axes)

    __repr__ = __str__


class ShardingSequence(tuple):
    """A tuple of :class:`DimSpec`, printed as ``[S0, R, R, S1]``."""

    def __new__(cls, dims: Sequence[DimSpec] = ()) -> ShardingSequence:
        return super().__new__(cls, dims)

    def __getitem__(self, item):  # slices stay ShardingSequences so they print the same way
        result = super().__getitem__(item)
        return ShardingSequence(result) if isinstance(item, slice) else result

    def __str__(self) -> str:
        return "[" + ", ".join(str(d) for d in self) + "]"

    __repr__ = __str__


def parse_sequence(text: str) -> ShardingSequence:
    """Parse ``"[R, S0, R, S1]"`` (brackets required, comma separated)."""
    stripped = text.strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        raise SequenceParseError(f"sharding sequence {text!r} must be bracketed, like '[R, S0]'")
    body = stripped[1:-1].strip()
    if not body:
        return ShardingSequence()
    return ShardingSequence(DimSpec.parse(part) for part in body.split(","))


def _where(tensor_shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> str:
    """The layout an error is about (written only for an error: generators make thousands)."""
    return f"tensor shape {tensor_shape} on mesh {mesh_shape}"


@dataclass(frozen=True)
class ShardingSpec:
    """The layout of one tensor of ``tensor_shape`` on a mesh of ``mesh_shape``."""

    mesh_shape: tuple[int, ...]
    tensor_shape: tuple[int, ...]
    dim_partition: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        mesh_shape = tuple(map(int, self.mesh_shape))
        tensor_shape = tuple(map(int, self.tensor_shape))
        object.__setattr__(self, "mesh_shape", mesh_shape)
        object.__setattr__(self, "tensor_shape", tensor_shape)
        ndim, mesh_ndim = len(tensor_shape), len(mesh_shape)
        partition: dict[int, tuple[int, ...]] = {}
        used: dict[int, int] = {}
        for dim, axes in self.dim_partition:
            axes = tuple(map(int, axes))
            if not -ndim <= dim < ndim:
                raise DimOutOfRangeError(f"dim {dim} is out of range for {_where(tensor_shape, mesh_shape)}")
            dim = dim % ndim
            if dim in partition:
                raise DimOutOfRangeError(f"dim {dim} is given twice for {_where(tensor_shape, mesh_shape)}")
            if not axes:
                continue
            for axis in axes:
                if not 0 <= axis < mesh_ndim:
                    raise MeshAxisOutOfRangeError(f"mesh axis {axis} (sharding dim {dim}) is out of range for "
                                                  f"{_where(tensor_shape, mesh_shape)}")
                if axis in used:
                    where = _where(tensor_shape, mesh_shape)
                    raise DuplicateMeshAxisError(
                        f"mesh axis {axis} shards both dim {used[axis]} and dim {dim} of {where}"
                        if used[axis] != dim else f"mesh axis {axis} is used twice on dim {dim} of {where}")
                used[axis] = dim
            partition[dim] = axes
        object.__setattr__(self, "dim_partition", tuple(sorted(partition.items())))
        #: the fields as one plain tuple, which a check keys its slices and geometry by: a suite
        #: hands it new (equal) layouts with every strategy, and a tuple hashes and compares in C
        #: where the dataclass's ``__eq__`` runs in Python
        object.__setattr__(self, "key", (mesh_shape, tensor_shape, self.dim_partition))
        object.__setattr__(self, "_hash", hash(self.key))

    def __hash__(self) -> int:
        return self._hash   # worked out once (above)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_partition(cls, mesh_shape: Sequence[int], tensor_shape: Sequence[int],
                       partition: Mapping[int, Sequence[int]]) -> ShardingSpec:
        """Build from ``{dim: axes}``; negative dims are normalised, empty axes mean R."""
        return cls(tuple(mesh_shape), tuple(tensor_shape),
                   tuple((int(d), tuple(a)) for d, a in partition.items()))

    @classmethod
    def replicated(cls, mesh_shape: Sequence[int], tensor_shape: Sequence[int]) -> ShardingSpec:
        return cls(tuple(mesh_shape), tuple(tensor_shape), ())

    @classmethod
    def from_sequence(cls, sequence: Sequence[DimSpec], tensor_shape: Sequence[int],
                      mesh_shape: Sequence[int]) -> ShardingSpec:
        if len(sequence) != len(tensor_shape):
            raise SequenceParseError(
                f"sharding sequence {ShardingSequence(sequence)} has {len(sequence)} dims, "
                f"tensor shape {tuple(tensor_shape)} has {len(tensor_shape)}")
        return cls(tuple(mesh_shape), tuple(tensor_shape),
                   tuple((d, spec.axes) for d, spec in enumerate(sequence) if spec.axes))

    @classmethod
    def parse(cls, text: str, tensor_shape: Sequence[int], mesh_shape: Sequence[int]) -> ShardingSpec:
        """Parse ``"[R, S0, R, S1]"`` for a tensor of ``tensor_shape`` on ``mesh_shape``."""
        return cls.from_sequence(parse_sequence(text), tensor_shape, mesh_shape)

    # ---- views ---------------------------------------------------------------------
    @property
    def sharding_sequence(self) -> ShardingSequence:
        found = self.__dict__.get("_sequence")
        if found is None:   # worked out once: strategies are named and compared by it thousands of times
            partition = dict(self.dim_partition)
            found = ShardingSequence(DimSpec(partition.get(d, ())) for d in range(len(self.tensor_shape)))
            object.__setattr__(self, "_sequence", found)
        return found

    def partition_dict(self) -> dict[int, tuple[int, ...]]:
        return dict(self.dim_partition)

    def shard_counts(self) -> tuple[int, ...]:
        partition = dict(self.dim_partition)
        return tuple(math.prod(self.mesh_shape[a] for a in partition.get(d, ()))
                     for d in range(len(self.tensor_shape)))

    @property
    def is_even(self) -> bool:
        """Whether every rank's block has the same shape (each split size divides; worked out
        once, as every strategy laying a tensor out so asks)."""
        found = self.__dict__.get("_is_even")
        if found is None:
            mesh_shape, shape = self.mesh_shape, self.tensor_shape    # an unsplit dim is even
            found = all(shape[d] % math.prod(mesh_shape[a] for a in axes) == 0 for d, axes in self.dim_partition)
            object.__setattr__(self, "_is_even", found)
        return found

    def local_shape(self) -> tuple[int, ...]:
        """The largest local shape: the block at coordinate 0 of every mesh axis (every rank's
        shape when ``is_even``; worked out once, as every cost of every strategy reads it)."""
        found = self.__dict__.get("_local_shape")
        if found is None:
            shape = list(self.tensor_shape)     # an unsplit dim is whole
            for d, axes in self.dim_partition:
                shape[d] = nested_block(shape[d], [(self.mesh_shape[a], 0) for a in axes])[1]
            found = tuple(shape)
            object.__setattr__(self, "_local_shape", found)
        return found

    def local_numel(self) -> int:
        return math.prod(self.local_shape())

    def local_shape_on(self, mesh: DeviceMesh, rank: int) -> tuple[int, ...]:
        """The shape of the block ``rank`` holds (smaller than ``local_shape`` or empty on the
        last ranks of an uneven dim). Remembered per rank: a layout's every rank is asked for
        each strategy laying an operand out so (the block depends on the mesh's shape, which
        must be this spec's, and the rank alone)."""
        shapes = self.__dict__.get("_rank_shapes")
        if shapes is None:
            shapes = {}
            object.__setattr__(self, "_rank_shapes", shapes)
        if tuple(mesh.shape) != self.mesh_shape:
            raise ShardingSpecError(f"spec for mesh {self.mesh_shape} used with mesh {mesh.shape}")
        found = shapes.get(rank) if type(rank) is int else None
        if found is None:
            coord = mesh.coordinate(rank)     # checks the rank
            shape = list(self.tensor_shape)   # an unsplit dim is whole: the blocks of the split ones
            for d, axes in self.dim_partition:
                shape[d] = nested_block(shape[d], [(self.mesh_shape[a], coord[a]) for a in axes])[1]
            found = shapes[rank] = tuple(shape)
        return found

    def sharded_axes(self) -> set[int]:
        return {a for _, axes in self.dim_partition for a in axes}

    def local_slices(self, mesh: DeviceMesh, rank: int) -> tuple[slice, ...]:
        """The slice of the full tensor that ``rank`` holds."""
        if tuple(mesh.shape) != self.mesh_shape:
            raise ShardingSpecError(f"spec for mesh {self.mesh_shape} used with mesh {mesh.shape}")
        partition = dict(self.dim_partition)
        coord = mesh.coordinate(rank)
        slices = []
        for dim, size in enumerate(self.tensor_shape):
            start, length = nested_block(size, [(mesh.shape[a], coord[a]) for a in partition.get(dim, ())])
            slices.append(slice(start, start + length))
        return tuple(slices)

    def local_shard(self, tensor: torch.Tensor, mesh: DeviceMesh, rank: int) -> torch.Tensor:
        if tuple(tensor.shape) != self.tensor_shape:
            raise ShardingSpecError(f"tensor of shape {tuple(tensor.shape)} given to a spec for {self.tensor_shape}")
        return tensor[self.local_slices(mesh, rank)]

    def __str__(self) -> str:
        found = self.__dict__.get("_text")
        if found is None:   # worked out once: strategies are named by it; str(sharding_sequence)
            partition = dict(self.dim_partition)
            found = "[" + ", ".join(dim_text(partition.get(d, ())) for d in range(len(self.tensor_shape))) + "]"
            object.__setattr__(self, "_text", found)
        return found


#: (mesh shape, tensor shape, partition as given) -> its spec; see :func:`interned`
_INTERNED: dict[tuple, ShardingSpec] = {}
_MOST_INTERNED = 1 << 14


def interned(mesh_shape: tuple[int, ...], tensor_shape: tuple[int, ...],
             partition: tuple[tuple[int, tuple[int, ...]], ...]) -> ShardingSpec:
    """``ShardingSpec(mesh_shape, tensor_shape, partition)``, one object per distinct layout in a
    process: a generator lays the same operands out the same few hundred ways in every graph
    (each case of a spec, each layer of a model), and what a spec works out once (its local
    shapes, sequence and text) then serves all of them. A spec is frozen, so sharing it is safe."""
    key = (mesh_shape, tensor_shape, partition)
    found = _INTERNED.get(key)
    if found is None:
        if len(_INTERNED) >= _MOST_INTERNED:
            _INTERNED.clear()
        found = _INTERNED[key] = ShardingSpec(mesh_shape, tensor_shape, partition)
    return found


def forget_interned() -> None:
    """Let every interned spec go (a measurement that must make them again)."""
    _INTERNED.clear()
