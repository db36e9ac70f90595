"""A transformers experts implementation that routes tokens into per-expert slots of a fixed
capacity (GShard, Switch Transformer, DeepSpeed-MoE), registered under transformers' own extension
point (``ExpertsInterface``) as :data:`NAME`, for a model whose experts module transformers'
``use_experts_implementation`` wraps with stacked ``gate_up_proj`` [E, 2F, D] and ``down_proj``
[E, D, F] weights, as Mixtral's.

Why: transformers' own implementations cannot be split over the experts at a size people train.
``batched_mm`` copies each token's expert weights (``[tokens x k, 2F, D]``); ``grouped_mm`` calls a
custom op whose row offsets depend on the data; ``eager`` loops over the experts with
data-dependent shapes, which ``torch.export`` cannot capture. Here every shape is static: the tokens
in ``config.expert_groups`` groups (a sequence each when it is the batch), each (token, choice)
given a slot in its expert's queue within its group, tokens past the capacity dropped (as GShard's),
the slots gathered per expert (``gsec,gsd->gecd``), the experts' stacked weights applied with the
expert dim ``e`` shared by tokens and weights, and the outputs weighted back by the router
(``gsec,gecd->gsd``). Expert parallelism is then a layout: the groups split over a mesh axis around
the experts and the experts split over it between them, the plan's resharding moves each rank's
tokens to their experts' ranks and back with two all-to-alls.

With a capacity of a whole group (no token dropped) the function equals transformers' own
(``batched_mm``) to rounding: tests/test_expert_parallel.py.
"""

from __future__ import annotations

import torch

from shardverify.errors import InvalidArgument

__all__ = ["NAME", "register", "add_slots", "slots_experts_forward"]

#: the name models select with ``experts_implementation``
NAME = "shardverify_slots"


def slots_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """Tokens [T, D] with their top-k experts [T, k] and weights [T, k] -> [T, D]. Reads the ids
    buffers :func:`add_slots` attached (a graph input each, not a factory call in the graph)."""
    groups = self.config.expert_groups
    tokens, width = hidden_states.shape
    k = top_k_index.shape[-1]
    dtype = hidden_states.dtype
    x = hidden_states.view(groups, tokens // groups, width)                             # [G, S, D]
    # the routing in integers: exact at any size (a bfloat16 count stops at 256)
    chosen = torch.eq(top_k_index.unsqueeze(-1), self.expert_ids).to(torch.int64)      # [T, k, E]
    chosen = chosen.view(groups, -1, self.num_experts)                                  # [G, S*k, E]
    slot = torch.cumsum(chosen, dim=1) * chosen - 1            # its place in its expert's queue; -1: not chosen
    dispatch = torch.eq(slot.unsqueeze(-1), self.slot_ids).to(dtype)                   # [G, S*k, E, C]; past C: none
    dispatch = dispatch.view(groups, tokens // groups, k, self.num_experts, -1)
    combine = (dispatch * top_k_weights.view(groups, -1, k, 1, 1).to(dtype)).sum(2)     # [G, S, E, C]
    routed = torch.einsum("gsec,gsd->gecd", dispatch.sum(2), x)                         # each expert's slots
    gate_up = torch.einsum("gecd,efd->gecf", routed, self.gate_up_proj)
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.einsum("gecf,edf->gecd", self.act_fn(gate) * up, self.down_proj)
    return torch.einsum("gsec,gecd->gsd", combine, out).reshape(tokens, width)


def register() -> None:
    """Make :data:`NAME` a valid ``experts_implementation`` (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, slots_experts_forward)


class _Registration:
    """Held by each experts module :func:`add_slots` prepares: unpickling the model (in a worker
    process of the gloo or process backend) registers :data:`NAME` there before its first forward."""

    def __reduce__(self):
        return _registered, ()


def _registered() -> _Registration:
    register()
    return _Registration()


def add_slots(model: torch.nn.Module, groups: int, capacity: int) -> torch.nn.Module:
    """Give every experts module of ``model`` its groups and the ids its slots are compared with:
    ``expert_ids`` (0..E-1) and ``slot_ids`` (0..capacity-1), integers whatever dtype the model
    is cast to."""
    found = 0
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "num_experts"):
            module.config.expert_groups = groups
            module.register_buffer("expert_ids", torch.arange(module.num_experts), persistent=False)
            module.register_buffer("slot_ids", torch.arange(capacity), persistent=False)
            module.slots_registration = _registered()
            found += 1
    if not found:
        raise InvalidArgument(f"{type(model).__name__} has no experts module with stacked gate_up_proj weights")
    return model
