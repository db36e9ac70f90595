"""Results of a model check and the readable assertion failure built from them.

What differs is a :class:`~shardverify.verify.report.Mismatch`, as any check's, saying when
(the step, or after join), on which rank, which quantity of which parameter, its shape, the
errors and the tolerance they broke."""

from __future__ import annotations

from dataclasses import dataclass

from shardverify.features.ddp.plan import ModelPlan
from shardverify.verify.report import Mismatch
from shardverify.verify.tolerance import Tolerance

__all__ = ["ModelResult", "assert_model_passed", "model_mismatch", "model_order", "QUANTITIES", "AFTER_JOIN"]

QUANTITIES = ("loss", "grad", "param", "buffer")
AFTER_JOIN = "after join"   # when the final model, which join hands every rank, is compared
_SHOWN = 8  # mismatches listed in a failure message
_LAST = 1 << 30   # the order of what differs after join: after every step's


def model_mismatch(kind: str, step: int | None, rank: int, quantity: str, name: str, tol: Tolerance,
                   **found) -> Mismatch:
    """What differs in ``quantity`` (one of QUANTITIES) of parameter or buffer ``name`` ("" for
    the loss) on ``rank`` after optimizer step ``step`` (None: after join), compared within
    ``tol``; ``found``: the shapes, errors or detail (Mismatch's fields)."""
    return Mismatch(kind, rank, quantity if not name else f"{quantity} of {name!r}", rtol=tol.rtol, atol=tol.atol,
                    phase=quantity, when=AFTER_JOIN if step is None else f"step {step}",
                    order=_LAST if step is None else step, **found)


def model_order(mismatch: Mismatch) -> tuple:
    """Earliest step first, then loss, gradients, parameters, buffers, by name, then rank."""
    return mismatch.order, QUANTITIES.index(mismatch.phase), mismatch.tensor, mismatch.rank


@dataclass(frozen=True)
class ModelResult:
    """Every rank's mismatches (sorted, earliest step first) and how many values were compared."""

    plan: ModelPlan
    mesh_shape: tuple[int, ...]
    mismatches: tuple[Mismatch, ...]
    compared: int

    @property
    def differs(self) -> bool:
        return bool(self.mismatches)

    @property
    def passed(self) -> bool:
        if self.compared == 0:
            return False
        return self.differs == (self.plan.expect == "differ")

    def title(self) -> str:
        return (f"model {self.plan.describe()} on mesh {self.mesh_shape} "
                f"({self.plan.steps} step(s), expect {self.plan.expect})")

    def failure_message(self) -> str:
        if self.compared == 0:
            return f"{self.title()}: nothing was compared; the check is vacuous"
        if self.plan.expect == "differ" and not self.differs:
            return (f"{self.title()}: expected DDP to differ from single-device training, but all "
                    f"{self.compared} compared values matched; the harness failed to detect the "
                    f"difference this plan is declared to have")
        lines = [f"{self.title()}: DDP training differs from single-device training "
                 f"({len(self.mismatches)} mismatch(es) in {self.compared} compared values)"]
        lines += [f"  {m.describe()}" for m in self.mismatches[:_SHOWN]]
        if len(self.mismatches) > _SHOWN:
            lines.append(f"  ... and {len(self.mismatches) - _SHOWN} more")
        return "\n".join(lines)


def assert_model_passed(result: ModelResult) -> None:
    """Raise AssertionError with the readable report unless the result meets its expectation."""
    __tracebackhide__ = True
    if not result.passed:
        raise AssertionError(result.failure_message())
