"""SPMD code written as steps: a rank function that is a generator yields each collective it
waits for (a :class:`Pending`) instead of blocking in it, so one thread can step every rank of a
simulated mesh (:mod:`shardverify.backends.simulated_steps`) with no thread hand-over per
collective; on a blocking communicator (gloo, NCCL, the threaded simulated mesh) the same code
never yields (:func:`arrived` hands the result straight back) and :func:`run_blocking` drives it.

Code on the path of a stepped collective reads ``result = yield from arrived(comm.all_reduce(...))``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from shardverify.errors import BackendError

__all__ = ["Pending", "arrived", "run_blocking", "Steps"]

Steps = Generator[Any, Any, Any]


class Pending:
    """A collective a stepped rank waits in: the slot ``key`` (member set, n-th call), the group in
    mesh order, the description every member must agree on, this rank's payload, and how the
    last member's arrival computes every member's result (``results(payloads in group order)``)."""

    __slots__ = ("key", "group", "desc", "payload", "results")

    def __init__(self, key: tuple, group: tuple[int, ...], desc: str, payload: Any,
                 results: Callable[[list[Any]], list[Any]]) -> None:
        self.key, self.group, self.desc, self.payload, self.results = key, group, desc, payload, results


def arrived(value: Any) -> Steps:
    """The result of a collective call: ``value`` itself from a blocking communicator, or, from a
    stepped one, what the driver sends back once every member has arrived."""
    if isinstance(value, Pending):
        value = yield value
    return value


def run_blocking(steps: Steps) -> Any:
    """Run stepped code to its end on a blocking communicator (where it never yields)."""
    try:
        pending = next(steps)
    except StopIteration as stop:
        return stop.value
    steps.close()
    raise BackendError(f"stepped code waited in a collective ({getattr(pending, 'desc', pending)!r}) on a "
                       f"communicator that blocks: run it with its stepping driver")
