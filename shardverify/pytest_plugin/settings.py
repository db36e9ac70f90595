"""The plugin's settings: AUTO_PARALLEL, --sv-backend, --sv-timeout and --sv-device (command line
over ini over defaults), each read and validated once at startup, so a typo stops the run
instead of silently skipping or hanging."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest

from shardverify.backends import registry

__all__ = ["ENV_FLAG", "BACKEND_KINDS", "DEVICE_POLICIES", "DEFAULT_BACKEND", "DEFAULT_TIMEOUT", "DEFAULT_DEVICE",
           "ENABLE_HINT", "SKIP_REASON", "Settings", "parse_auto_parallel", "parse_timeout", "parse_choice",
           "resolve_settings"]

ENV_FLAG = "AUTO_PARALLEL"
#: the kinds a test may get: threads, or a pool the plugin places by --sv-device (backends/registry.py)
BACKEND_KINDS = registry.backend_names(registry.placed_by_policy)
DEVICE_POLICIES = registry.DEVICE_POLICIES
DEFAULT_BACKEND = registry.DEFAULT_KIND
DEFAULT_TIMEOUT = 60.0
DEFAULT_DEVICE = "auto"

ENABLE_HINT = f"run them with {ENV_FLAG}=1 pytest ..."
SKIP_REASON = f"multi-process test (marked dist): {ENABLE_HINT}"


@dataclass(frozen=True)
class Settings:
    """The plugin's resolved configuration (command line over ini over defaults)."""

    auto_parallel: bool
    backend: str        # default kind for tests not marked dist: "simulated" | "process"
    timeout: float      # seconds per check (one backend.run)
    device: str         # process backend placement: "auto" | "cpu" | "cuda"


def parse_auto_parallel(value: str | None) -> bool:
    """AUTO_PARALLEL: unset or "0" skips dist tests, "1" runs them; anything else is a typo
    that would otherwise skip silently, so it is rejected."""
    if value is None or value == "0":
        return False
    if value == "1":
        return True
    raise pytest.UsageError(
        f"{ENV_FLAG}={value!r} is not a valid value: expected it unset, '0' (skip multi-process "
        f"tests) or '1' (run them), e.g. {ENV_FLAG}=1 pytest -n auto")


def parse_timeout(value: object, source: str) -> float:
    """A positive, finite number of seconds."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise pytest.UsageError(f"{source}={value!r} is not a valid timeout: expected a positive "
                                f"number of seconds, e.g. 60")
    return seconds


def parse_choice(value: str, choices: Sequence[str], source: str) -> str:
    if value not in choices:
        raise pytest.UsageError(f"{source}={value!r} is not valid: expected one of "
                                f"{', '.join(repr(c) for c in choices)}")
    return value


def resolve_settings(config: pytest.Config, environ: Mapping[str, str] = os.environ) -> Settings:
    """Read and validate every setting once, at startup, so mistakes stop the run."""
    def pick(option: str, ini: str) -> tuple[object, str]:
        value = config.getoption(option)
        if value is not None:
            return value, "--" + option.replace("_", "-")
        return config.getini(ini) or None, f"ini {ini}"

    backend, backend_src = pick("sv_backend", "sv_backend")
    backend = parse_choice(str(backend), BACKEND_KINDS, backend_src) if backend else DEFAULT_BACKEND
    device, src = pick("sv_device", "sv_device")
    device = parse_choice(str(device), DEVICE_POLICIES, src) if device else DEFAULT_DEVICE
    timeout, src = pick("sv_timeout", "sv_timeout")
    timeout = parse_timeout(timeout, src) if timeout is not None else DEFAULT_TIMEOUT
    settings = Settings(parse_auto_parallel(environ.get(ENV_FLAG)), backend, timeout, device)
    if registry.backend_kind(settings.backend).processes and not settings.auto_parallel:
        raise pytest.UsageError(f"{backend_src}={settings.backend!r} starts worker processes, which "
                                f"{ENV_FLAG}=1 must allow: {ENV_FLAG}=1 pytest --sv-backend process")
    return settings

