"""An op that raised on a rank: the error that says what reached it, and whether every rank fails
alike (so a report names them all)."""

from __future__ import annotations

import copy

import torch

from shardverify.capture.call import call_op
from shardverify.errors import VerificationError
from shardverify.sharding.strategy import CommWhere, ShardingStrategy

__all__ = ["OpCallError", "op_context", "OP_FAILED", "EVERY_RANK"]


class OpCallError(VerificationError):
    """The op raised on a rank; the message says what each operand looked like when it got there."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def op_context(comm, node, strategy: ShardingStrategy, leaves: dict, local: dict, exc: Exception) -> str:
    """The op's error, then for each operand: its layout, the local shard it gave this rank,
    the BEFORE actions applied, and the shape and dtype that reached the op."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    every = _fails_on_shapes(node, strategy, local)
    lines = [f"{OP_FAILED} on rank {comm.rank}: {type(exc).__name__}: {reason}"
             + (f"\n{EVERY_RANK}" if every else "")]
    lines += [f"local argument {arg.locator.kind} {arg.locator.key!r}: {arg.value_on(comm.rank)!r}"
              for arg in strategy.local_args]
    for data in strategy.inputs:
        spec = strategy.get_sharding_spec_by_name(data.name)
        actions = [f"{a.pattern.name} over mesh axes {a.axes}" + (f" on dims {a.dims}" if a.dims else "")
                   for a in strategy.communication_actions if a.operand == data.name and a.where is CommWhere.BEFORE]
        reached = local.get((data.locator.kind, data.locator.key))
        leaf = leaves.get(data.name)
        got = "not passed" if reached is None else f"{tuple(reached.shape)} {str(reached.dtype).removeprefix('torch.')}"
        if strategy.post_added(data.name) is not None:
            got += " (zeros: added after the op)"
        if strategy.partial_axes(data.name):
            got += f" (a piece of a partial {strategy.partial_input(data.name).op} over mesh axes " \
                   f"{strategy.partial_axes(data.name)})"
        lines.append(f"{data.name}: layout {spec} of {tuple(data.shape)} -> local shard "
                     f"{tuple(leaf.shape) if leaf is not None else '?'}"
                     + (f", then {', then '.join(actions)}" if actions else ", no actions")
                     + f" -> reached the op as {got}")
    return "\n".join(lines)


OP_FAILED = "the op raised"
EVERY_RANK = ("it fails on shapes alone (meta tensors), and every rank's operands reach the op with "
              "the same shapes, so every rank fails alike")


def _fails_on_shapes(node, strategy: ShardingStrategy, local: dict) -> bool:
    """Whether the op also fails on meta tensors of the same shapes and dtypes, when every rank
    passes the same shapes (even layouts: the actions are the same on every rank too), so a
    shape-only failure is every rank's; a value-dependent one (an index out of range), or one
    on uneven blocks (each rank has its own shapes), is only known for this rank."""
    if not all(spec.is_even for _, spec in strategy.sharding_specs) or \
            any(arg.per_rank for arg in strategy.local_args):
        return False
    meta = {loc: torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t
            for loc, t in local.items()}
    module = None
    if node.op == "call_module":
        module = copy.deepcopy(node.graph.owning_module.get_submodule(node.target)).to("meta")
    try:
        call_op(node, module, meta)
    except Exception:  # noqa: BLE001 - any failure on meta tensors is a shape failure
        return True
    return False
