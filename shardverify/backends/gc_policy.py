"""Garbage-collector thresholds for a process whose whole job is checking strategies.

A check allocates thousands of container objects that live for the check or a little longer
(autograd graphs, tensors, counters, mismatch lists, per-strategy tables).  Under CPython's
default thresholds (700, 10, 10) many of them outlive two young collections and reach the
old generation, and every time those reach a quarter of it a full collection walks the whole
heap again: torch, the traced graphs and the verifier's tables, 400k-650k objects, 0.15-0.35 s
per collection.  ``shardverify verify`` over every spec spent 7.9 s of its 51 s in the
collector.  A young generation of 50,000 objects lets them die young: 1.5 s in the
collector, 42 s in all, at the price of holding up to that many unreachable cycles a little
longer.

Only the processes that exist to check call this: the command line, a pool worker, this
project's test session.  Calling the library from another program leaves that program's
collector as it is.
"""

from __future__ import annotations

import gc

from shardverify.backends.allocator import huge_pages_for_large_tensors, return_large_frees

__all__ = ["CHECKING_THRESHOLDS", "freeze_what_is_loaded", "tune_for_checking"]

#: (young, middle, old) thresholds, as ``gc.set_threshold`` takes them
CHECKING_THRESHOLDS = (50_000, 20, 10)


def tune_for_checking() -> None:
    """Give this process the collector thresholds of a checking process, and its allocator's
    (large blocks returned to the OS when freed, and laid on huge pages: see allocator)."""
    gc.set_threshold(*CHECKING_THRESHOLDS)
    return_large_frees()
    huge_pages_for_large_tensors()


def freeze_what_is_loaded() -> None:
    """Collect once, then leave every object alive now out of later collections (gc.freeze).

    For a long-lived process that has imported what it will use (a test session once its tests
    are collected): torch, torch._dynamo, transformers and the test modules are some 300k-1M
    objects that live to the end, and every full collection walked them all again.  A full collection
    (the collector's own, or a plan's after capturing large weights: plan/verify.py) took 0.2-0.9 s in
    a pytest worker; frozen, it walks only what the tests made."""
    gc.collect()
    gc.freeze()
