"""Plans made once a test session: a plan spec's simulated and process tests check the same plan,
and tests/test_hf_zoo.py asks what the zoo specs' plans do; each made the plan again (capture,
every node's strategies, the solver: seconds to a minute for a zoo model, several times over).

:func:`session_plan` makes a spec's plan (:func:`~shardverify.plan.spec.spec_plan` on a fresh
build) once per test session and hands the same (plan, coverage) to every test that asks for it
again, by what the plan is made from: the model (factory, kwargs, inputs or zoo name), the mesh,
the plan and the capture. Under pytest-xdist the workers share it through a folder of the
session's own ($SHARDVERIFY_SESSION_PLANS, made by the controller and removed at its end; see
the plugin): the first worker to ask makes it, holding the lock of its model and mesh, and one that
asks meanwhile waits for it instead of making it too. Outside a session (no folder) it is kept in
this process only. The model each test then runs is its own fresh build: only the plan is shared.

A plan spec names several plans per mesh (the solver's, goals, given ones), and each made alone
captured the model and derived every node's strategies again. So the first one asked brings the
mesh's others (``together``): they are made from its capture, its strategies and its cost problem.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pickle
from pathlib import Path

from shardverify.files import write_file_atomic

__all__ = ["PLANS_ENV", "session_plan"]

PLANS_ENV = "SHARDVERIFY_SESSION_PLANS"
_MADE: dict[str, tuple] = {}


def session_plan(factory: str, kwargs, inputs, mesh, plan, *, zoo: str = "", capture: str = "fx",
                 cost_size: tuple | None = None, where_factory=None, where_plan=None, together=()) -> tuple:
    """(Plan, Coverage) of ``plan`` (a :func:`~shardverify.plan.spec.spec_plan` plan: ``"solver"``,
    a goal, or node -> strategy pairs) for the model :func:`~shardverify.plan.spec.build_spec_model`
    builds from ``factory``/``kwargs``/``inputs``/``zoo`` on ``mesh``, solved at ``cost_size``
    (a spec's ``cost_size`` field) when given; made once a session. Errors are the spec's
    (``where_*``), raised to every test that asks (nothing is kept of a plan that failed).

    ``together``: the other plans the session will ask of this model on this mesh. Those not made
    yet are made with ``plan``, from its capture and its nodes' strategies (not at a ``cost_size``),
    and kept for when they are asked; one that fails is left to be asked (and to fail) alone."""
    key = _key(factory, kwargs, inputs, zoo, mesh, plan, capture, cost_size)
    if key in _MADE:
        return _MADE[key]
    others: dict[str, object] = {}   # key -> plan, of the others not made yet in this process
    for other in () if cost_size is not None else together:
        found = _key(factory, kwargs, inputs, zoo, mesh, other, capture, cost_size)
        if found != key and found not in _MADE:
            others.setdefault(found, other)
    folder = os.environ.get(PLANS_ENV)
    if not folder or not Path(folder).is_dir():
        return _made_now(factory, kwargs, inputs, mesh, {key: plan, **others}, zoo, capture, cost_size,
                         where_factory, where_plan, None)
    saved = Path(folder) / f"{key}.pickle"
    # one lock per model and mesh: its plans are made together, and a worker asking for any of them
    # meanwhile waits for them instead of making it too
    group = _key(factory, kwargs, inputs, zoo, mesh, None, capture, cost_size)
    with open(Path(folder) / f"{group}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if saved.exists():
            _MADE[key] = pickle.loads(saved.read_bytes())
            return _MADE[key]
        others = {other: asked for other, asked in others.items() if not (Path(folder) / f"{other}.pickle").exists()}
        return _made_now(factory, kwargs, inputs, mesh, {key: plan, **others}, zoo, capture, cost_size,
                         where_factory, where_plan, Path(folder))


def _key(factory, kwargs, inputs, zoo, mesh, plan, capture, cost_size) -> str:
    return hashlib.sha256(repr((factory, kwargs, inputs, zoo, tuple(mesh), _frozen(plan), capture, cost_size)
                               ).encode()).hexdigest()[:32]


def _frozen(plan):
    """A plan as the key holds it: a word, or its (node, strategy) pairs."""
    return plan if isinstance(plan, str) or plan is None else tuple(dict(plan).items())


def _made_now(factory, kwargs, inputs, mesh, wanted: dict, zoo, capture, cost_size, where_factory, where_plan,
              folder: Path | None) -> tuple:
    """Make ``wanted`` (key -> plan, the plan asked first); keep (and save in ``folder``) each one
    made; the first's (plan, coverage), or its error raised."""
    made = _make(factory, kwargs, inputs, mesh, list(wanted.values()), zoo, capture, cost_size, where_factory,
                 [where_plan] + [None] * (len(wanted) - 1))
    for key, found in zip(wanted, made):
        if isinstance(found, BaseException):
            continue
        if folder is not None:
            write_file_atomic(folder / f"{key}.pickle", pickle.dumps(found))     # whole or absent
        _MADE[key] = found
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def _make(factory, kwargs, inputs, mesh, plans, zoo, capture, cost_size, where_factory, where_plans) -> list:
    from shardverify.plan.spec import build_spec_model, spec_cost_size, spec_plan, spec_plans

    module, example = build_spec_model(factory, kwargs, inputs, where=where_factory, zoo=zoo)
    if len(plans) > 1:
        return [found if isinstance(found, BaseException) else tuple(found)
                for found in spec_plans(module, example, tuple(mesh), plans, where_plans, capture=capture)]
    real = spec_cost_size(factory, kwargs, cost_size, where_factory, zoo)
    return [tuple(spec_plan(module, example, tuple(mesh), plans[0], where=where_plans[0], capture=capture,
                            cost_size=real))]
