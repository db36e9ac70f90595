"""Solve for the real size, verify on the tiny build.

At the sizes a check can afford (width 64, 16 tokens) a collective costs more than the compute it
saves, so the cheapest plan shards little; the plan a user trains with is the one for the real
sizes. Here the solver takes its costs from the model at the size it will train at, captured with
``torch.export`` under a ``FakeTensorMode`` (shapes only: no weight or activation is allocated,
so a 7B-parameter layer costs nothing to capture), and the plan it picks is mapped onto the tiny
build node by node and verified there end to end.

The mapping is sound only where the two graphs are the same program at two sizes:

* **the same structure**: the same nodes, by name and target, in the same order (refused,
  naming the first node that differs, otherwise);
* **the same choices**: a strategy may be picked only if the tiny build offers it (verified there,
  on the grid or on demand) and the real size yields it too (its rule, unverified there: the
  tiny check is what verifies it);
* **the same splits**: every dim the strategy shards must divide alike at both sizes (evenly at
  both, or unevenly at both, with no empty block at one only); a strategy that splits 32 heads
  evenly over 8 devices but the tiny build's 4 heads unevenly is left out of the solver's
  choice, counted and said: the tiny check would verify another case than the one trained.

Build the tiny model so its sizes divide like the real ones (heads, widths, batch multiples of
the mesh) and nothing is left out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import fx

from shardverify.capture.call import target_name
from shardverify.capture.export import export_graph
from shardverify.errors import InvalidArgument, ShardVerifyError
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.strategy import ShardingStrategy
from shardverify.plan.build import build_plan
from shardverify.plan.coverage import classify_nodes, shards
from shardverify.plan.device import NOMINAL, DeviceProfile
from shardverify.plan.model import Plan, PlanCost, PlanGoals
from shardverify.plan.solver import Solver, solve_plan
from shardverify.plan.weights import with_weight_layouts
from shardverify.plan.workload import Workload

__all__ = ["RealSize", "RealSizePlan", "StructureMismatch", "capture_real", "same_structure", "real_options",
           "solve_real_size", "split_alike"]


class StructureMismatch(InvalidArgument):
    """The real-size graph is not the tiny build's at another size: no node-by-node mapping."""


@dataclass(frozen=True)
class RealSize:
    """The model at the size it will train at: ``build()`` returns (module, example inputs) and is
    called under a FakeTensorMode (it allocates nothing); ``label`` says the size (``hidden=4096,
    seq=4096, batch=8``) in reports."""

    build: Callable[[], tuple]
    label: str
    dtype: torch.dtype = torch.float32     # what the costs' bytes are counted in: the dtype it trains in


@dataclass(frozen=True)
class RealSizePlan:
    """What solving at the real size gave: the plan at the real size (its declared cost is the
    one that picked it), and the strategies left out of the choice, with why."""

    label: str
    plan: Plan
    sharded: tuple[str, ...]                       # nodes the real-size plan shards
    left_out: tuple[tuple[str, str, str], ...]     # (node, strategy, why)

    @property
    def cost(self) -> PlanCost:
        return self.plan.cost

    def lines(self, show: int = 6) -> list[str]:
        c = self.cost
        lines = [f"costed at the real size ({self.label}): predicted {c.total:.4g} s per training step (compute "
                 f"{c.compute:.3g} + communication {c.communication:.3g} + resharding {c.resharding:.3g}), memory "
                 f"{c.memory / 2 ** 30:.3g} GiB/device ({c.weights / 2 ** 30:.3g} GiB of it weights with gradients and "
                 f"optimizer state) on {self.plan.device.label}, {self.plan.workload.label}; "
                 f"{len(self.sharded)} node(s) sharded; the plan mapped onto the tiny build node by node and "
                 f"verified there"]
        if self.left_out:
            nodes = sorted({node for node, _, _ in self.left_out})
            lines.append(f"  left out of the choice: {len(self.left_out)} strategy(ies) of {len(nodes)} node(s), "
                         f"valid at the real size but not checkable as such on the tiny build:")
            lines += [f"    {node}: {strategy!r}: {why}" for node, strategy, why in self.left_out[:show]]
            if len(self.left_out) > show:
                lines.append(f"    ... {len(self.left_out) - show} more")
        return lines

    def to_json(self) -> dict:
        c = self.cost
        return {"label": self.label, "sharded": list(self.sharded),
                "cost": {"compute": c.compute, "communication": c.communication, "resharding": c.resharding,
                         "total": c.total, "memory_bytes": c.memory, "weight_bytes": c.weights},
                "device": self.plan.device.name, "workload": self.plan.workload.to_json(),
                "left_out": [{"node": n, "strategy": s, "why": w} for n, s, w in self.left_out]}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _as_fake(value):
    """A parameter, buffer or input as a zero-filled fake tensor on the CPU, alike in shape and dtype
    (called under the FakeTensorMode: nothing is allocated)."""
    return torch.zeros(value.shape, dtype=value.dtype, device="cpu")


