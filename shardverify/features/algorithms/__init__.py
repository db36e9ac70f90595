"""User collective algorithms verified against the collectives they implement: the shipped
all-reduces written on send/recv (``implementations``), the reference semantics
(``references``), the check (``check``) and the "collective" spec kind (``spec``, imported on
demand: it pulls in the code generator)."""

from shardverify.features.algorithms.implementations import naive_all_reduce, ring_all_reduce

__all__ = ["naive_all_reduce", "ring_all_reduce"]
