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
    others: list = []
    for other in map(_frozen, () if cost_size is not None else together):   # a plan may hold dicts: no set
        if other != _frozen(plan) and other not in others and \
                _key(factory, kwargs, inputs, zoo, mesh, other, capture, cost_size) not in _MADE:
            others.append(other)
    folder = os.environ.get(PLANS_ENV)
    if not folder or not Path(folder).is_dir():
        return _made_now(factory, kwargs, inputs, mesh, plan, others, zoo, capture, cost_size, where_factory,
                         where_plan, None)
    saved = Path(folder) / f"{key}.pickle"
    # one lock per model and mesh: its plans are made together, and a worker asking for any of them
    # meanwhile waits for them instead of making it too
    group = _key(factory, kwargs, inputs, zoo, mesh, None, capture, cost_size)
    with open(Path(folder) / f"{group}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if saved.exists():
            _MADE[key] = pickle.loads(saved.read_bytes())
            return _MADE[key]
        others = [other for other in others
                  if not (Path(folder) / f"{_key(factory, kwargs, inputs, zoo, mesh, other, capture, cost_size)}.pickle"
                          ).exists()]
        return _made_now(factory, kwargs, inputs, mesh, plan, others, zoo, capture, cost_size, where_factory,
                         where_plan, Path(folder))


def _key(factory, kwargs, inputs, zoo, mesh, plan, capture, cost_size) -> str:
    return hashlib.sha256(repr((factory, kwargs, inputs, zoo, tuple(mesh), _frozen(plan), capture, cost_size)
                               ).encode()).hexdigest()[:32]


def _frozen(plan):
    """A plan as the key holds it: a word, or its (node, strategy) pairs."""
    return plan if isinstance(plan, str) or plan is None else tuple(dict(plan).items())


def _made_now(factory, kwargs, inputs, mesh, plan, others, zoo, capture, cost_size, where_factory, where_plan,
              folder: Path | None) -> tuple:
    """Make ``plan`` and ``others``; keep (and save in ``folder``) each one made; ``plan``'s
    (plan, coverage), or its error raised."""
    wanted = [plan, *others]
    made = _make(factory, kwargs, inputs, mesh, wanted, zoo, capture, cost_size, where_factory,
                 [where_plan] + [None] * len(others))
    for asked, found in zip(wanted, made):
        if isinstance(found, BaseException):
            continue
        key = _key(factory, kwargs, inputs, zoo, mesh, asked, capture, cost_size)
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
