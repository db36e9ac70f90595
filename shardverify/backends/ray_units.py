"""``RayEngine``: units (backends/units.py) run on the actors of a Ray cluster.

Each actor is one long-lived worker process on some node, holding one CPU: torch stays imported
in it and whatever a unit keeps in its module (verify's simulated backends, one per mesh shape)
stays warm for the next unit.  An actor runs one unit at a time, so a unit always runs alone in
its process.  Before an actor gets a unit it says which torch and shardverify it runs; one that
differs from this process refuses the whole run (ShardVerifyError), since results of two versions
mixed in one report would be no verdict of either.  An actor that dies (its node removed, the
unit crashing the interpreter) loses only its unit: it runs again on another actor, a
replacement is started, and a unit whose actor died twice fails with ``WORKER_DIED``.

Ray is imported only here, and only when an engine is built: shardverify runs without it.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from shardverify.backends.units import WORKER_DIED, Unit, UnitFailed, exception_text
from shardverify.errors import ShardVerifyError

__all__ = ["RayEngine", "import_ray", "installed_versions", "actor_versions", "INSTALL_HINT", "DEATHS"]

INSTALL_HINT = "pip install 'shardverify[cluster]'"
#: deaths of its worker after which a unit fails instead of running again
DEATHS = 2


def import_ray():
    """The ray module, or a ShardVerifyError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ShardVerifyError(f"--cluster runs on Ray, which is not installed here ({exc}): "
                               f"{INSTALL_HINT}") from None
    return ray


