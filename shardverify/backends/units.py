"""Run independent units of work and get one result per unit back, in order.

A sweep (`verify`'s (case, mesh) rows) is a list of units: each a picklable callable and its
arguments, independent of the others.  Where they run is an engine's business (``InProcess``
here, one after another; ``RayEngine`` in backends/ray_units.py, on the actors of a Ray
cluster); ``run_units`` is the one call a sweep makes, and it holds every engine to the same
promise: every unit has exactly one result, nothing lost, nothing counted twice.  A unit that
gives no value has a ``UnitFailed`` in its place, saying why (``died``: its worker process died
each time it ran it, so the unit, not the worker, is the likely cause).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from shardverify.errors import ShardVerifyError

__all__ = ["Unit", "UnitFailed", "Engine", "InProcess", "run_units", "WORKER_DIED", "exception_text"]

#: what a unit that kills every worker it runs in fails with (the local `--jobs` pool's words)
WORKER_DIED = "its worker process died, also when it ran alone"


@dataclass(frozen=True)
class Unit:
    """``call(*args)`` in some worker; ``label`` names it on the progress line."""

    call: Callable[..., Any]
    args: tuple = ()
    label: str = ""


@dataclass(frozen=True)
class UnitFailed:
    """A unit that gave no value: ``error`` says why; ``died``: its worker died each time it ran it;
    ``cause``: the exception the unit raised, when it raised one (for a caller's own wording)."""

    error: str
    died: bool = False
    cause: BaseException | None = field(default=None, compare=False)


class Engine(Protocol):
    """Runs units; calls ``done(index, result)`` once per unit as it ends (in any order) and
    returns every result in the units' order."""

    def run(self, units: Sequence[Unit], done: Callable[[int, Any], None]) -> list[Any]: ...


class InProcess:
    """Every unit in this process, one after another: no worker to lose (the reference engine)."""

    def run(self, units: Sequence[Unit], done: Callable[[int, Any], None]) -> list[Any]:
        results = []
        for index, unit in enumerate(units):
            try:
                value = unit.call(*unit.args)
            except Exception as exc:  # noqa: BLE001 - a unit that raises fails alone
                value = UnitFailed(exception_text(exc), cause=exc)
            results.append(value)
            done(index, value)
        return results


def run_units(units: Sequence[Unit], engine: Engine, done: Callable[[int, Any], None] | None = None) -> list[Any]:
    """Each unit's result (a value, or a ``UnitFailed``), in the units' order; ``done(index,
    result)`` as each ends.  An engine that loses a unit or reports one twice is a bug, raised
    as one, never a silent gap in a report."""
    counts = [0] * len(units)

    def record(index: int, value: Any) -> None:
        counts[index] += 1
        if done is not None:
            done(index, value)

    results = engine.run(units, record)
    lost = [units[i].label or str(i) for i, count in enumerate(counts) if count == 0]
    twice = [units[i].label or str(i) for i, count in enumerate(counts) if count > 1]
    if lost or twice or len(results) != len(units):
        raise ShardVerifyError(f"{type(engine).__name__} gave {len(results)} result(s) for {len(units)} unit(s): "
                               f"without a result: {', '.join(lost) or 'none'}; reported twice: "
                               f"{', '.join(twice) or 'none'}")
    return results


def exception_text(exc: BaseException) -> str:
    """``Type: first line`` of an exception, as one clause of a report."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__
