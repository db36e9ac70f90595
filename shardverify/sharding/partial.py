"""The partial-sum side of a strategy: an input held as partial pieces (PartialInput), ids into
a sharded table whose lookups give a partial output (IndexShard), and an additive operand held
back until a partial output is reduced (PostAdd). Each names operands of the strategy; the
verifier runs what they say around the op."""

from __future__ import annotations

from dataclasses import dataclass

from shardverify.errors import StrategyError

__all__ = ["PostAdd", "IndexShard", "PARTIAL_INPUT_OPS", "PartialInput"]


@dataclass(frozen=True)
class PostAdd:
    """An additive operand (a bias) that is *not* passed to the op (zeros are passed in its
    place) and is added to the output after the output's AFTER actions, so a partial output is
    reduced before the bias is added once (row-parallel Linear with bias). Dim ``i`` of the
    operand lines up with output dim ``dims[i]``; the other output dims broadcast."""

    operand: str
    dims: tuple[int, ...]
    output: int = 0            # which output (tuple index) it is added to

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(self.dims))
        if len(set(self.dims)) != len(self.dims) or any(d < 0 for d in self.dims):
            raise StrategyError(f"post-add of {self.operand!r}: output dims {self.dims} must be distinct and >= 0")


@dataclass(frozen=True)
class IndexShard:
    """Integer operand ``index`` holds positions along dim ``dim`` of operand ``table``, which
    the strategy shards over mesh axes ``axes`` (vocab-parallel embedding): each rank shifts
    the ids into its shard, looks up the ids it does not hold at row 0 and zeroes their output
    (:mod:`shardverify.sharding.indexing`), so output ``output`` is a partial sum over ``axes``, which
    the strategy all-reduces like any other (an AFTER action)."""

    index: str
    table: str
    dim: int
    axes: tuple[int, ...]
    output: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", tuple(self.axes))
        if not self.axes or self.dim < 0 or self.output < 0:
            raise StrategyError(f"index shard of {self.index!r} into {self.table!r}: needs mesh axes and a "
                                f"non-negative dim and output, got axes {self.axes}, dim {self.dim}")


PARTIAL_INPUT_OPS = ("sum", "max", "min")


@dataclass(frozen=True)
class PartialInput:
    """Input ``operand`` arrives as a partial value over mesh axes ``axes``: each rank of a group
    over ``axes`` holds one piece of its block, and the pieces reduce by ``op`` to the block
    (DTensor's ``Partial("sum")``, ``Partial("max")``...). Only an op linear in the operand may
    take a partial sum (the output is then a partial sum over ``axes`` too), only an op monotone
    in it a partial max or min (a nondecreasing op keeps the op, a nonincreasing one swaps max
    and min); the strategy reduces the output after the op (an AFTER action).

    The gradient a rank holds for its piece is the derivative of the loss with respect to that
    piece: for a sum, the full gradient on every rank of the group (the adjoint of a sum); for a
    max or min, the full gradient where this rank's piece is the extremum and zero elsewhere
    (the derivative of the max over the pieces; DTensor defines no backward for a partial max).
    Either way the operand needs no gradient all-reduce over ``axes``."""

    operand: str
    axes: tuple[int, ...]
    op: str = "sum"

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", tuple(sorted(self.axes)))
        if not self.axes or len(set(self.axes)) != len(self.axes) or min(self.axes) < 0:
            raise StrategyError(f"partial input {self.operand!r}: needs distinct mesh axes, got {self.axes}")
        if self.op not in PARTIAL_INPUT_OPS:
            raise StrategyError(f"partial input {self.operand!r}: op {self.op!r} is not one of {PARTIAL_INPUT_OPS}")

    @property
    def label(self) -> str:
        """``P01`` for a partial sum over mesh axes 0 and 1, ``Pmax1`` for a partial max over axis 1."""
        return f"P{'' if self.op == 'sum' else self.op}{''.join(map(str, self.axes))}"