def installed_versions() -> dict[str, str]:
    """The torch and shardverify installed where this runs (read from their metadata: a worker
    refused for its versions never imports torch)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "shardverify"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:   # not installed, or a source tree never installed
            found[name] = "not installed"
    return found


#: what an actor runs to say its versions (a test plants a mismatch by replacing it)
actor_versions = installed_versions


class _Worker:
    """One Ray actor: its versions said, ``setup`` once (only then: a node with another torch may
    not even import what it sets up), then one unit after another in the same process."""

    def __init__(self, setup: Callable[[], None] | None, report: Callable[[], dict]) -> None:
        self._setup, self._report = setup, report

    def versions(self) -> dict:
        import socket

        return {**self._report(), "host": socket.gethostname(), "pid": os.getpid()}

    def set_up(self) -> None:
        if self._setup is not None:
            self._setup()

    def run(self, call: Callable[..., Any], args: tuple) -> Any:
        return call(*args)


class RayEngine:
    """Units on ``workers`` actors (default: one per CPU of the cluster) of the Ray cluster at
    ``address`` (anything ``ray.init`` takes: ``auto``, ``HOST:PORT``; ``local``: a Ray started
    in this process, ``local_cpus`` CPUs, no dashboard).  A ``with`` block connects and, at its
    end, stops every actor and disconnects (stopping a Ray it started).  ``wait_seconds``: how
    long to wait for a first worker when none is running a unit."""

    def __init__(self, address: str, workers: int | None = None, *, setup: Callable[[], None] | None = None,
                 report: Callable[[], dict] | None = None, local_cpus: int = 2, wait_seconds: float = 300.0) -> None:
        self.address, self.workers, self.setup = address, workers, setup
        self.report = report or actor_versions
        self.local_cpus, self.wait_seconds = local_cpus, wait_seconds
        self.ray: Any = None
        self._connected = False
        self._actors: list = []
        self.retried = 0   # unit runs lost with a dead worker (each ran again)
        self._failed_starts = 0

    # ------------------------------------------------------------------ connection
    def __enter__(self) -> RayEngine:
        ray = self.ray = import_ray()
        if ray.is_initialized():   # a caller's own Ray connection: used, left connected
            return self
        options = dict(log_to_driver=False, logging_level=logging.WARNING, include_dashboard=False)
        if self.address == "local":
            options.update(num_cpus=self.local_cpus)
        try:
            ray.init(address=self.address, **options)
        except Exception as exc:  # noqa: BLE001 - ray raises bare Exception when a node it starts is slow
            hint = ("a Ray started here did not come up (a machine this loaded starts it past Ray's 30 s limit)"
                    if self.address == "local" else
                    "start one with `ray start --head` and pass the address it prints, or --cluster local")
            raise ShardVerifyError(f"--cluster {self.address}: no Ray cluster to join ({exception_text(exc)}); "
                                   f"{hint}") from None
        self._connected = True
        return self

    def __exit__(self, *exc) -> None:
        ray = self.ray
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - an actor already gone
                pass
        self._actors.clear()
        if self._connected:
            ray.shutdown()
            self._connected = False

    # ------------------------------------------------------------------ running
    def _width(self, units: int) -> int:
        workers = self.workers or int(self.ray.cluster_resources().get("CPU", 1))
        return max(1, min(workers, units))

    def _start(self, starting: dict) -> None:
        """A new actor; its versions call is its first step towards taking units."""
        actor = self.ray.remote(num_cpus=1, max_restarts=0, max_task_retries=0)(_Worker).remote(
            self.setup, self.report)
        self._actors.append(actor)
        starting[actor.versions.remote()] = (actor, "versions")

    def _stop(self, actor) -> None:
        if actor in self._actors:
            self._actors.remove(actor)
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def run(self, units: Sequence[Unit], done: Callable[[int, Any], None]) -> list[Any]:
        """Every unit on the actors; ``self.retried`` counts the runs lost with a dead worker."""
        ray = self.ray
        results: list[Any] = [None] * len(units)
        queue = deque(range(len(units)))
        deaths = [0] * len(units)
        idle: list = []
        starting: dict = {}   # a new actor's versions or set-up call -> (actor, step)
        running: dict = {}    # unit call -> (actor, unit index)
        self.retried = self._failed_starts = 0
        width = self._width(len(units)) if units else 0
        for _ in range(width):
            self._start(starting)
        while queue or running:
            while queue and idle:
                actor, index = idle.pop(), queue.popleft()
                running[actor.run.remote(units[index].call, units[index].args)] = (actor, index)
            ready, _ = ray.wait([*running, *starting], num_returns=1,
                                timeout=None if running else self.wait_seconds)
            if not ready:
                raise ShardVerifyError(f"--cluster {self.address}: no Ray worker started in {self.wait_seconds:.0f} s "
                                       "(each needs one free CPU on some node: see `ray status`)")
            if ready[0] in starting:
                self._starting(ready[0], starting, idle, width)
                continue
            actor, index = running.pop(ready[0])
            value = self._result(ready[0], index, deaths)
            if value is _AGAIN or (isinstance(value, UnitFailed) and value.died):
                self._stop(actor)   # its worker is dead: a new one takes its place while units wait
                if value is _AGAIN:
                    self.retried += 1
                    queue.appendleft(index)   # runs again, on another worker
                if queue:
                    self._start(starting)
                if value is _AGAIN:
                    continue
            else:
                idle.append(actor)
            results[index] = value
            done(index, value)
        return results

    def _starting(self, ref, starting: dict, idle: list, width: int) -> None:
        """The next step of a new actor: its versions checked, then its set-up, then units."""
        actor, step = starting.pop(ref)
        try:
            answer = self.ray.get(ref)
        except self.ray.exceptions.RayActorError:   # died as it started (its node gone): another starts
            self._stop(actor)
            self._failed_starts += 1
            if self._failed_starts > 2 * width + 2:
                raise ShardVerifyError(f"--cluster {self.address}: {self._failed_starts} Ray workers died as they "
                                       "started (see the Ray logs under /tmp/ray on their nodes)") from None
            self._start(starting)
            return
        except self.ray.exceptions.RayTaskError as exc:   # its set-up raised: every worker would
            raise ShardVerifyError(f"--cluster {self.address}: a Ray worker could not set up: "
                                   f"{exception_text(getattr(exc, 'cause', None) or exc)}") from None
        if step == "versions":
            _check_versions(self.address, answer, installed_versions())
            starting[actor.set_up.remote()] = (actor, "set-up")
        else:
            idle.append(actor)

    def _result(self, ref, index: int, deaths: list[int]) -> Any:
        """A finished unit's value, a UnitFailed, or ``_AGAIN`` when its worker died the first time."""
        ray = self.ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            deaths[index] += 1
            if deaths[index] < DEATHS:
                return _AGAIN
            return UnitFailed(f"{WORKER_DIED}: {exception_text(exc)}", died=True)
        except ray.exceptions.RayTaskError as exc:   # the unit raised: it fails alone, its worker goes on
            cause = getattr(exc, "cause", None) or exc
            return UnitFailed(exception_text(cause), cause=cause if isinstance(cause, Exception) else None)
        except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot travel back: the unit fails alone
            return UnitFailed(exception_text(exc), cause=exc)


def _check_versions(address: str, theirs: dict, mine: dict) -> None:
    """A worker on other versions than this process refuses the run: its results are never mixed in."""
    if all(theirs.get(key) == mine[key] for key in ("torch", "shardverify")):
        return
    raise ShardVerifyError(
        f"--cluster {address}: the Ray worker on {theirs.get('host')} (pid {theirs.get('pid')}) runs torch "
        f"{theirs.get('torch')} and shardverify {theirs.get('shardverify')}, this process torch {mine['torch']} "
        f"and shardverify {mine['shardverify']}; results of two versions are never mixed in one report: install "
        f"torch=={mine['torch']} and shardverify {mine['shardverify']} on every node, or submit from a machine "
        "that has the nodes' versions")


_AGAIN = object()
