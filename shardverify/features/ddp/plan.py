"""Picklable values describing one data-parallel training plan to verify.

A `ModelPlan` is what a generated test hands to `verify_model`: the model (torch.nn layers or a
factory by import path), the global batch, the loss, the optimizer, the number of steps and one
point of the DDP option grid. Everything is a frozen dataclass of literals, so the plan crosses
process boundaries by pickling and appears in generated tests as readable source.
Validation is eager: a bad value fails at construction, naming the value and what was expected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardverify.errors import InvalidArgument
from shardverify.spec.limits import MAX_MICRO_BATCHES

__all__ = [
    "LayerDecl", "ModelDecl", "LossDecl", "OptimizerDecl", "DDPOptions", "ModelPlan",
    "LOSSES", "REDUCTIONS", "OPTIMIZERS", "EXPECTATIONS", "shard_steps",
]

LOSSES = ("sum", "mse", "cross_entropy")
REDUCTIONS = ("sum", "mean")
OPTIMIZERS = {"sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
              "adam": ("lr", "betas", "eps", "weight_decay", "amsgrad")}
EXPECTATIONS = ("equal", "differ")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidArgument(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class LayerDecl:
    """One `torch.nn` module of a sequential model: `target(*args, **dict(kwargs))`."""

    target: str
    args: tuple = ()
    kwargs: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        _check(isinstance(self.target, str) and self.target.startswith("torch.nn."),
               f"layer target must be a dotted torch.nn module name, got {self.target!r}")
        _check(isinstance(self.args, tuple), f"layer args must be a tuple, got {self.args!r}")
        _check(isinstance(self.kwargs, tuple) and all(isinstance(kv, tuple) and len(kv) == 2
                                                      for kv in self.kwargs),
               f"layer kwargs must be a tuple of (name, value) pairs, got {self.kwargs!r}")


@dataclass(frozen=True)
class ModelDecl:
    """Either a sequence of layers (an `nn.Sequential`) or a factory "package.module:function"."""

    layers: tuple[LayerDecl, ...] = ()
    factory: str | None = None
    factory_kwargs: tuple[tuple[str, object], ...] = ()
    where: str = ""      # the spec's "file:line: field 'model'", for errors found when the model is built

    def __post_init__(self) -> None:
        _check(bool(self.layers) != (self.factory is not None),
               f"a model needs exactly one of layers or factory, got layers={self.layers!r}, "
               f"factory={self.factory!r}")
        if self.factory is not None:
            module, _, function = self.factory.partition(":")
            _check(bool(module) and function.isidentifier(),
                   f"factory must look like 'package.module:function', got {self.factory!r}")
        _check(not (self.layers and self.factory_kwargs),
               "factory_kwargs are only meaningful with a factory")


@dataclass(frozen=True)
class LossDecl:
    """`name` is "sum" (the output itself), "mse" or "cross_entropy"; `reduction` sum or mean.

    A mean divides by the number of loss elements of the *global* batch (as torch's own mean)."""

    name: str
    reduction: str = "mean"

    def __post_init__(self) -> None:
        _check(self.name in LOSSES, f"loss must be one of {LOSSES}, got {self.name!r}")
        _check(self.reduction in REDUCTIONS,
               f"loss reduction must be one of {REDUCTIONS}, got {self.reduction!r}")


@dataclass(frozen=True)
class OptimizerDecl:
    """A torch optimizer by short name with its keyword settings."""

    name: str = "sgd"
    settings: tuple[tuple[str, object], ...] = (("lr", 0.1),)

    def __post_init__(self) -> None:
        _check(self.name in OPTIMIZERS, f"optimizer must be one of {tuple(OPTIMIZERS)}, got {self.name!r}")
        allowed = OPTIMIZERS[self.name]
        for key, _ in self.settings:
            _check(key in allowed, f"{self.name} has no setting {key!r}; allowed: {allowed}")


@dataclass(frozen=True)
class DDPOptions:
    """One point of the DDP option grid; defaults are torch's own defaults.

    accumulate: micro-batches per optimizer step; all but the last run under `ddp.no_sync()`.
    comm_hook: a name from `shardverify.features.ddp.hooks.HOOKS` ("none" keeps DDP's built-in all-reduce).
    join: rank r trains on `shard_steps(...)[r]` steps (uneven inputs) inside `ddp.join(...)`.
    sync_batchnorm: convert BatchNorm layers with `nn.SyncBatchNorm.convert_sync_batchnorm`.
    """

    accumulate: int = 1
    find_unused_parameters: bool = False
    static_graph: bool = False
    broadcast_buffers: bool = True
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    comm_hook: str = "none"
    join: bool = False
    divide_by_initial_world_size: bool = True
    sync_batchnorm: bool = False

    def __post_init__(self) -> None:
        from shardverify.features.ddp.hooks import HOOKS  # local: hooks imports torch.distributed

        _check(_is_int(self.accumulate) and self.accumulate >= 1,
               f"accumulate must be an int >= 1, got {self.accumulate!r}")
        for name in ("find_unused_parameters", "static_graph", "broadcast_buffers",
                     "gradient_as_bucket_view", "join", "divide_by_initial_world_size", "sync_batchnorm"):
            value = getattr(self, name)
            _check(isinstance(value, bool), f"{name} must be a bool, got {value!r}")
        _check(isinstance(self.bucket_cap_mb, (int, float)) and not isinstance(self.bucket_cap_mb, bool)
               and self.bucket_cap_mb > 0, f"bucket_cap_mb must be a number > 0, got {self.bucket_cap_mb!r}")
        _check(self.comm_hook in HOOKS, f"comm_hook must be one of {tuple(HOOKS)}, got {self.comm_hook!r}")
        _check(not (self.join and self.accumulate > 1),
               "join (uneven inputs) with accumulate > 1 is not supported: the joined ranks cannot "
               "shadow no_sync micro-batches")
        _check(not (self.join and self.comm_hook != "none"),
               f"join with comm_hook={self.comm_hook!r} is not supported: hooks ignore the join divisor")

    def label(self) -> str:
        """The non-default options, e.g. "accumulate=2,static_graph=True", or "default"."""
        changed = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default]
        return ",".join(changed) or "default"


