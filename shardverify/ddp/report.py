"""Results of a model check and the readable assertion failure built from them."""

from __future__ import annotations

from dataclasses import dataclass

from shardverify.ddp.plan import ModelPlan

__all__ = ["Mismatch", "ModelResult", "assert_model_passed", "QUANTITIES"]

QUANTITIES = ("loss", "grad", "param", "buffer")
_SHOWN = 8  # mismatches listed in a failure message


@dataclass(frozen=True)
class Mismatch:
    """One quantity on one rank after one step that differs from the single-device reference.

    step None means after `join` finished (the final model every rank must agree on)."""

    step: int | None
    rank: int
    quantity: str             # one of QUANTITIES
    name: str                 # fully qualified parameter / buffer name; "" for the loss
    max_abs: float
    max_rel: float
    rtol: float
    atol: float
    shape: tuple[int, ...] = ()
    note: str = ""

    def sort_key(self) -> tuple:
        return (self.step if self.step is not None else 1 << 30, QUANTITIES.index(self.quantity),
                self.name, self.rank)

    def describe(self) -> str:
        when = "after join" if self.step is None else f"step {self.step}"
        what = self.quantity if not self.name else f"{self.quantity} of {self.name!r}"
        detail = self.note or (f"max abs err {self.max_abs:.3g}, max rel err {self.max_rel:.3g} "
                               f"(tolerance atol={self.atol:g}, rtol={self.rtol:g})")
        shape = f" shape {tuple(self.shape)}" if self.shape else ""
        return f"{when}, rank {self.rank}: {what}{shape} differs from the reference: {detail}"


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
