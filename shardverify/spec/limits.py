"""Size limits on what a spec may ask for, each with a clear error and an override.

A spec is a small file that expands into work: a grid of 10^6 points is a gigabyte of
generated code, a mesh of 10^6 ranks a million threads, a 10^5 x 10^5 weight 80 GB of
float64 reference. Each limit is far above what a useful spec needs, is named in its
error, and can be raised through an environment variable (documented in specs/README.md).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

from shardverify.errors import SpecError

__all__ = ["Limit", "SettingError", "MAX_CASES", "MAX_MESH_RANKS", "MAX_MESH_AXES", "MAX_TENSOR_ELEMENTS",
           "MAX_MODEL_BYTES", "MAX_RESHARD_PAIRS", "MAX_AUDIT_COMBINATIONS", "MAX_STEPS", "MAX_MICRO_BATCHES", "MAX_CASE_BYTES",
           "MAX_JSON_BYTES", "LIMITS", "check_settings", "mesh_problem", "tensor_size_problems"]


class SettingError(SpecError):
    """A limit setting (environment variable) that is not a positive integer: one error for the
    whole run, naming the setting, never repeated per spec."""


@dataclass(frozen=True)
class Limit:
    """A default bound that the environment variable ``env`` may raise or lower."""

    what: str
    default: int
    env: str

    @property
    def value(self) -> int:
        text = os.environ.get(self.env)
        if text is None or text.strip() == "":
            return self.default
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise SettingError(f"{text!r} is not a positive integer (the limit on {self.what})",
                               file=f"environment variable {self.env}")
        return value

    def exceeded(self, amount: int) -> str:
        """"" within the limit, else the message that says so and how to raise it."""
        limit = self.value
        if amount <= limit:
            return ""
        return f"{amount} {self.what} exceed the limit of {limit} (raise it with {self.env}=N)"


MAX_CASES = Limit("cases (targets x grid points)", 512, "SHARDVERIFY_MAX_CASES")
MAX_MESH_RANKS = Limit("ranks in one mesh", 64, "SHARDVERIFY_MAX_RANKS")
#: size-1 axes add no ranks but every axis adds layouts, groups and recursion depth
MAX_MESH_AXES = Limit("axes in one mesh", 4, "SHARDVERIFY_MAX_MESH_AXES")
#: optimizer steps of one model (DDP) check
MAX_STEPS = Limit("optimizer steps of one model check", 1000, "SHARDVERIFY_MAX_STEPS")
#: forward and backward passes of one model (DDP) check: steps x accumulate (micro-batches per step)
MAX_MICRO_BATCHES = Limit("micro-batches of one model check (steps x accumulate)", 4096,
                          "SHARDVERIFY_MAX_MICRO_BATCHES")
#: a saved JSON run (`dtensor --from-json`) or a plan file read whole
MAX_JSON_BYTES = Limit("bytes of one JSON or plan file", 64 << 20, "SHARDVERIFY_MAX_JSON_BYTES")
MAX_TENSOR_ELEMENTS = Limit("elements in one tensor", 1 << 24, "SHARDVERIFY_MAX_TENSOR_ELEMENTS")
#: (source, target) layout pairs a reshard spec may enumerate for one tensor, before pruning
MAX_RESHARD_PAIRS = Limit("layout pairs (before symmetry pruning)", 1 << 17, "SHARDVERIFY_MAX_RESHARD_PAIRS")
#: layout combinations the audit enumerates for one case on one mesh (each holds an outcome)
MAX_AUDIT_COMBINATIONS = Limit("layout combinations of one case", 500_000, "SHARDVERIFY_MAX_AUDIT_COMBINATIONS")
#: what a plan or model spec's factory may build (measured on meta tensors before anything is allocated)
MAX_MODEL_BYTES = Limit("bytes of parameters and buffers", 1 << 30, "SHARDVERIFY_MAX_MODEL_BYTES")


def _ram_fraction() -> int:
    """A quarter of this machine's RAM (4 GiB where it cannot be read): the default bound on
    what one case's check may hold."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30


#: what one op case's check is estimated to hold (operands, parameters, reference, every rank's
#: copies) before anything is allocated (verify/memory.py)
MAX_CASE_BYTES = Limit("estimated bytes of one case's check", _ram_fraction(), "SHARDVERIFY_MAX_CASE_BYTES")

LIMITS = (MAX_CASES, MAX_MESH_RANKS, MAX_MESH_AXES, MAX_TENSOR_ELEMENTS, MAX_RESHARD_PAIRS, MAX_AUDIT_COMBINATIONS,
          MAX_MODEL_BYTES, MAX_STEPS, MAX_MICRO_BATCHES, MAX_JSON_BYTES, MAX_CASE_BYTES)


def check_settings() -> None:
    """Every limit setting read once: a bad one is one SettingError naming it, raised before any
    spec is read (instead of once per spec, at whichever field first consulted it)."""
    for limit in LIMITS:
        limit.value  # noqa: B018 - read for its validation


def mesh_problem(shape: tuple[int, ...]) -> str:
    """"" for a mesh within the axis and rank limits, else what is over (size-1 axes count as
    axes: they add no rank but every layout and group is built per axis)."""
    message = MAX_MESH_AXES.exceeded(len(shape))
    return message or MAX_MESH_RANKS.exceeded(math.prod(shape))


def tensor_size_problems(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> list[str]:
    """For (name, shape) pairs: a message for each tensor above MAX_TENSOR_ELEMENTS."""
    problems = []
    for name, shape in shapes:
        message = MAX_TENSOR_ELEMENTS.exceeded(math.prod(shape))
        if message:
            problems.append(f"{name} of shape {list(shape)}: {message}")
    return problems
