"""The strategy model: operands, layouts, costs and communication as plain frozen data.

A strategy is complete on its own: every collective it needs is listed as a
:class:`CommAction`, because the numerical verifier executes exactly those and nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import KW_ONLY, dataclass
from enum import Enum
from typing import NamedTuple

import torch

from shardverify.errors import StrategyError
from shardverify.sharding.partial import IndexShard, PartialInput, PostAdd
from shardverify.sharding.sharding_spec import ShardingSpec


class OperationDataType(Enum):
    INPUT = "input"      # a graph input (placeholder) fed to the op
    ARG = "arg"          # an activation produced by another node
    PARAM = "param"      # a trainable parameter
    BUFFER = "buffer"    # a non-trainable module buffer
    OUTPUT = "output"    # the node's own result


LOCATOR_KINDS = ("arg", "kwarg", "param", "buffer", "output", "item", "varargs", "attr")


@dataclass(frozen=True)
class OperandLocator:
    """Where an operand sits in the node's call, so a runner can swap in local shards:
    positional ``arg`` index, ``kwarg`` name, module ``param``/``buffer`` attribute, the ``output``
    (key None; the tuple index when the op returns a tuple), an ``item`` of a list argument
    (key ``(arg index, element index)``, torch.cat's tensors), or ``varargs``: every positional
    argument from index ``key`` on, passed unpacked (``x.view(8, 16)``), or a module's plain
    ``attr`` (a non-tensor attribute its forward reads: ``nn.Conv2d.groups``)."""

    kind: str
    key: int | str | tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.kind not in LOCATOR_KINDS:
            raise StrategyError(f"locator kind {self.kind!r} is not one of {LOCATOR_KINDS}")
        if self.kind == "output":
            if self.key is not None and (isinstance(self.key, bool) or not isinstance(self.key, int)):
                raise StrategyError(f"output locator key must be None or a tuple index, got {self.key!r}")
            return
        if self.kind == "item":
            key = self.key
            if not (isinstance(key, tuple) and len(key) == 2
                    and all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in key)):
                raise StrategyError(f"item locator needs an (arg index, element index) key, got {key!r}")
            return
        expected = {"arg": int, "kwarg": str, "param": str, "buffer": str, "varargs": int, "attr": str}[self.kind]
        if not isinstance(self.key, expected) or isinstance(self.key, bool):
            raise StrategyError(f"locator of kind {self.kind!r} needs a {expected.__name__} key, got {self.key!r}")


@dataclass(frozen=True)
class OperationData:
    """One operand of a node: its name (as strategies refer to it), kind, role and shapes.

    ``logical_shape`` is the view the generator reasons on (a linear input (4, 4, 4, 16) is
    (64, 16)); it defaults to the physical ``shape``.
    """

    name: str
    type: OperationDataType
    role: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    _: KW_ONLY
    logical_shape: tuple[int, ...] | None = None
    locator: OperandLocator

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        logical = self.shape if self.logical_shape is None else tuple(int(s) for s in self.logical_shape)
        if math.prod(logical) != math.prod(self.shape):
            raise StrategyError(f"operand {self.name!r}: logical shape {logical} does not hold the "
                                f"{math.prod(self.shape)} elements of shape {self.shape}")
        object.__setattr__(self, "logical_shape", logical)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize     # a tensor's element_size(), read without making one

    @property
    def is_param(self) -> bool:
        return self.type in (OperationDataType.PARAM, OperationDataType.BUFFER)


class CommPattern(Enum):
    ALLREDUCE_FWD_IDENTITY_BWD = "allreduce_fwd_identity_bwd"
    IDENTITY_FWD_ALLREDUCE_BWD = "identity_fwd_allreduce_bwd"
    GATHER_FWD_SPLIT_BWD = "gather_fwd_split_bwd"
    SPLIT_FWD_GATHER_BWD = "split_fwd_gather_bwd"
    ALL2ALL_FWD_ALL2ALL_BWD = "all2all_fwd_all2all_bwd"


class CommWhere(Enum):
    BEFORE = "before"   # on an operand before the op runs
    AFTER = "after"     # on the output after the op
    HOOK = "hook"       # on a parameter's gradient


_DIMS_NEEDED = {
    CommPattern.ALLREDUCE_FWD_IDENTITY_BWD: 0,
    CommPattern.IDENTITY_FWD_ALLREDUCE_BWD: 0,
    CommPattern.GATHER_FWD_SPLIT_BWD: 1,
    CommPattern.SPLIT_FWD_GATHER_BWD: 1,
    CommPattern.ALL2ALL_FWD_ALL2ALL_BWD: 2,
}


REDUCE_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True)
class CommAction:
    """One collective a strategy needs; ``dims`` are tensor dims (gather/split: 1, all-to-all:
    (split_dim, concat_dim), all-reduce: none). ``op`` says how an ALLREDUCE_FWD_IDENTITY_BWD
    combines a partial output: ``sum`` (a sharded contraction), ``avg`` (a mean over a sharded
    dim), ``max``/``min`` (amax/amin; backward sends the gradient to the rank(s) holding the
    extremum, which costs one all-reduce in backward)."""

    pattern: CommPattern
    axes: tuple[int, ...]
    operand: str
    where: CommWhere
    dims: tuple[int, ...] = ()
    op: str = "sum"

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", tuple(self.axes))
        object.__setattr__(self, "dims", tuple(self.dims))
        if self.op not in REDUCE_OPS:
            raise StrategyError(f"comm action on {self.operand!r}: op {self.op!r} is not one of {REDUCE_OPS}")
        if self.op != "sum" and self.pattern is not CommPattern.ALLREDUCE_FWD_IDENTITY_BWD:
            raise StrategyError(f"comm action on {self.operand!r}: op {self.op!r} applies only to "
                                f"ALLREDUCE_FWD_IDENTITY_BWD, not {self.pattern.name}")
        if not self.axes or len(set(self.axes)) != len(self.axes):
            raise StrategyError(f"comm action on {self.operand!r} needs distinct mesh axes, got {self.axes}")
        if len(self.dims) != _DIMS_NEEDED[self.pattern]:
            raise StrategyError(f"{self.pattern.name} on {self.operand!r} takes {_DIMS_NEEDED[self.pattern]} "
                                f"tensor dim(s), got {self.dims}")
        if self.where is CommWhere.HOOK and self.pattern is not CommPattern.IDENTITY_FWD_ALLREDUCE_BWD:
            raise StrategyError(f"a gradient HOOK can only all-reduce (IDENTITY_FWD_ALLREDUCE_BWD), "
                                f"got {self.pattern.name} on {self.operand!r}")


@dataclass(frozen=True)
class LocalArg:
    """A non-tensor argument every rank passes in place of the one the call recorded: a view's
    target shape is the *local* output shape (``x.view(8, 16)`` on a shard of rows is
    ``x_local.view(4, 16)``). The verifier checks the op's local output against the reference
    slice, so a wrong local argument fails like a wrong layout."""

    locator: OperandLocator
    value: object
    # one value per rank where blocks are uneven (rank r's local shape); ``value`` is rank 0's
    per_rank: tuple = ()

    def value_on(self, rank: int) -> object:
        """What ``rank`` passes."""
        return self.per_rank[rank] if self.per_rank else self.value

    def __post_init__(self) -> None:
        if self.per_rank and self.per_rank[0] != self.value:
            raise StrategyError(f"local argument at {self.locator}: value {self.value!r} is not rank 0's "
                                f"{self.per_rank[0]!r}")
        if self.locator.kind not in ("arg", "kwarg", "varargs", "attr"):
            raise StrategyError(f"a local argument replaces a call argument (arg, kwarg, varargs or a module attr), "
                                f"got locator {self.locator}")
        if isinstance(self.value, torch.Tensor):
            raise StrategyError(f"local argument at {self.locator} is a tensor; tensors are operands with layouts")


@dataclass(frozen=True)
class TrainCycleItem:
    fwd: float
    bwd: float
    total: float


@dataclass(frozen=True)
class MemoryCost:
    """Bytes per device."""

    activation: int = 0
    parameter: int = 0

    def __add__(self, other: MemoryCost) -> MemoryCost:
        return MemoryCost(self.activation + other.activation, self.parameter + other.parameter)

    @property
    def total(self) -> int:
        return self.activation + self.parameter


class MemoryCycle(NamedTuple):
    """Memory per device in the forward pass, the backward pass and in total."""

    fwd: MemoryCost
    bwd: MemoryCost
    total: MemoryCost


@dataclass(frozen=True)
class ShardingStrategy:
    """One way to run a node on a mesh: a layout per operand (inputs..., then the output, or
    the outputs in tuple order when the op returns several tensors)."""

    name: str
    sharding_specs: tuple[tuple[str, ShardingSpec], ...]
    operands: tuple[OperationData, ...]
    compute_cost: TrainCycleItem
    memory_cost: MemoryCycle
    communication_cost: TrainCycleItem
    communication_actions: tuple[CommAction, ...] = ()
    post_add: tuple[PostAdd, ...] = ()
    local_args: tuple[LocalArg, ...] = ()   # non-tensor arguments each rank passes instead (a view's shape)
    index_shards: tuple[IndexShard, ...] = ()   # ids into a sharded dim, masked per rank (vocab parallel)
    partial_inputs: tuple[PartialInput, ...] = ()   # inputs held as partial sums (pieces per rank)

    def __post_init__(self) -> None:
        names = [n for n, _ in self.sharding_specs]
        if names != [op.name for op in self.operands]:
            raise StrategyError(f"strategy {self.name!r}: sharding specs {names} do not match operands "
                                f"{[op.name for op in self.operands]}")
        if len(set(names)) != len(names):
            raise StrategyError(f"strategy {self.name!r}: operand names repeat: {names}")
        for (name, spec), op in zip(self.sharding_specs, self.operands):
            if spec.tensor_shape != op.shape:
                raise StrategyError(f"strategy {self.name!r}: spec {spec} of {name!r} is for shape "
                                    f"{spec.tensor_shape}, operand has shape {op.shape}")
        for action in self.communication_actions:
            if action.operand not in names:
                raise StrategyError(f"strategy {self.name!r}: comm action names unknown operand "
                                    f"{action.operand!r}; operands are {names}")
        for add in self.post_add:
            data = next((op for op in self.operands if op.name == add.operand), None)
            if data is None or data.type is OperationDataType.OUTPUT:
                raise StrategyError(f"strategy {self.name!r}: post-add names {add.operand!r}, which is not "
                                    f"an input of {names}")
            if len(add.dims) != len(data.shape):
                raise StrategyError(f"strategy {self.name!r}: post-add of {add.operand!r} maps {len(add.dims)} "
                                    f"dims, the operand has {len(data.shape)}")
        for shard in self.index_shards:
            index = next((op for op in self.operands if op.name == shard.index), None)
            table = next((op for op in self.operands if op.name == shard.table), None)
            if index is None or table is None or index.type is OperationDataType.OUTPUT or \
                    table.type is OperationDataType.OUTPUT:
                raise StrategyError(f"strategy {self.name!r}: index shard names {shard.index!r} into "
                                    f"{shard.table!r}; both must be inputs of {names}")
            if index.dtype.is_floating_point or index.dtype.is_complex:
                raise StrategyError(f"strategy {self.name!r}: index shard operand {shard.index!r} is "
                                    f"{index.dtype}, not an integer tensor of ids")
            if shard.dim >= len(table.shape):
                raise StrategyError(f"strategy {self.name!r}: index shard dim {shard.dim} is out of range for "
                                    f"{shard.table!r} of shape {table.shape}")
        for partial in self.partial_inputs:
            data = next((op for op in self.operands if op.name == partial.operand), None)
            if data is None or data.type is OperationDataType.OUTPUT or not (
                    data.dtype.is_floating_point or data.dtype.is_complex and partial.op == "sum"):
                raise StrategyError(f"strategy {self.name!r}: partial input {partial.operand!r} must be a "
                                    f"floating-point input (or a complex partial sum) of {names}")
            spec = self.get_sharding_spec_by_name(partial.operand)
            shared = set(partial.axes) & spec.sharded_axes()
            if shared or max(partial.axes) >= len(spec.mesh_shape):
                raise StrategyError(f"strategy {self.name!r}: partial input {partial.operand!r} over mesh axes "
                                    f"{partial.axes}: " + (f"its layout {spec} shards axes {sorted(shared)} already"
                                                           if shared else f"not axes of mesh {spec.mesh_shape}"))
            if self.post_added(partial.operand) is not None:
                raise StrategyError(f"strategy {self.name!r}: {partial.operand!r} is post-added, so the op never "
                                    f"sees it; it cannot be a partial input")
        if len({p.operand for p in self.partial_inputs}) != len(self.partial_inputs):
            raise StrategyError(f"strategy {self.name!r}: an operand is a partial input twice")
        if not isinstance(self.memory_cost, MemoryCycle):
            object.__setattr__(self, "memory_cost", MemoryCycle(*self.memory_cost))

    def get_sharding_spec_by_name(self, name: str) -> ShardingSpec:
        for operand, spec in self.sharding_specs:
            if operand == name:
                return spec
        raise StrategyError(f"strategy {self.name!r} has no operand {name!r}; "
                            f"operands are {[n for n, _ in self.sharding_specs]}")

    def get_op_data_by_name(self, name: str) -> OperationData:
        for op in self.operands:
            if op.name == name:
                return op
        raise StrategyError(f"strategy {self.name!r} has no operand {name!r}; "
                            f"operands are {[op.name for op in self.operands]}")

    def get_op_data_by_role(self, role: str) -> OperationData | None:
        return next((op for op in self.operands if op.role == role), None)

    @property
    def output(self) -> OperationData:
        return self.operands[-1]

    @property
    def outputs(self) -> tuple[OperationData, ...]:
        """The trailing OUTPUT operands, in tuple order (one for a single-tensor op)."""
        n = 0
        while n < len(self.operands) and self.operands[-1 - n].type is OperationDataType.OUTPUT:
            n += 1
        return self.operands[len(self.operands) - n:]

    @property
    def inputs(self) -> tuple[OperationData, ...]:
        """Every operand before the outputs."""
        return self.operands[:len(self.operands) - len(self.outputs)]

    def post_added(self, name: str) -> PostAdd | None:
        return next((add for add in self.post_add if add.operand == name), None)

    def partial_axes(self, name: str) -> tuple[int, ...]:
        """The mesh axes input ``name`` is a partial value over (``()``: a full value)."""
        return next((p.axes for p in self.partial_inputs if p.operand == name), ())

    def partial_input(self, name: str) -> PartialInput | None:
        """How input ``name`` is partial, if it is."""
        return next((p for p in self.partial_inputs if p.operand == name), None)

    def index_shard(self, name: str) -> IndexShard | None:
        """The index shard whose ids operand ``name`` holds, if any."""
        return next((shard for shard in self.index_shards if shard.index == name), None)

    @property
    def output_sharding_spec(self) -> ShardingSpec:
        return self.sharding_specs[-1][1]

    def layout_key(self) -> tuple:
        """All that decides what the ranks run and what the check holds them to, the name left
        out: two strategies with equal keys are the same check and the same plan option (a
        following op offers one per predecessor strategy, ColossalAI's contract, and several
        predecessors may produce one layout). The declared costs are part of it: a strategy alike
        in layout but declaring other costs is checked on its own."""
        return (self.sharding_specs, self.communication_actions, self.post_add, self.local_args,
                self.index_shards, self.partial_inputs, self.compute_cost, self.communication_cost,
                self.memory_cost)

    def replace(self, **changes: object) -> ShardingStrategy:
        return dataclasses.replace(self, **changes)

    def renamed(self, name: str) -> ShardingStrategy:
        """The same strategy under another name. Nothing else changes, so nothing is checked
        again: a following op names one derived strategy once per predecessor strategy (887
        times for a sum after a linear on (2,2,2)), and each check cost more than the naming."""
        strategy = object.__new__(type(self))     # copy.copy's reduce protocol, without its cost
        strategy.__dict__.update(self.__dict__)
        strategy.__dict__["name"] = name
        return strategy

    def __str__(self) -> str:
        layouts = ", ".join(f"{n}: {s}" + (f" {self.partial_input(n).label}" if self.partial_axes(n) else "")
                            for n, s in self.sharding_specs)
        return f"{self.name} ({layouts})"


def first_of_each_layout(strategies) -> list[ShardingStrategy]:
    """The first strategy of each layout key, in order: the options worth a choice where several
    are alike but in name (a plan's node options; the handler keeps them, its contract)."""
    found: dict[tuple, ShardingStrategy] = {}
    for strategy in strategies:
        found.setdefault(strategy.layout_key(), strategy)
    return list(found.values())


class StrategiesVector(list):
    """The strategies of one graph node, in generation order."""

    def __init__(self, node: object = None, strategies=(), predecessor_nodes=()) -> None:
        super().__init__(strategies)
        self.node = node
        self.predecessor_nodes = list(predecessor_nodes)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self]

    def by_name(self, name: str) -> ShardingStrategy:
        for strategy in self:
            if strategy.name == name:
                return strategy
        raise StrategyError(f"no strategy named {name!r}; have {self.names}")