def _fake_module(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` (built on the meta device) with every parameter and buffer a fake CPU tensor, a
    tied weight still one parameter (GPT-2's embedding and LM head): not the meta device, whose
    kernels' strides differ from the CPU's and change what export records (a ``contiguous``)."""
    memo: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in memo:
                    fake = _as_fake(tensor)
                    memo[id(tensor)] = torch.nn.Parameter(fake, tensor.requires_grad) \
                        if isinstance(tensor, torch.nn.Parameter) else fake
                table[name] = memo[id(tensor)]
    return module


def capture_real(real: RealSize) -> fx.GraphModule:
    """The real-size model's ATen graph: built on the meta device (no weight allocated, no
    initialisation run), then captured with torch.export on fake CPU tensors, in ``real.dtype``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    from shardverify.plan.inputs import with_keywords

    try:
        with _default_dtype(real.dtype), torch.device("meta"):
            module, inputs = real.build()
        with _default_dtype(real.dtype), FakeTensorMode():
            module = _fake_module(module.eval())
            inputs = tree_map(lambda v: _as_fake(v) if isinstance(v, torch.Tensor) else v, inputs)
            module, args = with_keywords(module, inputs)
            return export_graph(module, tuple(args))
    except ShardVerifyError as error:
        raise InvalidArgument(f"cannot capture the model at the real size ({real.label}): {error}") from error
    except Exception as error:  # noqa: BLE001 - the user's factory or torch: one line naming the size
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise InvalidArgument(f"cannot build or capture the model at the real size ({real.label}): "
                              f"{type(error).__name__}: {first}") from error


def _signature(gm: fx.GraphModule) -> list[tuple[str, str]]:
    return [(n.name, target_name(n)) for n in gm.graph.nodes]


def same_structure(tiny: fx.GraphModule, real: fx.GraphModule, label: str = "the real size") -> None:
    """Refuse, naming the first node that differs, unless both graphs have the same nodes (name
    and target) in the same order."""
    a, b = _signature(tiny), _signature(real)
    for index, (mine, theirs) in enumerate(zip(a, b)):
        if mine != theirs:
            raise StructureMismatch(
                f"the model at {label} is not the tiny build at another size: node #{index} is "
                f"{theirs[0]!r} ({theirs[1]}) there and {mine[0]!r} ({mine[1]}) in the tiny build, so the plan "
                f"cannot be mapped node by node; give both the same structure (layers, options, attention "
                f"implementation), differing only in sizes")
    if len(a) != len(b):
        longer, extra = ("the tiny build", a[len(b)]) if len(a) > len(b) else (label, b[len(a)])
        raise StructureMismatch(f"the model at {label} is not the tiny build at another size: {len(b)} nodes there, "
                                f"{len(a)} in the tiny build ({longer} goes on with {extra[0]!r}, {extra[1]})")


def _split(size: int, blocks: int) -> str:
    if size % blocks == 0:
        return "evenly"
    return "unevenly" if size >= blocks else "unevenly, with empty blocks"


def split_alike(tiny: ShardingStrategy, real: ShardingStrategy, mesh: DeviceMesh) -> str | None:
    """None when every dim ``tiny`` and ``real`` (the same strategy at two sizes) shard divides
    alike at both sizes; else why not, naming the operand, the dim and both splits."""
    for (name, small), (_, large) in zip(tiny.sharding_specs, real.sharding_specs):
        for dim, axes in large.dim_partition:
            blocks = mesh.axes_size(axes)
            big, little = large.tensor_shape[dim], small.tensor_shape[dim]
            if _split(big, blocks) != _split(little, blocks):
                return (f"{name} dim {dim} splits {_split(big, blocks)} at the real size ({big} over {blocks}) but "
                        f"{_split(little, blocks)} on the tiny build ({little} over {blocks})")
    return None


class _CostOnly:
    """The on-demand hook for the real-size graph: a call outside its spec's grid yields its
    rule's strategies unverified, for their costs only; verification is the tiny build's."""

    cache_key = "real size: costs only"

    def __call__(self, call):
        return call.strategies


def real_options(tiny_options: Mapping[str, list[ShardingStrategy] | None], real: fx.GraphModule,
                 mesh: DeviceMesh) -> tuple[dict[str, list[ShardingStrategy] | None], list[tuple[str, str, str]]]:
    """(the real-size graph's options, the strategies left out): at each node, the real size's
    strategies that the tiny build offers (verified) under the same name and that split alike
    (:func:`split_alike`); a strategy the tiny build offers and the real size lacks, or that
    splits otherwise, is left out with why."""
    found, statuses = classify_nodes(real, mesh, _CostOnly())
    found = with_weight_layouts(real, found, mesh)   # offered at the real size where the tiny build offers them
    refused = {s.node: s.reason for s in statuses if s.status == "refused"}
    options: dict[str, list[ShardingStrategy] | None] = {}
    left_out: list[tuple[str, str, str]] = []
    for node in real.graph.nodes:
        small, large = tiny_options.get(node.name), found.get(node.name)
        if not small:
            options[node.name] = None
            continue
        by_name = {s.name: s for s in large or ()}
        kept = []
        for strategy in small:
            twin = by_name.get(strategy.name)
            why = (f"the real size has no such strategy ({refused.get(node.name, 'its rule yields none there')})"
                   if twin is None else split_alike(strategy, twin, mesh))
            if why is None:
                kept.append(twin)
            elif shards(strategy):
                left_out.append((node.name, strategy.name, why))
        options[node.name] = kept or None
    return options, left_out


def solve_real_size(tiny: fx.GraphModule, tiny_options: Mapping[str, list[ShardingStrategy] | None],
                    real_size: RealSize, mesh: DeviceMesh, memory_limit: int | None = None,
                    device: DeviceProfile = NOMINAL, goals: PlanGoals = PlanGoals(),
                    solver: Solver | None = None, workload: Workload = Workload()) -> tuple[Plan, RealSizePlan]:
    """(the plan on the tiny build, what solving at the real size gave): the solver's plan for the
    real-size graph's costs, over the choices both sizes share, mapped onto ``tiny`` by node name.
    ``memory_limit`` bounds the real size's declared memory per device."""
    real = capture_real(real_size)
    same_structure(tiny, real, real_size.label)
    options, left_out = real_options(tiny_options, real, mesh)
    at_real = solve_plan(real, mesh, memory_limit, device, options, goals=goals, solver=solver, workload=workload)
    mapped = build_plan(tiny, mesh, at_real.choices(), tiny_options, device, where=f"real-size plan ({real_size.label})",
                        workload=workload)
    sharded = tuple(n.node for n in at_real.nodes if shards(n.strategy))
    return mapped, RealSizePlan(real_size.label, at_real, sharded, tuple(left_out))
