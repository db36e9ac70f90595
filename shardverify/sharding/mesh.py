"""A logical device mesh: pure coordinate arithmetic and alpha-beta communication costs.

Building a mesh needs no process group; backends bind it to real or simulated
communication separately, so strategy generation and cost models stay testable anywhere.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardverify.errors import MeshError
from shardverify.sharding.calibration_file import load_calibration

DEFAULT_ALPHA = 1e-5   # seconds of latency per collective step
DEFAULT_BETA = 1e-10   # seconds per byte (10 GB/s)


def _as_int_tuple(value: object, what: str) -> tuple[int, ...]:
    try:
        items = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise MeshError(f"{what} must be a sequence of ints, got {value!r}") from None
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            raise MeshError(f"{what} must contain ints, got {item!r} in {value!r}")
    return items


def _per_axis(value: object, ndim: int, default: float, what: str) -> tuple[float, ...]:
    if value is None:
        return (default,) * ndim
    items = tuple(float(v) for v in value)  # type: ignore[union-attr]
    if len(items) != ndim:
        raise MeshError(f"{what} needs one value per mesh axis ({ndim}), got {value!r}")
    if any(not math.isfinite(v) or v < 0 for v in items):
        raise MeshError(f"{what} values must be finite and >= 0, got {value!r}")
    return items


@dataclass(frozen=True)
class DeviceMesh:
    """A row-major logical mesh over ranks 0..size-1, e.g. ``DeviceMesh((2, 2))``."""

    shape: tuple[int, ...]
    device_ids: tuple[int, ...] | None = None
    alpha: tuple[float, ...] | None = None
    beta: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        shape = _as_int_tuple(self.shape, "mesh shape")
        if not shape:
            raise MeshError("mesh shape must have at least one axis, got ()")
        if any(s <= 0 for s in shape):
            raise MeshError(f"mesh shape must contain positive ints, got {shape}")
        object.__setattr__(self, "shape", shape)
        size = math.prod(shape)
        if self.device_ids is None:
            ids = tuple(range(size))
        else:
            ids = _as_int_tuple(self.device_ids, "device_ids")
            if len(ids) != size:
                raise MeshError(f"device_ids {ids} has {len(ids)} entries, mesh shape {shape} needs {size}")
            if len(set(ids)) != len(ids):
                raise MeshError(f"device_ids {ids} contains duplicates")
        object.__setattr__(self, "device_ids", ids)
        object.__setattr__(self, "alpha", _per_axis(self.alpha, len(shape), DEFAULT_ALPHA, "alpha"))
        object.__setattr__(self, "beta", _per_axis(self.beta, len(shape), DEFAULT_BETA, "beta"))
        object.__setattr__(self, "_hash", hash((self.shape, self.device_ids, self.alpha, self.beta)))

    def __hash__(self) -> int:
        return self._hash   # worked out once: the check's caches are keyed by mesh

    # ---- geometry -------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.size))

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise MeshError(f"rank {rank!r} is not in 0..{self.size - 1} of mesh {self.shape}")
        return rank

    def check_axes(self, axes: Sequence[int]) -> tuple[int, ...]:
        """Validate a tuple of distinct mesh axes; returns it as a tuple."""
        if _plain_axes(axes):
            return _checked_axes(self.shape, axes)
        return _checked_axes.__wrapped__(self.shape, _as_int_tuple(axes, "mesh axes"))

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Row-major coordinate of ``rank``."""
        return _coordinate(self.shape, self._check_rank(rank))

    def rank_at(self, coord: Sequence[int]) -> int:
        coord = _as_int_tuple(coord, "mesh coordinate")
        if len(coord) != self.ndim or any(not 0 <= c < s for c, s in zip(coord, self.shape)):
            raise MeshError(f"coordinate {coord} is outside mesh shape {self.shape}")
        return _row_major(coord, self.shape)

    def axes_size(self, axes: Sequence[int]) -> int:
        """Number of devices spanned by ``axes`` (1 for no axes)."""
        return math.prod(self.shape[a] for a in self.check_axes(axes))

    def group_ranks(self, rank: int, axes: Sequence[int]) -> tuple[int, ...]:
        """Ranks differing from ``rank`` only on ``axes``, ordered by the flattened
        coordinate over ``axes`` with ``axes[0]`` most significant."""
        return _group_ranks(self.shape, self._check_rank(rank), self.check_axes(axes))

    def group_index(self, rank: int, axes: Sequence[int]) -> int:
        """Position of ``rank`` in its group over ``axes`` (the shard index of S<axes>)."""
        axes = self.check_axes(axes)
        coord = self.coordinate(rank)
        index = 0
        for axis in axes:
            index = index * self.shape[axis] + coord[axis]
        return index

    def groups(self, axes: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """Every group over ``axes``, ordered by the smallest rank each contains."""
        axes = self.check_axes(axes)
        seen: dict[tuple[int, ...], None] = {}
        for rank in self.ranks:
            seen.setdefault(self.group_ranks(rank, axes), None)
        return tuple(seen)

    # ---- alpha-beta costs -----------------------------------------------------------
    # ``num_bytes`` is always the size of the full (unsharded over ``axes``) tensor.
    # A group spanning several axes pays the slowest of their links.
    def _link(self, axes: Sequence[int]) -> tuple[int, float, float]:
        axes = self.check_axes(axes)
        if not axes:
            return 1, 0.0, 0.0
        return self.axes_size(axes), max(self.alpha[a] for a in axes), max(self.beta[a] for a in axes)

    @staticmethod
    def _check_bytes(num_bytes: float) -> float:
        if num_bytes < 0:
            raise MeshError(f"num_bytes must be >= 0, got {num_bytes!r}")
        return float(num_bytes)

    def all_gather_cost(self, num_bytes: float, axes: Sequence[int]) -> float:
        n, alpha, beta = self._link(axes)
        num_bytes = self._check_bytes(num_bytes)
        return 0.0 if n == 1 else alpha * (n - 1) + beta * num_bytes * (n - 1) / n

    def reduce_scatter_cost(self, num_bytes: float, axes: Sequence[int]) -> float:
        return self.all_gather_cost(num_bytes, axes)

    def all_reduce_cost(self, num_bytes: float, axes: Sequence[int]) -> float:
        # ring all-reduce = reduce-scatter + all-gather
        return 2 * self.all_gather_cost(num_bytes, axes)

    def all_to_all_cost(self, num_bytes: float, axes: Sequence[int]) -> float:
        n, alpha, beta = self._link(axes)
        num_bytes = self._check_bytes(num_bytes)
        return 0.0 if n == 1 else alpha * (n - 1) + beta * num_bytes * (n - 1) / (n * n)

    def collective_cost(self, kind: str, payload_bytes: float, axes: Sequence[int]) -> float:
        """Seconds of one collective of ``kind`` over ``axes``, from the bytes one rank passes in
        (its payload: the tensor it all-reduces, the shard it contributes to an all-gather, the sum
        of its chunks for a reduce-scatter or an all-to-all). The verifier prices the collectives a
        rank really issued with this, the generators price their declared actions with it (the
        same few prices over and over: remembered)."""
        if _plain_axes(axes) and type(kind) is str and type(payload_bytes) in (int, float):
            return _collective_cost(self, kind, payload_bytes, axes)
        return self._collective_cost(kind, payload_bytes, axes)

    def _collective_cost(self, kind: str, payload_bytes: float, axes: Sequence[int]) -> float:
        n = self.axes_size(axes)
        if kind == "all_reduce":
            return self.all_reduce_cost(payload_bytes, axes)
        if kind == "all_gather":
            return self.all_gather_cost(payload_bytes * n, axes)
        if kind == "reduce_scatter":
            return self.reduce_scatter_cost(payload_bytes, axes)
        if kind == "all_to_all":
            return self.all_to_all_cost(payload_bytes * n, axes)
        raise MeshError(f"no alpha-beta model for collective {kind!r}; priced kinds are "
                        f"{PRICED_KINDS}")

    # ---- calibration ----------------------------------------------------------------
    @classmethod
    def calibrated(cls, shape: Sequence[int], path: str | None = None,
                   device_ids: Sequence[int] | None = None) -> DeviceMesh:
        """A mesh whose per-axis alpha and beta come from a ``shardverify calibrate`` file: ``path``,
        else ``$SHARDVERIFY_CALIBRATION``, else ``~/.cache/shardverify/calibration.json``."""
        alpha, beta = load_calibration(tuple(shape), path)
        return cls(tuple(shape), device_ids=None if device_ids is None else tuple(device_ids),
                   alpha=alpha, beta=beta)


def _plain_axes(axes: object) -> bool:
    """A tuple of ints (not bools, which hash like 0 and 1): safe as a cache key of axes."""
    return type(axes) is tuple and all(type(a) is int for a in axes)


# A rank's coordinate and group depend on the mesh's shape alone, and the collectives of every
# simulated or real rank ask for them on each call: the answers are remembered.
@functools.lru_cache(maxsize=4096)
def _coordinate(shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
    coord = []
    for extent in reversed(shape):
        coord.append(rank % extent)
        rank //= extent
    return tuple(reversed(coord))


@functools.lru_cache(maxsize=8192)
def _group_ranks(shape: tuple[int, ...], rank: int, axes: tuple[int, ...]) -> tuple[int, ...]:
    base = list(_coordinate(shape, rank))
    members = []
    for sub in itertools.product(*(range(shape[a]) for a in axes)):
        for axis, value in zip(axes, sub):
            base[axis] = value
        members.append(_row_major(base, shape))
    return tuple(members)


def _row_major(coord: Sequence[int], shape: tuple[int, ...]) -> int:
    rank = 0
    for c, extent in zip(coord, shape):
        rank = rank * extent + c
    return rank


@functools.lru_cache(maxsize=1024)
def _checked_axes(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    """``axes`` when they are distinct axes of a mesh of ``shape``; else a MeshError naming them
    (a collective validates its axes on every call: the answers are remembered)."""
    for axis in axes:
        if not 0 <= axis < len(shape):
            raise MeshError(f"mesh axis {axis} is out of range for mesh shape {shape}")
    if len(set(axes)) != len(axes):
        raise MeshError(f"mesh axes {axes} repeat an axis")
    return axes


@functools.lru_cache(maxsize=4096)
def _collective_cost(mesh: DeviceMesh, kind: str, payload_bytes: float, axes: tuple[int, ...]) -> float:
    return mesh._collective_cost(kind, payload_bytes, axes)


#: collective kinds :meth:`DeviceMesh.collective_cost` can price
PRICED_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
