"""Collectives over mesh axes: differentiable functional ops (``functional``), the CommPattern
executors (``patterns``) and the execution of a planned reshard (``reshard``). User-written
collective algorithms and their verification live in :mod:`shardverify.features.algorithms`."""

from shardverify.collectives.functional import (
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    gather,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    send,
)
from shardverify.collectives.patterns import apply_comm_action, apply_grad_hook

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather",
           "scatter", "send", "recv", "apply_comm_action", "apply_grad_hook"]
