"""What one training step holds and repeats, beyond the captured graph: how many times the model's
repeated block runs (a 32-layer model is captured with one layer and costed as 32), the optimizer
state every weight carries, and whether activations are recomputed.

Memory per device is counted as:

* **weights**: each parameter's local shard in its own dtype, its gradient (the same size), the
  optimizer's state in float32 (Adam: two moments; SGD with momentum: one; none), and with
  ``master_weights`` a float32 copy of a weight held in a narrower dtype (mixed precision:
  2 + 2 + 8 + 4 = 16 bytes per bfloat16 parameter, the usual figure);
* **activations**: every node's output once, at its local size (a view counts as a tensor of its
  own, so this is an upper bound of what autograd saves); with ``recompute`` a repeated block
  keeps only its outputs per layer and one layer's activations at a time.

Times: a node of the repeated block runs once per layer; with ``recompute`` its forward (compute
and communication) runs a second time in the backward pass.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from torch import fx

from shardverify.errors import InvalidArgument

__all__ = ["OPTIMIZERS", "Workload", "RepeatedBlock", "repeated_block", "repeats"]

#: optimizer -> float32 values of state per parameter element
OPTIMIZERS = {"adam": 2, "sgd": 1, "none": 0}


@dataclass(frozen=True)
class Workload:
    layers: int = 1                  # the model's copies of its repeated block (the graph's stand for them)
    optimizer: str = "adam"
    master_weights: bool = False     # a float32 copy of each weight held in a narrower dtype
    recompute: bool = False          # activation checkpointing of each repeated block

    def __post_init__(self) -> None:
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1:
            raise InvalidArgument(f"layers must be a positive integer, got {self.layers!r}")
        if self.optimizer not in OPTIMIZERS:
            raise InvalidArgument(f"unknown optimizer {self.optimizer!r}; the ones costed are {', '.join(OPTIMIZERS)}")

    def weight_bytes(self, numel: int, itemsize: int) -> int:
        """Bytes a weight shard of ``numel`` elements holds with its gradient and optimizer state."""
        master = 4 if self.master_weights and itemsize < 4 else 0
        return numel * (2 * itemsize + 4 * OPTIMIZERS[self.optimizer] + master)

    @property
    def label(self) -> str:
        return (f"{self.layers} layer{'s' if self.layers > 1 else ''}, {self.optimizer} state"
                + (", float32 master weights" if self.master_weights else "")
                + (", recompute" if self.recompute else ""))

    def to_json(self) -> dict:
        return {"layers": self.layers, "optimizer": self.optimizer, "master_weights": self.master_weights,
                "recompute": self.recompute}


@dataclass(frozen=True)
class RepeatedBlock:
    """The graph's repeated block: its module path prefix, how many copies the graph holds, its
    nodes, and those whose output leaves the block (what a recomputed layer keeps)."""

    prefix: str
    copies: int
    nodes: frozenset[str]
    outputs: frozenset[str]


_COPY = re.compile(r"^(.*)\.(\d+)$")


def _paths(node: fx.Node) -> list[str]:
    """The module paths a node runs under (a weight's get_attr: its owner's path)."""
    if node.op == "get_attr":
        owner = str(node.target).rsplit(".", 1)[0]
        return [owner[:i] for i in range(len(owner) + 1) if i == len(owner) or owner[i] == "."]
    if node.op == "call_module":
        return [str(node.target)]
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values()]


def repeated_block(graph: fx.GraphModule) -> RepeatedBlock | None:
    """The block the model repeats: the module list (a path ``P.0``, ``P.1``...) under which most
    nodes run (a transformer's layers); None when no node runs under a numbered module."""
    under: Counter = Counter()
    copies: dict[str, set[str]] = {}
    for node in graph.graph.nodes:
        lists = set()
        for path in _paths(node):
            found = _COPY.match(path)
            if found:
                lists.add(found.group(1))
                copies.setdefault(found.group(1), set()).add(found.group(2))
        under.update(lists)
    if not under:
        return None
    prefix = max(under, key=lambda p: (under[p], -len(p)))
    inside = frozenset(n.name for n in graph.graph.nodes
                       if any(_COPY.match(p) and _COPY.match(p).group(1) == prefix for p in _paths(n)))
    outputs = frozenset(n.name for n in graph.graph.nodes if n.name in inside
                        and any(u.name not in inside for u in n.users) and n.op != "get_attr")
    return RepeatedBlock(prefix, len(copies[prefix]), inside, outputs)


def repeats(graph: fx.GraphModule, workload: Workload) -> tuple[dict[str, int], dict[str, int], RepeatedBlock | None]:
    """(node -> times it runs per step, node -> copies of its output or weight held at once, the
    block) under ``workload``; nodes outside the block run and are held once."""
    if workload.layers == 1:
        return {}, {}, None
    block = repeated_block(graph)
    if block is None:
        raise InvalidArgument(f"layers={workload.layers}: the model has no repeated block (no node runs under a "
                              f"numbered module such as layers.0) to count that many times")
    if workload.layers % block.copies:
        raise InvalidArgument(f"layers={workload.layers}: the captured graph holds {block.copies} copies of "
                              f"{block.prefix}.N, and {workload.layers} is not a multiple of that")
    times = workload.layers // block.copies
    runs = dict.fromkeys(block.nodes, times)
    if not workload.recompute:
        held = dict(runs)
    else:   # one layer's activations at a time, each layer's outputs kept; every layer's weights
        weights = {n.name for n in graph.graph.nodes if n.op == "get_attr" and n.name in block.nodes}
        held = {name: times for name in block.nodes if name in block.outputs or name in weights}
    return runs, held, block
