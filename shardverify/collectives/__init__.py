"""Collectives over mesh axes: differentiable functional ops, the CommPattern executors,
and all-reduce algorithms written on send/recv. Verification lives in ``check`` and the
"collective" spec kind in ``spec`` (imported on demand, they pull in the code generator)."""

from shardverify.collectives.algorithms import naive_all_reduce, ring_all_reduce
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
           "scatter", "send", "recv", "apply_comm_action", "apply_grad_hook", "ring_all_reduce",
           "naive_all_reduce"]
