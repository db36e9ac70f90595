"""Hypothesis profiles for exploration: ``ci`` (few reproducible examples, no deadline) and
``dev`` (a wider random search, failures remembered), chosen by $SV_HYPOTHESIS_PROFILE."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

from shardverify.errors import InvalidArgument

__all__ = ["PROFILE_ENV", "PROFILES", "load_profile", "profile_settings"]

PROFILE_ENV = "SV_HYPOTHESIS_PROFILE"

# ci: few, reproducible examples; every check is a multi-rank run, so no deadline and no
# "too slow" health check (both would make CI flaky on a busy machine), no example database.
settings.register_profile("ci", max_examples=8, derandomize=True, deadline=None, database=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
# dev: a wider random search, failures remembered in .hypothesis/ and replayed first.
settings.register_profile("dev", max_examples=100, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILES = ("ci", "dev")


def _profile_name(name: str | None) -> str:
    name = name if name is not None else os.environ.get(PROFILE_ENV, "ci")
    if name not in PROFILES:
        raise InvalidArgument(f"hypothesis profile {name!r} (from {PROFILE_ENV} or the argument) "
                              f"is not one of {PROFILES}")
    return name


def load_profile(name: str | None = None) -> str:
    """Load the ``ci`` or ``dev`` profile (default: $SV_HYPOTHESIS_PROFILE, else ``ci``)."""
    name = _profile_name(name)
    settings.load_profile(name)
    return name


def profile_settings(name: str | None = None, *, fraction: float = 1.0, **changes) -> settings:
    """The named profile (default as in :func:`load_profile`), with ``max_examples`` scaled by
    ``fraction`` (at least 1) -- the multi-process tests run fewer examples."""
    if not 0 < fraction <= 1:
        raise InvalidArgument(f"fraction={fraction!r} must be in (0, 1]")
    parent = settings.get_profile(_profile_name(name))
    examples = max(1, int(parent.max_examples * fraction))
    # drawn calls the op itself refuses are rejected (a grouped conv's channels that groups do not
    # divide): many for an op whose shapes are coupled by a parameter, which is no failure
    changes["suppress_health_check"] = [*changes.get("suppress_health_check", ()), HealthCheck.filter_too_much]
    return settings(parent, max_examples=examples, **changes)