def shard_steps(steps: int, world: int, join: bool) -> tuple[int, ...]:
    """Optimizer steps each data-parallel shard trains: all `steps`, or with `join` uneven inputs
    where shard r stops after `max(1, steps - r)` steps (the lowest ranks train longest)."""
    return tuple(max(1, steps - r) if join else steps for r in range(world))


@dataclass(frozen=True)
class ModelPlan:
    """Everything one model check needs except the mesh (that comes from the backend).

    input_shape / target_shape are the *global* batch of one micro-batch; dim 0 is the batch dim
    and is split evenly over the data-parallel ranks. `classes` makes integer targets in
    [0, classes) for cross_entropy. rtol/atol override the tolerance derived from the options.
    """

    name: str
    model: ModelDecl
    input_shape: tuple[int, ...]
    loss: LossDecl
    target_shape: tuple[int, ...] | None = None
    classes: int | None = None
    optimizer: OptimizerDecl = OptimizerDecl()
    steps: int = 2
    options: DDPOptions = DDPOptions()
    expect: str = "equal"
    seed: int = 0
    rtol: float | None = None
    atol: float | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.input_shape, tuple) and len(self.input_shape) >= 1
               and all(_is_int(d) and d > 0 for d in self.input_shape),
               f"input_shape must be a non-empty tuple of positive ints, got {self.input_shape!r}")
        _check(_is_int(self.steps) and self.steps >= 1, f"steps must be an int >= 1, got {self.steps!r}")
        too_many = MAX_MICRO_BATCHES.exceeded(self.steps * self.options.accumulate)
        _check(not too_many, f"accumulate={self.options.accumulate} x steps={self.steps}: {too_many}")
        _check(self.expect in EXPECTATIONS, f"expect must be one of {EXPECTATIONS}, got {self.expect!r}")
        needs_target = self.loss.name != "sum"
        _check((self.target_shape is not None) == needs_target,
               f"loss {self.loss.name!r} {'needs' if needs_target else 'takes no'} target_shape, "
               f"got {self.target_shape!r}")
        if self.target_shape is not None:
            _check(all(_is_int(d) and d > 0 for d in self.target_shape) and len(self.target_shape) >= 1
                   and self.target_shape[0] == self.input_shape[0],
                   f"target_shape must be positive ints with the batch size {self.input_shape[0]} "
                   f"first, got {self.target_shape!r}")
        _check((self.classes is not None) == (self.loss.name == "cross_entropy"),
               f"classes is required exactly for cross_entropy, got classes={self.classes!r} "
               f"with loss {self.loss.name!r}")
        _check(self.classes is None or (_is_int(self.classes) and self.classes >= 2),
               f"classes must be an int >= 2, got {self.classes!r}")
        _check(not (self.options.join and self.steps < 2),
               f"join needs steps >= 2 so that the inputs are uneven, got steps={self.steps}")
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                     and value >= 0), f"{name} must be a number >= 0, got {value!r}")

    @property
    def batch(self) -> int:
        return self.input_shape[0]

    def check_world(self, world: int) -> None:
        """Reject a world size that does not split the global batch evenly."""
        _check(self.batch % world == 0,
               f"plan {self.name!r}: global batch {self.batch} (input_shape {self.input_shape}) is "
               f"not divisible by the data-parallel world size {world}")

    def describe(self) -> str:
        return f"{self.name}[{self.options.label()}]"
