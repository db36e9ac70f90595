"""Plans made once a test session: a plan spec's simulated and process tests check the same plan,
and tests/test_hf_zoo.py asks what the zoo specs' plans do; each made the plan again (capture,
every node's strategies, the solver: seconds to a minute for a zoo model, several times over).

:func:`session_plan` makes a spec's plan (:func:`~shardverify.plan.spec.spec_plan` on a fresh
build) once per test session and hands the same (plan, coverage) to every test that asks for it
again, by what the plan is made from: the model (factory, kwargs, inputs or zoo name), the mesh,
the plan and the capture. Under pytest-xdist the workers share it through a folder of the
session's own ($SHARDVERIFY_SESSION_PLANS, made by the controller and removed at its end; see
the plugin): the first worker to ask makes it, holding a lock on its file, and one that asks
meanwhile waits for it instead of making it too. Outside a session (no folder) it is kept in
this process only. The model each test then runs is its own fresh build: only the plan is shared.
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
                 cost_size: tuple | None = None, where_factory=None, where_plan=None) -> tuple:
    """(Plan, Coverage) of ``plan`` (a :func:`~shardverify.plan.spec.spec_plan` plan: ``"solver"``,
    a goal, or node -> strategy pairs) for the model :func:`~shardverify.plan.spec.build_spec_model`
    builds from ``factory``/``kwargs``/``inputs``/``zoo`` on ``mesh``, solved at ``cost_size``
    (a spec's ``cost_size`` field) when given; made once a session. Errors are the spec's
    (``where_*``), raised to every test that asks (nothing is kept of a plan that failed)."""
    key = hashlib.sha256(repr((factory, kwargs, inputs, zoo, tuple(mesh), plan, capture, cost_size)).encode()
                         ).hexdigest()[:32]
    if key in _MADE:
        return _MADE[key]
    folder = os.environ.get(PLANS_ENV)
    if not folder or not Path(folder).is_dir():
        _MADE[key] = _make(factory, kwargs, inputs, mesh, plan, zoo, capture, cost_size, where_factory, where_plan)
        return _MADE[key]
    saved = Path(folder) / f"{key}.pickle"
    with open(Path(folder) / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # another worker making this plan: wait for it, then read it
        if saved.exists():
            made = pickle.loads(saved.read_bytes())
        else:
            made = _make(factory, kwargs, inputs, mesh, plan, zoo, capture, cost_size, where_factory, where_plan)
            write_file_atomic(saved, pickle.dumps(made))     # whole or absent
    _MADE[key] = made
    return made


def _make(factory, kwargs, inputs, mesh, plan, zoo, capture, cost_size, where_factory, where_plan) -> tuple:
    from shardverify.plan.spec import build_spec_model, spec_cost_size, spec_plan

    module, example = build_spec_model(factory, kwargs, inputs, where=where_factory, zoo=zoo)
    real = spec_cost_size(factory, kwargs, cost_size, where_factory, zoo)
    return tuple(spec_plan(module, example, tuple(mesh), plan, where=where_plan, capture=capture, cost_size=real))
