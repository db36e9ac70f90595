"""What a verification found, as frozen values, and the readable failure report built from them.

A result names everything a reader needs to reproduce the failure without re-running:
op, case, strategy, mesh, backend, and for each mismatch the rank, the tensor, the shapes,
the errors and the tolerance that was broken.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardverify.sharding.strategy import ShardingStrategy
    from shardverify.verify.error_map import ErrorMap

__all__ = ["Mismatch", "CheckResult", "format_results", "assert_passed", "output_label"]

# Mismatch kinds, in the order a report lists them.
KINDS = ("error", "shape", "dtype", "values", "collectives", "memory", "cost")


@dataclass(frozen=True)
class Mismatch:
    """One thing that differs from the single-device reference on one rank.

    ``kind``: "values" (numbers out of tolerance), "shape" (the local shard has the wrong
    shape), "dtype" (the local result has another dtype or device than the op gives), "collectives" (issued collectives differ from the declared actions), "memory"
    (declared memory cost differs from the local shard bytes), "cost" (declared compute or
    communication cost differs from the measured op call and collectives), "error" (the rank raised,
    died or hung; ``rank`` is -1 when every rank is concerned).

    A whole-model plan's check says where in the model: ``phase`` ("forward": a node's output,
    "backward": its output gradient, "owner": the node passing a wrong gradient back, "grad": an
    input's or a weight's gradient, "error"), the ``node`` and its ``order`` in the graph (of the
    node using the tensor, for "grad").

    A model check (DDP training against single-device training) says when: ``when`` ("step 2",
    or "after join" for the final model every rank holds), ``order`` the step (the final model
    after every step), ``phase`` the quantity compared ("loss", "grad", "param", "buffer") and
    ``tensor`` which one ("grad of '0.weight'").
    """

    kind: str
    rank: int
    tensor: str
    detail: str = ""
    actual_shape: tuple[int, ...] | None = None
    expected_shape: tuple[int, ...] | None = None
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    rtol: float | None = None
    atol: float | None = None
    dtype: str | None = None
    phase: str = ""
    node: str = ""
    order: int = 0
    error_map: ErrorMap | None = None   # where the values are wrong (kept for a report: error_map.py)
    when: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"mismatch kind {self.kind!r} is not one of {KINDS}")

    def describe(self) -> str:
        who = "all ranks" if self.rank < 0 else f"rank {self.rank}"
        if self.when:
            shape = f" shape {self.actual_shape}" if self.actual_shape else ""
            found = self.detail or (f"max abs err {self.max_abs_err:.3g}, max rel err {self.max_rel_err:.3g} "
                                    f"(tolerance atol={self.atol:g}, rtol={self.rtol:g})")
            return f"{self.when}, {who}: {self.tensor}{shape} differs from the reference: {found}"
        if self.phase:
            err = f": max abs error {self.max_abs_err or 0.0:.3g}" if self.kind != "error" else ""
            return f"{who}: {self.phase} {self.tensor} at node {self.node!r}{err}"
        if self.kind == "values":
            where = f"{who}: {self.tensor} (local shape {self.actual_shape}, {self.dtype}): "
            if self.detail:   # a non-finite disagreement, or a low-precision error budget
                return where + self.detail
            return (where + f"max abs error {self.max_abs_err:.3g}, max rel error {self.max_rel_err:.3g} "
                    f"exceed rtol={self.rtol:.3g}, atol={self.atol:.3g}")
        if self.kind == "shape":
            return (f"{who}: {self.tensor}: local shape {self.actual_shape} but the reference slice "
                    f"has shape {self.expected_shape}")
        return f"{who}: {self.tensor}: {self.detail}"


@dataclass(frozen=True)
class CheckResult:
    """The verdict on one strategy of one case on one mesh and backend."""

    op: str
    case: str
    strategy: str
    mesh_shape: tuple[int, ...]
    backend: str
    dtype: str
    mismatches: tuple[Mismatch, ...] = ()
    seconds: float = 0.0
    note: str = ""
    #: a failed strategy itself, kept with its mismatches' error maps for a report to draw
    #: (error_map.keep_error_maps); None otherwise
    checked: ShardingStrategy | None = None

    @property
    def passed(self) -> bool:
        return not self.mismatches

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({m.rank for m in self.mismatches}))

    @property
    def headline(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (f"{self.op}: strategy {self.strategy!r} on mesh {self.mesh_shape} "
                f"[{self.backend}, {self.dtype}] {verdict}\n    case: {self.case}")

    def report(self) -> str:
        """A multi-line description: headline, then one line per mismatch, grouped by kind."""
        lines = [self.headline]
        order = {kind: i for i, kind in enumerate(KINDS)}
        first_seen: dict[str, int] = {}
        for mismatch in self.mismatches:  # tensors in the order the check met them
            first_seen.setdefault(mismatch.tensor, len(first_seen))
        for mismatch in sorted(self.mismatches,
                               key=lambda m: (order[m.kind], first_seen[m.tensor], m.rank)):
            lines.append("    " + mismatch.describe())
        if self.note:
            lines.append(f"    note: {self.note}")
        return "\n".join(lines)

    __str__ = report

    def to_json(self) -> dict:
        return {"op": self.op, "case": self.case, "strategy": self.strategy,
                "mesh_shape": list(self.mesh_shape), "backend": self.backend, "dtype": self.dtype,
                "passed": self.passed, "seconds": round(self.seconds, 6), "note": self.note,
                "mismatches": [{"kind": m.kind, "rank": m.rank, "tensor": m.tensor, "detail": m.describe()}
                               for m in self.mismatches]}


def format_results(results: Iterable[CheckResult]) -> str:
    """The report of every failed result, then a count line."""
    results = list(results)
    failed = [r for r in results if not r.passed]
    body = "\n".join(r.report() for r in failed)
    summary = f"{len(failed)} of {len(results)} strategy check(s) failed"
    return f"{summary}\n{body}" if failed else summary


def assert_passed(results: CheckResult | Iterable[CheckResult]) -> None:
    """Fail a test with a readable report of every failed strategy (frames hidden in pytest)."""
    __tracebackhide__ = True
    results = [results] if isinstance(results, CheckResult) else list(results)
    if not results:
        raise AssertionError("no strategy was verified (an empty result list proves nothing)")
    if any(not r.passed for r in results):
        raise AssertionError(format_results(results))


def output_label(index: int, count: int, name: str) -> str:
    """How a check names output ``index`` of ``count`` (operand ``name``) in its mismatches and
    budgets: "output" for an op's only one, else "output <index> (<name>)"."""
    return "output" if count == 1 else f"output {index} ({name})"
