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

__all__ = ["Limit", "MAX_CASES", "MAX_MESH_RANKS", "MAX_TENSOR_ELEMENTS", "MAX_MODEL_BYTES", "MAX_RESHARD_PAIRS", "MAX_AUDIT_COMBINATIONS",
           "tensor_size_problems"]


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
            raise SpecError(f"{text!r} is not a positive integer (the limit on {self.what})",
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
MAX_TENSOR_ELEMENTS = Limit("elements in one tensor", 1 << 24, "SHARDVERIFY_MAX_TENSOR_ELEMENTS")
#: (source, target) layout pairs a reshard spec may enumerate for one tensor, before pruning
MAX_RESHARD_PAIRS = Limit("layout pairs (before symmetry pruning)", 1 << 17, "SHARDVERIFY_MAX_RESHARD_PAIRS")
#: layout combinations the audit enumerates for one case on one mesh (each holds an outcome)
MAX_AUDIT_COMBINATIONS = Limit("layout combinations of one case", 500_000, "SHARDVERIFY_MAX_AUDIT_COMBINATIONS")
#: what a plan or model spec's factory may build (measured on meta tensors before anything is allocated)
MAX_MODEL_BYTES = Limit("bytes of parameters and buffers", 1 << 30, "SHARDVERIFY_MAX_MODEL_BYTES")


def tensor_size_problems(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> list[str]:
    """For (name, shape) pairs: a message for each tensor above MAX_TENSOR_ELEMENTS."""
    problems = []
    for name, shape in shapes:
        message = MAX_TENSOR_ELEMENTS.exceeded(math.prod(shape))
        if message:
            problems.append(f"{name} of shape {list(shape)}: {message}")
    return problems
