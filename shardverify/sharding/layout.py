"""A tensor's layout on a device mesh: the one value the audit, DTensor's checks, resharding and
plans all speak.

A :class:`Layout` says which mesh axes split each tensor dim, over which axes the value is a
partial still to be reduced (and by what), and whether the operand is absent (the zeros an op is
given for a post-added bias). It names no shape, so the audit can enumerate, hash, permute by
mesh symmetries and print the layouts of every operand alike. A :class:`ShapedLayout` is a
Layout of a tensor of a given shape on a mesh of a given shape: the shapes fix every rank's block
and the bytes a collective moves, which is what a reshard and a plan's edge cost need.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from shardverify.errors import ShardingSpecError
from shardverify.sharding.sharding_spec import DimSpec, ShardingSequence, ShardingSpec

__all__ = ["Layout", "ShapedLayout", "Axes"]

Axes = tuple[int, ...]


@dataclass(frozen=True, order=True)
class Layout:
    """``dims[d]``: the mesh axes sharding tensor dim d (axes[0] most significant, () = R);
    ``partial``: mesh axes over which the value is a partial ``reduce`` still to be reduced;
    ``absent``: the op is given zeros here and the operand is added after (post_add)."""

    dims: tuple[Axes, ...]
    partial: Axes = ()
    reduce: str = "sum"
    absent: bool = False

    def __hash__(self) -> int:
        # remembered: an audit looks layouts up hundreds of thousands of times (combinations,
        # renamings, local inputs), and hashing the nested tuples anew was a tenth of its time
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash((self.dims, self.partial, self.reduce, self.absent))
            object.__setattr__(self, "_hash", found)
        return found

    def __getstate__(self) -> dict:
        # a str's hash differs between processes: a pickled layout hashes anew where it lands
        return {name: value for name, value in self.__dict__.items() if name != "_hash"}

    @classmethod
    def of_spec(cls, spec: ShardingSpec, partial: Sequence[int] = (), reduce: str = "sum") -> Layout:
        """The layout ``spec`` shards by, partial over ``partial`` (its shapes dropped)."""
        partition = spec.partition_dict()
        return cls(tuple(partition.get(d, ()) for d in range(len(spec.tensor_shape))), tuple(partial), reduce)

    @property
    def used_axes(self) -> set[int]:
        return {a for axes in self.dims for a in axes}

    def shard_counts(self, mesh_shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(math.prod(mesh_shape[a] for a in axes) for axes in self.dims)

    def permuted(self, perm: Sequence[int]) -> Layout:
        """The same layout with mesh axis a renamed perm[a] (a symmetry of the mesh)."""
        return Layout(tuple(tuple(perm[a] for a in axes) for axes in self.dims),
                      tuple(sorted(perm[a] for a in self.partial)), self.reduce, self.absent)

    def normalized(self, mesh_shape: Sequence[int]) -> Layout:
        """Without mesh axes of size 1, which split and reduce nothing (S0 on a (1, 4) mesh is R)."""
        def keep(axes: Axes) -> Axes:
            return tuple(a for a in axes if mesh_shape[a] > 1)
        partial = keep(self.partial)
        return Layout(tuple(keep(axes) for axes in self.dims), partial, self.reduce if partial else "sum",
                      self.absent)

    def spec(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> ShardingSpec:
        return ShardingSpec(tuple(mesh_shape), tuple(shape),
                            tuple((d, axes) for d, axes in enumerate(self.dims) if axes))

    def key(self) -> str:
        """What coverage compares: an absent operand's sharding is irrelevant (it is zeros)."""
        return "absent" if self.absent else str(self)

    def __str__(self) -> str:
        text = str(ShardingSequence(DimSpec(axes) for axes in self.dims))
        if self.absent:
            return "absent (post-added)"
        if self.partial:
            text += f" P({self.reduce}:{''.join(map(str, self.partial))})"
        return text


@dataclass(frozen=True)
class ShapedLayout:
    """``layout`` for a tensor of ``tensor_shape`` on a mesh of ``mesh_shape``, checked against
    both when made (``spec``: its sharding bound to them). Partial values are sums: resharding
    and plans carry no partial max or min and no absent operand. Printed in the reshard notation
    (``[S0, R] P01``: partial sums over axes 0 and 1) that reshard specs and plan reports use."""

    layout: Layout
    tensor_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    spec: ShardingSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        layout = self.layout
        spec = ShardingSpec.from_sequence([DimSpec(tuple(axes)) for axes in layout.dims], self.tensor_shape,
                                          self.mesh_shape)
        partial = tuple(sorted(int(a) for a in layout.partial))
        if len(set(partial)) != len(partial) or any(not 0 <= a < len(spec.mesh_shape) for a in partial):
            raise ShardingSpecError(f"partial axes {partial} are not distinct axes of mesh {spec.mesh_shape}")
        shared = set(partial) & spec.sharded_axes()
        if shared:
            raise ShardingSpecError(f"layout {spec} is both sharded and partial over mesh axes {sorted(shared)}")
        if layout.absent or (partial and layout.reduce != "sum"):
            raise ShardingSpecError(f"layout {layout}: resharding and plans carry partial sums only, never an "
                                    f"absent operand")
        object.__setattr__(self, "layout", Layout.of_spec(spec, partial))   # one form per layout: equal ones hash alike
        object.__setattr__(self, "tensor_shape", spec.tensor_shape)
        object.__setattr__(self, "mesh_shape", spec.mesh_shape)
        object.__setattr__(self, "spec", spec)

    @classmethod
    def of_spec(cls, spec: ShardingSpec, partial: Sequence[int] = ()) -> ShapedLayout:
        """``spec``'s sharding, partial (sum) over the mesh axes ``partial``."""
        return cls(Layout.of_spec(spec, partial), spec.tensor_shape, spec.mesh_shape)

    @classmethod
    def replicated(cls, mesh_shape: Sequence[int], tensor_shape: Sequence[int]) -> ShapedLayout:
        return cls(Layout(((),) * len(tensor_shape)), tuple(tensor_shape), tuple(mesh_shape))

    @classmethod
    def parse(cls, text: str, tensor_shape: Sequence[int], mesh_shape: Sequence[int]) -> ShapedLayout:
        """``"[S0, R]"`` or ``"[R, R] P01"`` (partial over axes 0 and 1)."""
        seq, _, partial = text.strip().partition("]")
        partial = partial.strip()
        if partial and not (partial.startswith("P") and partial[1:].isdigit()):
            raise ShardingSpecError(f"layout {text!r}: expected 'P<axes>' after the sequence, got {partial!r}")
        return cls.of_spec(ShardingSpec.parse(seq + "]", tensor_shape, mesh_shape), tuple(int(c) for c in partial[1:]))

    @property
    def partial(self) -> Axes:
        return self.layout.partial

    @property
    def axes(self) -> dict[int, Axes]:
        return self.spec.partition_dict()

    def local_shape(self) -> tuple[int, ...]:
        return self.spec.local_shape()

    def __str__(self) -> str:
        return str(self.spec) + (" P" + "".join(map(str, self.partial)) if self.partial else "")
