"""A plan: one strategy per node of a traced model, and the resharding between nodes.

Nodes that have a handler choose among ``strategies_for_node``; every other node
(placeholders, attributes, the output, ops without a handler such as ``getitem``) runs
*generically* (:data:`GENERIC`): its tensor inputs are resharded to replicated and it runs
unchanged on full tensors, so any model can be planned, however few of its ops have handlers.
What a node may choose and what an edge costs is :mod:`shardverify.plan.problem`'s (from
:mod:`shardverify.plan.graph`); a plan is assembled from one option per node by
:mod:`shardverify.plan.build`, the choice made by the user or by a :class:`~shardverify.plan.solver.Solver`.
Everything here is frozen, picklable data, so a plan
travels to worker processes as is.
"""

from __future__ import annotations

from dataclasses import dataclass


from shardverify.errors import StrategyError
from shardverify.plan.device import NOMINAL, DeviceProfile
from shardverify.plan.workload import Workload
from shardverify.sharding.layout import ShapedLayout
from shardverify.sharding.reshard_plan import ReshardStep
from shardverify.sharding.strategy import ShardingStrategy

__all__ = ["GENERIC", "Reshard", "NodePlan", "Plan", "PlanCost", "PlanGoals"]

GENERIC = "replicated (whole on every device)"


@dataclass(frozen=True)
class Reshard:
    """The conversion of ``producer``'s output into the layout ``node`` expects for ``operand``."""

    node: str
    operand: str
    producer: str
    source: ShapedLayout
    target: ShapedLayout
    steps: tuple[ReshardStep, ...]
    cost: float

    def __str__(self) -> str:
        how = ", ".join(map(str, self.steps)) if self.steps else "no communication"
        return f"{self.producer} {self.source} -> {self.operand}@{self.node} {self.target}: {how}"


@dataclass(frozen=True)
class PlanGoals:
    """What the solver's plan must do besides costing least: on a small model the cheapest plan
    shards little (a collective costs more than the compute it saves), so a check can ask for one
    that checks sharding. ``min_sharded``: at least that many nodes take a strategy that shards
    (or communicates); ``shard_weights``: every weight some strategy can shard is sharded by one
    of the ops taking it (tensor parallelism wherever the model allows it); ``data_parallel``:
    every weight replicated and the batch (dim 0) split over every mesh axis along its whole
    path from the model inputs."""

    min_sharded: int = 0
    shard_weights: bool = False
    data_parallel: bool = False


@dataclass(frozen=True)
class PlanCost:
    """Declared seconds per training step (forward + backward), and bytes per device."""

    compute: float
    communication: float
    resharding: float
    memory: int
    weights: int = 0    # of memory: the weights' bytes with their gradients and optimizer state

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.resharding


@dataclass(frozen=True)
class NodePlan:
    """One node: its strategy (None: generic replicated pass-through) and the resharding of its inputs."""

    node: str
    strategy: ShardingStrategy | None
    reshards: tuple[Reshard, ...] = ()
    deferred: tuple[int, ...] = ()   # mesh axes of the output's AFTER all-reduce left to the resharding

    @property
    def strategy_name(self) -> str:
        if self.strategy is None:
            return GENERIC
        return self.strategy.name + (f" (all-reduce over {self.deferred} deferred)" if self.deferred else "")


@dataclass(frozen=True)
class Plan:
    mesh_shape: tuple[int, ...]
    nodes: tuple[NodePlan, ...]     # graph order
    cost: PlanCost
    device: DeviceProfile = NOMINAL     # what the declared seconds and bytes are measured on
    workload: Workload = Workload()     # the layers, optimizer state and recompute they count

    def node(self, name: str) -> NodePlan:
        for item in self.nodes:
            if item.node == name:
                return item
        raise StrategyError(f"the plan has no node {name!r}; nodes are {[n.node for n in self.nodes]}")

    def choices(self) -> dict[str, str]:
        """node name -> strategy name, for the nodes that have strategies (a user plan file's content)."""
        return {n.node: ({"strategy": n.strategy.name, "defer": True} if n.deferred else n.strategy.name)
                for n in self.nodes if n.strategy is not None}

    def replace_node(self, name: str, **changes) -> Plan:
        """A copy with one node's strategy or reshards replaced (tests plant mistakes this way)."""
        import dataclasses

        self.node(name)
        nodes = tuple(dataclasses.replace(n, **changes) if n.node == name else n for n in self.nodes)
        return dataclasses.replace(self, nodes=nodes)


